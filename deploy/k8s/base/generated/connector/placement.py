"""Where the kit's connector sits among vLLM's KV connectors, read from vLLM itself.

vLLM builds the engine's KV connector from ``kv_transfer_config``; a wrapper (vLLM's
``MultiConnector``) builds each child from a copy of the config that holds only the child's own
section, so a connector's own config never says whether it is wrapped. Two things vLLM keeps do:

* in a worker process vLLM builds the connector inside ``set_current_vllm_config`` of the
  engine's config, whose ``kv_connector`` names the outermost connector;
* once built, ``get_kv_transfer_group()`` is the outermost connector instance itself.

The scheduler and the API server build theirs with no current config, so they cannot see a
wrapper and run the mode the setting names (``canonical`` when unset). The workers, which can,
check at start (``register_kv_caches``) that the count the scheduler will use - the wrapper's
rule over every child's ``get_finished_count()`` - is the count their reports need.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Placement:
    """``known``: this process can see the engine's outermost connector (the workers).
    ``wrapper``: the outermost connector's name when it is not this connector, else None."""

    known: bool
    wrapper: str | None = None

    @property
    def wrapped(self) -> bool:
        return self.wrapper is not None


UNKNOWN = Placement(known=False)


def placement_from_configs(own_ktc: Any, engine_ktc: Any | None) -> Placement:
    """Placement from this connector's kv_transfer_config and the engine's (None: not visible)."""
    if engine_ktc is None:
        return UNKNOWN
    if engine_ktc is own_ktc or (
        engine_ktc.kv_connector == own_ktc.kv_connector
        and engine_ktc.kv_connector_module_path == own_ktc.kv_connector_module_path
    ):
        return Placement(known=True)
    return Placement(known=True, wrapper=str(engine_ktc.kv_connector))


def engine_kv_transfer_config() -> Any | None:
    """The engine's kv_transfer_config where vLLM has set its current config (worker processes)."""
    from vllm.config import get_current_vllm_config_or_none

    current = get_current_vllm_config_or_none()
    return None if current is None else current.kv_transfer_config


def effective_finished_count(child_counts: Iterable[int | None]) -> int | None:
    """The count vLLM's MultiConnector hands the scheduler: None (world_size) as soon as one child
    says None, else the children's one shared count (vLLM raises on two different ones)."""
    counts = list(child_counts)
    if any(c is None for c in counts):
        return None
    distinct = set(counts)
    if len(distinct) > 1:
        raise RuntimeError(
            f"MultiConnector's children count finished reports differently: {sorted(distinct)}"  # type: ignore[type-var]
        )
    return next(iter(distinct), None)


def agreement_problem(
    wrapper: str, needed: int | None, scheduler_child: int | None, siblings: Iterable[int | None]
) -> str | None:
    """Why the scheduler inside ``wrapper`` would count differently from what the workers report
    (``needed``: None = world_size), or None when they agree."""
    try:
        effective = effective_finished_count([scheduler_child, *siblings])
    except RuntimeError as exc:
        return str(exc)
    if effective == needed:
        return None

    def words(count: int | None) -> str:
        return "world_size reports" if count is None else f"{count} reports"

    return (
        f"inside {wrapper} the scheduler would wait for {words(effective)} per request while "
        f"this connector's ranks send {words(needed)}: KV blocks would be freed too early or "
        "never. Set kv_connector_extra_config['pcp_completion_mode'] to 'world_size' in this "
        "connector's own section of the wrapper's config"
    )
