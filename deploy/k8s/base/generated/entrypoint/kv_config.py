"""vLLM's --kv-transfer-config for this container, built here and nowhere else.

Compose's four vLLM services and the Kubernetes pods set only environment variables (KV_ENV);
kv_transfer_config() turns them into the JSON, refusing anything it cannot read rather than
guessing a default. Standard library only at import (the connector's MultiConnector helpers are
imported when KIT_KV_EXTRA_CONNECTORS asks for them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .switches import one_or_zero

KV_FLAG = "--kv-transfer-config"
# The environment the kv-transfer-config is built from. On Kubernetes the first two come from the
# pcp-pd-params ConfigMap (envFrom, prefix KIT_), i.e. the .env knobs KV_CONNECTOR and
# KV_CONNECTOR_MODULE_PATH, as compose's x-vllm-env sets them; the role is set per service / pod.
KV_ENV = {
    "connector": "KIT_KV_CONNECTOR",
    "module_path": "KIT_KV_CONNECTOR_MODULE_PATH",
    "role": "KIT_KV_ROLE",  # kv_producer (prefill) | kv_consumer (decode)
    "buffer_device": "KIT_KV_BUFFER_DEVICE",  # unset: vLLM's default (the GPU); cpu: CPU buffers
    "progress_delay": "KIT_NIXL_PROGRESS_DELAY_US",  # cpu only: .env NIXL_PROGRESS_DELAY_US
    "early_load": "KIT_NIXL_EARLY_KV_LOAD",  # cpu only, 1 or 0: .env NIXL_EARLY_KV_LOAD
    "lease": "KIT_NIXL_KV_LEASE_S",  # optional: .env NIXL_KV_LEASE_S (vLLM's default: 30 s)
    # optional: .env KV_EXTRA_CONNECTORS, a JSON list of further vLLM connectors: the config is
    # then a MultiConnector with the kit's connector first (pcp_nixl_connector.extra_connectors).
    "extra_connectors": "KIT_KV_EXTRA_CONNECTORS",
}
KV_ROLES = ("kv_producer", "kv_consumer")
BUFFER_DEVICES = ("cuda", "cpu")


def kv_transfer_config(env: Mapping[str, str]) -> dict[str, object]:
    """vLLM's --kv-transfer-config for this container, from KV_ENV; ValueError (one line naming
    the variable) for a missing or unreadable value, never a guessed default."""
    values = {key: env.get(name, "").strip() for key, name in KV_ENV.items()}
    for key in ("connector", "module_path"):
        if not values[key]:
            raise ValueError(f"{KV_ENV[key]} is not set: the KV connector cannot be loaded")
    if values["role"] not in KV_ROLES:
        raise ValueError(
            f"{KV_ENV['role']}={values['role']!r}: want one of {', '.join(KV_ROLES)} "
            "(prefill produces, decode consumes)"
        )
    device = values["buffer_device"]
    if device and device not in BUFFER_DEVICES:
        raise ValueError(
            f"{KV_ENV['buffer_device']}={device!r}: want cpu, cuda or unset (vLLM's default)"
        )
    config: dict[str, object] = {
        "kv_connector": values["connector"],
        "kv_connector_module_path": values["module_path"],
        "kv_role": values["role"],
    }
    if device:
        config["kv_buffer_device"] = device
    extra: dict[str, object] = {}
    if device == "cpu":
        delay = values["progress_delay"]
        if not (delay.isascii() and delay.isdigit()):
            raise ValueError(
                f"{KV_ENV['progress_delay']}={delay!r} (NIXL_PROGRESS_DELAY_US): want a "
                "non-negative integer number of microseconds"
            )
        # The connector's CPU opt-ins (docs/cpu.md): a sleeping NIXL progress thread, no
        # re-pinning of the model thread (it fails inside a container with a cpuset), and, when
        # asked, KV reads posted before the step's forward rather than after it.
        extra["cpu_nixl_progress_delay_us"] = int(delay)
        extra["cpu_skip_kv_core_pinning"] = True
        early = values["early_load"] or "0"
        extra["cpu_early_kv_load"] = one_or_zero(KV_ENV["early_load"], early, "NIXL_EARLY_KV_LOAD")
    lease = values["lease"]
    if lease:
        if not (lease.isascii() and lease.isdigit() and int(lease) >= 6):
            raise ValueError(
                f"{KV_ENV['lease']}={lease!r} (NIXL_KV_LEASE_S): want whole seconds >= 6 "
                "(vLLM renews a lease every lease/6 seconds)"
            )
        extra["kv_lease_duration"] = int(lease)
    if extra:
        config["kv_connector_extra_config"] = extra
    if not values["extra_connectors"]:
        return config
    from pcp_nixl_connector.extra_connectors import parse_extra_connectors, with_extra_connectors

    extras = parse_extra_connectors(
        values["extra_connectors"],
        knob=f"{KV_ENV['extra_connectors']} (KV_EXTRA_CONNECTORS)",
        kit_connector=values["connector"],
    )
    return with_extra_connectors(config, extras)


def gives_kv_flag(argv: Sequence[str]) -> bool:
    """Whether argv already sets the kv-transfer-config (vLLM also reads --kv_transfer_config,
    --kv-transfer-config=JSON and the dotted --kv-transfer-config.KEY form)."""
    for arg in argv:
        name = arg.split("=", 1)[0].replace("_", "-")
        if name == KV_FLAG or name.startswith(KV_FLAG + "."):
            return True
    return False
