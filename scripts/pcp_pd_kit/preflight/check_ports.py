"""Host ports Compose will publish are free: PROXY_PORT on all addresses, PROMETHEUS_PORT and
GRAFANA_PORT (and PREFILL_PORT/DECODE_PORT when compose.yaml publishes them) on BIND_ADDRESS.
A port held by the kit's own running stack is fine: `up` keeps it."""

from __future__ import annotations

import errno
import socket

from pcp_pd_kit.preflight import proc
from pcp_pd_kit.preflight.context import QUICK_S, Context
from pcp_pd_kit.preflight.network import PROJECT_LABEL
from pcp_pd_kit.preflight.report import Result, fail, ok, warn
from pcp_pd_kit.preflight.settings import SettingsError

CHECK = "ports"
ALL_ADDRESSES = "0.0.0.0"


def ports(ctx: Context) -> list[Result]:
    s = ctx.need_settings()
    try:
        bind = s.address("bind_address")
        proxy = s.address("proxy_bind_address") if s.has("proxy_bind_address") else ALL_ADDRESSES
    except SettingsError as exc:
        return [fail(CHECK, str(exc))]
    specs = [("proxy_port", proxy), ("prometheus_port", bind), ("grafana_port", bind)]
    specs += [(key, bind) for key in ("prefill_port", "decode_port") if s.has(key)]
    results: list[Result] = []
    owners: dict[int, str] = {}
    free: list[str] = []
    for key, address in specs:
        env = s.env(key)
        try:
            port = s.port(key)
        except SettingsError as exc:
            results.append(fail(CHECK, str(exc)))
            continue
        if port in owners:
            msg = f"{owners[port]} and {env} are both {port}: give each its own port in "
            msg += f"{ctx.env_label}."
            results.append(fail(CHECK, msg))
            continue
        owners[port] = env
        state = probe(address, port)
        if state == "busy" and _held_by_own_stack(ctx, port):
            free.append(f"{env} {port} (held by the kit's running stack)")
        elif state == "busy":
            msg = (
                f"port {port} ({env}) is already in use on {address}: stop whatever listens there "
                f"(ss -ltnp 'sport = :{port}') or set {env} in {ctx.env_label}."
            )
            results.append(fail(CHECK, msg))
        elif state == "no-address":
            which = "PROXY_BIND_ADDRESS" if key == "proxy_port" else "BIND_ADDRESS"
            msg = (
                f"{which}={address} is not an address of this host, so Docker cannot publish "
                f"{env} on it: set {which} in {ctx.env_label} to 127.0.0.1 or one of this "
                "host's addresses."
            )
            results.append(fail(CHECK, msg))
        elif state:
            results.append(
                warn(CHECK, f"could not test port {port} ({env}) on {address}: {state}.")
            )
        else:
            where = "all addresses" if address == ALL_ADDRESSES else address
            free.append(f"{env} {port} on {where}")
    if not any(r.status == "FAIL" for r in results):
        results.insert(0, ok(CHECK, "host ports free: " + ", ".join(free)))
    return results


def probe(address: str, port: int) -> str:
    """'' when `port` can be bound on `address` the way Docker binds it (SO_REUSEADDR, so only a
    listener conflicts), 'busy', 'no-address', or another reason it could not be tested."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "busy"
            if exc.errno == errno.EADDRNOTAVAIL:
                return "no-address"
            if exc.errno == errno.EACCES:  # a port below 1024 without root: ask it instead
                return _answers(family, address, port)
            return str(exc)
    return ""


def _answers(family: int, address: str, port: int) -> str:
    target = (
        ("::1" if family == socket.AF_INET6 else "127.0.0.1")
        if address in (ALL_ADDRESSES, "::")
        else address
    )
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return "busy" if sock.connect_ex((target, port)) == 0 else ""


def _held_by_own_stack(ctx: Context, port: int) -> bool:
    if ctx.info is None or ctx.view is None or not ctx.view.project:
        return False
    argv = [ctx.docker, "ps", "--filter", f"label={PROJECT_LABEL}={ctx.view.project}",
            "--format", "{{.Ports}}"]  # fmt: skip
    out = proc.run(argv, QUICK_S)
    return out.ok and f":{port}->" in out.stdout
