"""The kit's settings as Compose itself resolves them: `docker compose config --format json` merges
the environment, the env file and compose.yaml's defaults, and preflight reads the resolved
top-level `x-kit-settings` block. No .env parser of our own, so preflight and `up` cannot disagree.
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SETTINGS_KEY = "x-kit-settings"

#: Each setting preflight reads, and the variable a user sets for it (compose.yaml maps them).
ENV_NAMES: dict[str, str] = {
    "model_name": "MODEL_NAME",
    "vllm_image": "VLLM_IMAGE",
    "prefill_tp_size": "PREFILLER_TP_SIZE",
    "prefill_pcp_size": "PREFILLER_PCP_SIZE",
    "decode_tp_size": "DECODER_TP_SIZE",
    "prefill_gpus": "PREFILL_GPUS",
    "decode_gpus": "DECODE_GPUS",
    "prefill_gpu_memory_utilization": "PREFILL_GPU_MEMORY_UTILIZATION",
    "decode_gpu_memory_utilization": "DECODE_GPU_MEMORY_UTILIZATION",
    "moe_backend": "MOE_BACKEND",
    "max_model_len": "MAX_MODEL_LEN",
    "hf_cache_dir": "HF_CACHE_DIR",
    "pd_subnet": "PD_SUBNET",
    "proxy_port": "PROXY_PORT",
    "prometheus_port": "PROMETHEUS_PORT",
    "grafana_port": "GRAFANA_PORT",
    "bind_address": "BIND_ADDRESS",
}
REQUIRED = tuple(ENV_NAMES)
#: Where the Hugging Face token is: a file, or `hf_token` in the folder of Compose secrets.
TOKEN_KEYS = ("hf_token_file", "secrets_dir")
#: Read when present: the token's place, the proxy's address, the cpu profile's model, the
#: servers' ports if compose.yaml publishes them, the GPU servers' eager switch and the replicas.
OPTIONAL_ENV_NAMES: dict[str, str] = {
    "hf_token_file": "HF_TOKEN_FILE",
    "secrets_dir": "KIT_SECRETS_DIR",
    "proxy_bind_address": "PROXY_BIND_ADDRESS",
    "cpu_model_name": "CPU_MODEL_NAME",
    "prefill_port": "PREFILL_PORT",
    "decode_port": "DECODE_PORT",
    "enforce_eager": "ENFORCE_EAGER",
    # xPyD: servers per role (compose's `scale`); 1 when the block lacks them.
    "prefill_replicas": "PREFILL_REPLICAS",
    "decode_replicas": "DECODE_REPLICAS",
}


class SettingsError(Exception):
    """A setting is missing or malformed; str(exc) is a FAIL sentence that names the fix."""


@dataclass(frozen=True)
class ComposeView:
    """The resolved project: its name, services (after profiles), networks, secrets, settings."""

    project: str
    settings: dict[str, str]
    services: dict[str, Any] = field(default_factory=dict)
    networks: dict[str, Any] = field(default_factory=dict)
    secrets: dict[str, Any] = field(default_factory=dict)


def config_argv(
    docker: str, compose_file: Path, env_file: Path | None, profiles: list[str]
) -> list[str]:
    """The `docker compose ... config --format json` command line preflight runs."""
    argv = [docker, "compose"]
    if env_file is not None:
        argv += ["--env-file", str(env_file)]
    for profile in profiles:
        argv += ["--profile", profile]
    return argv + ["-f", str(compose_file), "config", "--format", "json"]


def parse_config(text: str) -> ComposeView:
    """Read Compose's JSON; raise SettingsError when the settings block is absent or incomplete."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise SettingsError(
            f"'docker compose config --format json' printed no JSON ({exc}): "
            "upgrade Docker Compose to v2.20 or later."
        ) from None
    block = data.get(SETTINGS_KEY) if isinstance(data, dict) else None
    if not isinstance(block, dict):
        raise SettingsError(
            f"compose.yaml has no top-level {SETTINGS_KEY} block, which preflight reads its "
            "settings from: update compose.yaml from the kit's checkout."
        )
    settings = {str(k): _as_text(v) for k, v in block.items()}
    missing = [k for k in REQUIRED if k not in settings]
    if not any(k in settings for k in TOKEN_KEYS):
        missing.append(" or ".join(TOKEN_KEYS))
    if missing:
        raise SettingsError(
            f"compose.yaml's {SETTINGS_KEY} lacks {', '.join(missing)}: add them to the block "
            "(see docs/preflight.md)."
        )
    return ComposeView(
        project=str(data.get("name") or ""),
        settings=settings,
        services=_mapping(data.get("services")),
        networks=_mapping(data.get("networks")),
        secrets=_mapping(data.get("secrets")),
    )


