"""Closed by default: the proxy is published beyond loopback only with client keys, or when the
user says in so many words that it may run open.

Why: Docker-published ports bypass host firewalls such as ufw, so a proxy published on 0.0.0.0
without keys is an open LLM endpoint on every network the host is on. keygen (which already
knows whether secrets/api_keys has a key) runs this before anything starts, so `docker compose up`
fails with the reason instead of starting an open proxy. An explicit opt-out rather than a key
generated on the fly: a generated key would turn a working open setup into 401s for every client
with the fix hidden in a log; a refusal names both ways out. Standard library only.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

BIND_ENV = "KIT_PROXY_BIND_ADDRESS"  # .env PROXY_BIND_ADDRESS
OPEN_ENV = "KIT_PROXY_OPEN_WITHOUT_KEYS"  # .env PROXY_OPEN_WITHOUT_KEYS
YES = ("1", "true", "on")
NO = ("0", "false", "off", "")


def is_loopback(address: str) -> bool:
    """Whether a published host address reaches this host only (127.0.0.0/8, ::1, localhost)."""
    host = address.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def has_keys(text: str) -> bool:
    """Whether an api_keys file holds a key (a line that is neither blank nor a # comment)."""
    return any(line.strip() and not line.strip().startswith("#") for line in text.splitlines())


def refusal(env: Mapping[str, str], keys_text: str) -> str | None:
    """Why the proxy must not start as configured, or None. ValueError for a bad opt-out."""
    address = env.get(BIND_ENV, "").strip() or "127.0.0.1"
    word = env.get(OPEN_ENV, "").strip().lower()
    if word not in YES + NO:
        raise ValueError(f"{OPEN_ENV}={word!r} (PROXY_OPEN_WITHOUT_KEYS): want 1/true/on or 0/off")
    if is_loopback(address) or has_keys(keys_text) or word in YES:
        return None
    return (
        f"PROXY_BIND_ADDRESS={address} publishes the proxy beyond this host, and secrets/api_keys "
        "has no client key: anyone who reaches the port could use the model (Docker-published "
        "ports bypass host firewalls such as ufw). Put a key in secrets/api_keys (one per line), "
        "or set PROXY_BIND_ADDRESS=127.0.0.1, or set PROXY_OPEN_WITHOUT_KEYS=1 to run it open "
        "on purpose"
    )
