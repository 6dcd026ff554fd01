"""``KV_EXTRA_CONNECTORS``: further vLLM KV connectors beside the kit's, in one MultiConnector.

A user who pairs NIXL P/D with an offloading connector (vLLM's OffloadingConnector, LMCache) gives
vLLM a ``MultiConnector`` whose children are the kit's connector and the others. Every stack (the
local one, the compose/Kubernetes entrypoint) builds that config here, from the kit's own section
and the knob's JSON list, so the rules live in one place: the kit's connector first (it loads
remote KV before any other child is asked), its count mode written out as ``world_size`` (the
scheduler and the API server cannot see the wrapper; see placement.py), and bad input refused
with a message that names the knob. Standard library only: the containers' entrypoint imports it
before vLLM.
"""

from __future__ import annotations

import copy
import json
from typing import Any

KNOB = "KV_EXTRA_CONNECTORS"
WRAPPER = "MultiConnector"
ROLES = ("kv_producer", "kv_consumer", "kv_both")
COMPLETION_MODE_KEY = "pcp_completion_mode"  # topology.COMPLETION_MODE_KEY (no vLLM-free import)


def parse_extra_connectors(
    raw: str, *, knob: str = KNOB, kit_connector: str = ""
) -> list[dict[str, Any]]:
    """The JSON list of connector configs in ``raw`` ([] when blank); ValueError naming ``knob``
    and the offending entry for anything vLLM could not build as a MultiConnector child."""
    if not raw.strip():
        return []
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{knob} is not JSON ({exc.msg} at column {exc.colno}): {raw!r}") from None
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"{knob} must be a non-empty JSON list of vLLM connector configs (objects), or empty; "
            f"got {raw!r}"
        )
    for i, entry in enumerate(value):
        where = f"{knob}[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(
                f'{where} must be an object like {{"kv_connector": ...}}, got {entry!r}'
            )
        name = entry.get("kv_connector")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where} has no kv_connector (the vLLM connector's class name)")
        if name in (WRAPPER, kit_connector):
            raise ValueError(
                f"{where} is {name}: list only the other connectors; the kit wraps its own "
                f"connector and these in one {WRAPPER} itself"
            )
        if entry.get("kv_role") not in ROLES:
            raise ValueError(
                f"{where} ({name}) needs kv_role, one of {', '.join(ROLES)}; got "
                f"{entry.get('kv_role')!r}"
            )
        extra = entry.get("kv_connector_extra_config", {})
        if not isinstance(extra, dict):
            raise ValueError(f"{where} ({name}): kv_connector_extra_config must be an object")
    return value


def with_extra_connectors(
    kit_config: dict[str, Any], extras: list[dict[str, Any]]
) -> dict[str, Any]:
    """The kv-transfer-config to hand vLLM: ``kit_config`` itself without extras, else a
    MultiConnector of the kit's connector (first, count mode world_size unless set) and
    ``extras``, with the kit's role (and buffer device) on the wrapper."""
    if not extras:
        return kit_config
    kit = copy.deepcopy(kit_config)
    kit.setdefault("kv_connector_extra_config", {}).setdefault(COMPLETION_MODE_KEY, "world_size")
    outer: dict[str, Any] = {
        "kv_connector": WRAPPER,
        "kv_role": kit["kv_role"],
        "kv_connector_extra_config": {"connectors": [kit, *copy.deepcopy(extras)]},
    }
    if "kv_buffer_device" in kit:
        outer["kv_buffer_device"] = kit["kv_buffer_device"]
    return outer