def device_requests(service: dict[str, Any]) -> list[dict[str, Any]]:
    """A service's device requests: its deploy reservations, and `gpus:` (GPU requests)."""
    deploy = service.get("deploy") or {}
    devices = ((deploy.get("resources") or {}).get("reservations") or {}).get("devices") or []
    gpus = service.get("gpus")
    gpus = [{"count": "all"}] if gpus == "all" else gpus if isinstance(gpus, list) else []
    devices = [*devices, *({"capabilities": ["gpu"], **g} for g in gpus if isinstance(g, dict))]
    return [d for d in devices if isinstance(d, dict)]


def gpu_services(view: ComposeView) -> list[str]:
    """Services that reserve NVIDIA GPUs (deploy device reservations or `gpus:`), sorted."""
    return sorted(
        name
        for name, service in view.services.items()
        if isinstance(service, dict)
        and any(
            d.get("driver") == "nvidia" or "gpu" in (d.get("capabilities") or [])
            for d in device_requests(service)
        )
    )


def _valid(value: Any, good: bool) -> Any:
    if not good:
        raise ValueError(value)
    return value


#: The typed settings, one row each: how a value is read (ValueError: unusable), what it is not
#: then ({why}: the parser's reason) and how the FAIL sentence ends ({where}: the env file).
KINDS: dict[str, tuple[Callable[[str], Any], str, str]] = {
    "positive_int": (lambda t: _valid(int(t), t.isdigit() and int(t) > 0), "a positive integer",
                     "fix it in {where}"),
    "fraction": (lambda t: _valid(float(t), 0.0 < float(t) <= 1.0),
                 "a fraction of GPU memory in (0, 1]", "fix it in {where}"),
    "port": (lambda t: _valid(int(t), t.isdigit() and 0 < int(t) < 65536), "a TCP port",
             "set it in {where}"),
    "network": (lambda t: ipaddress.ip_network(t, strict=True), "a network in CIDR form ({why})",
                "set it in {where}, e.g. {env}=172.28.0.0/24"),
    "address": (lambda t: str(ipaddress.ip_address(t)), "an IP address",
                "set it in {where}, e.g. {env}=127.0.0.1"),
}  # fmt: skip


class Settings:
    """Typed access to the resolved settings; bad values raise SettingsError with the fix."""

    def __init__(self, raw: dict[str, str], project_dir: Path, env_label: str) -> None:
        self.raw = raw
        self.project_dir = project_dir
        self.env_label = env_label  # where the user edits settings, for the fix sentences

    def has(self, key: str) -> bool:
        return key in self.raw

    @staticmethod
    def env(key: str) -> str:
        """The variable a user sets for `key`, e.g. PREFILLER_TP_SIZE for prefill_tp_size."""
        return ENV_NAMES.get(key) or OPTIONAL_ENV_NAMES.get(key) or key.upper()

    def text(self, key: str) -> str:
        return self.raw.get(key, "").strip()

    def typed(self, kind: str, key: str) -> Any:
        """`key`'s value read as KINDS[kind]; SettingsError naming the variable and the fix."""
        parse, what, fix = KINDS[kind]
        value, env = self.text(key), self.env(key)
        try:
            return parse(value)
        except ValueError as exc:
            where = fix.format(where=self.env_label, env=env)
            raise SettingsError(
                f"{env}='{value}' is not {what.format(why=exc)}: {where}."
            ) from None

    def positive_int(self, key: str) -> int:
        return int(self.typed("positive_int", key))

    def fraction(self, key: str) -> float:
        return float(self.typed("fraction", key))

    def port(self, key: str) -> int:
        return int(self.typed("port", key))

    def network(self, key: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
        return self.typed("network", key)

    def address(self, key: str) -> str:
        return str(self.typed("address", key))

    def id_list(self, key: str) -> list[str]:
        """A comma list of GPU indices or GPU-UUIDs, blanks dropped."""
        return [part.strip() for part in self.text(key).split(",") if part.strip()]

    def path(self, key: str) -> Path:
        """A host path: `~` expanded, relative paths taken from compose.yaml's folder."""
        path = Path(os.path.expanduser(self.text(key)))
        return path if path.is_absolute() else self.project_dir / path

    def token_file(self) -> tuple[Path, str]:
        """The Hugging Face token file and how to name it in a message."""
        if self.has("hf_token_file"):
            path = self.path("hf_token_file")
            return path, f"HF_TOKEN_FILE ({path})"
        path = self.path("secrets_dir") / "hf_token"
        return path, f"the hf_token file in KIT_SECRETS_DIR ({path})"


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
