"""Pure topology and completion-counting rules for a replicated-PCP NIXL producer.

No vLLM or I/O here so every rule can be tested over a table of
TP/PP/PCP/DCP/role combinations.

Replicated PCP (producer, PCP > 1, DCP == 1): every PCP rank of one (TP, PP)
position holds the same full KV, and the NIXL handshake is keyed by (PP, TP)
only, so exactly one replica per position - PCP rank 0, the *canonical*
replica - may be published and may report completions. Two completion
accountings are consistent:

* ``canonical``: the scheduler waits for TP x PP reports and non-canonical
  ranks' ``finished_sending`` reports are suppressed;
* ``world_size``: the scheduler waits for world_size reports and
  non-canonical ranks report (stock vLLM's worker reports them at once).
  Inside a ``MultiConnector``, which discards a child's TP x PP count as soon as
  another child counts world_size, this is the only consistent one:
  ``resolve_completion_mode`` picks it when the mode is unset and refuses an
  explicit ``canonical`` there (where the connector sits: placement.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

COMPLETION_MODE_KEY = "pcp_completion_mode"
PRODUCER_ROLES = ("kv_producer",)
KNOWN_ROLES = ("kv_producer", "kv_consumer", "kv_both")


class CompletionMode(str, Enum):
    """How a replicated-PCP producer's send completions are counted."""

    CANONICAL = "canonical"
    WORLD_SIZE = "world_size"


def requested_completion_mode(extra_config: Mapping[str, Any] | None) -> CompletionMode | None:
    """``pcp_completion_mode`` from ``kv_connector_extra_config``; None when it is not set."""
    extra = extra_config or {}
    if COMPLETION_MODE_KEY not in extra:
        return None
    raw = extra[COMPLETION_MODE_KEY]
    try:
        return CompletionMode(raw)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in CompletionMode)
        raise ValueError(
            f"kv_connector_extra_config[{COMPLETION_MODE_KEY!r}] = {raw!r} is not one of {allowed}"
        ) from None


def parse_completion_mode(extra_config: Mapping[str, Any] | None) -> CompletionMode:
    """The mode of a connector used on its own: the setting, ``canonical`` when unset."""
    return requested_completion_mode(extra_config) or CompletionMode.CANONICAL


def resolve_completion_mode(
    requested: CompletionMode | None, *, wrapper: str | None, replicated_pcp_producer: bool
) -> CompletionMode:
    """The mode to run: the setting, or the default that cannot leak where the connector is.

    ``wrapper``: the outermost connector's name when this connector is not the outermost one
    (placement.py; None when it is, or where the process cannot tell). Inside vLLM's
    ``MultiConnector`` the scheduler waits for world_size reports as soon as any other child's
    ``get_finished_count()`` is None (the base class's answer), so ``canonical`` (ranks > 0
    suppressed) would never free a replicated-PCP producer's blocks. Unset there, the mode is
    ``world_size``; set to ``canonical`` by hand, it is refused rather than overridden,
    because an explicit choice that cannot work is a configuration error to fix, not to hide.
    """
    if requested is None:
        return CompletionMode.WORLD_SIZE if wrapper is not None else CompletionMode.CANONICAL
    if requested is CompletionMode.CANONICAL and wrapper is not None and replicated_pcp_producer:
        raise ValueError(
            f"kv_connector_extra_config[{COMPLETION_MODE_KEY!r}] = 'canonical' inside {wrapper} "
            "(this connector is not vLLM's outermost KV connector): the wrapper's scheduler "
            "counts world_size reports per request as soon as another child's "
            "get_finished_count() is None, while canonical mode suppresses PCP rank > 0's "
            "reports, so the producer's KV blocks would never be freed. Set "
            f"{COMPLETION_MODE_KEY!r} to 'world_size' in this connector's own "
            "kv_connector_extra_config"
        )
    return requested


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class PcpLayout:
    """Parallel layout and KV role of one engine (all ranks share it)."""

    tp: int
    pp: int
    pcp: int
    dcp: int
    kv_role: str
    mode: CompletionMode = CompletionMode.CANONICAL

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "pcp", "dcp"):
            _positive_int(name, getattr(self, name))
        if self.kv_role not in KNOWN_ROLES:
            raise ValueError(f"kv_role must be one of {KNOWN_ROLES}, got {self.kv_role!r}")
        if not isinstance(self.mode, CompletionMode):
            raise ValueError(f"mode must be a CompletionMode, got {self.mode!r}")

    @property
    def world_size(self) -> int:
        """Ranks per engine (TP x PP x PCP; DCP lives inside TP/PCP in vLLM)."""
        return self.tp * self.pp * self.pcp

    @property
    def replicated_pcp_producer(self) -> bool:
        """Every PCP rank of a (TP, PP) position holds the same full KV."""
        return self.kv_role in PRODUCER_ROLES and self.pcp > 1 and self.dcp == 1

    def check_pcp_rank(self, pcp_rank: int) -> int:
        if isinstance(pcp_rank, bool) or not isinstance(pcp_rank, int):
            raise ValueError(f"pcp_rank must be an int, got {pcp_rank!r}")
        if not 0 <= pcp_rank < self.pcp:
            raise ValueError(f"pcp_rank {pcp_rank} outside [0, {self.pcp})")
        return pcp_rank

    def is_canonical(self, pcp_rank: int) -> bool:
        """True for the rank whose KV and reports stand for its (TP, PP) position."""
        self.check_pcp_rank(pcp_rank)
        return not self.replicated_pcp_producer or pcp_rank == 0

    def publishes_handshake(self, pcp_rank: int) -> bool:
        """Only the canonical replica's agent metadata is served for (PP, TP)."""
        return self.is_canonical(pcp_rank)

    def suppresses_finished_sending(self, pcp_rank: int) -> bool:
        """Non-canonical ranks' send reports are dropped in canonical mode."""
        return not self.is_canonical(pcp_rank) and self.mode is CompletionMode.CANONICAL

    def finished_count(self) -> int | None:
        """Reports the scheduler must collect per request; None = world_size (stock)."""
        if self.replicated_pcp_producer and self.mode is CompletionMode.CANONICAL:
            return self.tp * self.pp
        return None

    def expected_reports(self) -> int:
        """The number the scheduler-side aggregator will actually wait for."""
        count = self.finished_count()
        return self.world_size if count is None else count

    def expected_suppressed_per_completion(self) -> int:
        """Suppressed reports expected per canonical completion: p-1 in canonical mode, else 0.

        The gauge ``vllm:nixl_pcp_expected_suppressed_per_completion`` exports this so an alert
        needs no hand-set PCP size (world_size mode, PCP1 and consumers suppress nothing).
        """
        if self.replicated_pcp_producer and self.mode is CompletionMode.CANONICAL:
            return self.pcp - 1
        return 0

    def reporting_ranks(self) -> int:
        """How many ranks per engine emit a send report for each request."""
        if not self.replicated_pcp_producer or self.mode is CompletionMode.WORLD_SIZE:
            return self.world_size
        return self.tp * self.pp


def layout_from_config(vllm_config: Any, *, wrapper: str | None = None) -> PcpLayout:
    """The engine's parallel layout, role and completion mode from a ``VllmConfig``.

    ``wrapper``: the outermost connector when it is not this one (see
    ``resolve_completion_mode``). Duck-typed (attribute access only) so this module stays free
    of vLLM imports.
    """
    ktc = vllm_config.kv_transfer_config
    if ktc is None or ktc.kv_role is None:
        raise ValueError("PcpCanonicalNixlConnector needs kv_transfer_config with a kv_role")
    pc = vllm_config.parallel_config
    layout = PcpLayout(
        tp=pc.tensor_parallel_size,
        pp=pc.pipeline_parallel_size,
        pcp=pc.prefill_context_parallel_size,
        dcp=pc.decode_context_parallel_size,
        kv_role=ktc.kv_role,
    )
    mode = resolve_completion_mode(
        requested_completion_mode(ktc.kv_connector_extra_config),
        wrapper=wrapper,
        replicated_pcp_producer=layout.replicated_pcp_producer,
    )
    return replace(layout, mode=mode)


def pcp_rank_from_global_rank(global_rank: int, tp: int, pp: int, pcp: int) -> int:
    """PCP rank implied by vLLM's rank layout (ExtDP, DP, PP, PCP, TP), TP fastest.

    Fallback for when vLLM's PCP group is not initialised; mirrors
    ``initialize_model_parallel``'s ``arange(world).reshape(-1, dp, pp, pcp, tp)``.
    """
    for name, value in (("tp", tp), ("pp", pp), ("pcp", pcp)):
        _positive_int(name, value)
    if isinstance(global_rank, bool) or not isinstance(global_rank, int) or global_rank < 0:
        raise ValueError(f"global_rank must be a non-negative int, got {global_rank!r}")
    return (global_rank // tp) % pcp
