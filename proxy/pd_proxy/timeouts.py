"""The timeout rule prefill's KV lease, pd-proxy and its client must agree on: one pure function.

vLLM 0.32's NIXL connector keeps a finished prefill request's KV blocks for decode to pull for
``kv_connector_extra_config.kv_lease_duration`` seconds (default 30; read in
``nixl/base_scheduler.py:82-86`` and ``nixl/base_worker.py:528-532``; there is no
``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` in 0.32). The lease starts when the prefill request finishes,
i.e. before the proxy has read the prefill's answer. A decode that holds the request sends
heartbeats every ``lease // 6`` s (``base_scheduler.py:88``), each extending the lease to at least
``now + lease * 2 // 3`` (``base_worker.py:532``, ``_handle_heartbeat`` at 3042-3060). When the
lease runs out the prefill frees the blocks (``_reap_expired_send_leases``, 3014-3040) and may
reuse them; a decode that reads them afterwards computes from another request's KV, and the client
gets HTTP 200 with wrong text.

Heartbeats only flow while decode's engine is stepping, so the rule does not count on them: the
proxy must give up on a silent decode before the lease can run out. From the prefill's end the
proxy waits at most ``2 x connect`` (a connection that fails is retried once on another decode),
plus, with ``--first-token-from-prefill``, the prefill's KV block-size lookup (``health_timeout``),
plus ``decode_timeout`` for decode's first byte. So:

1. ``lease > 2 x connect + block-size wait + decode_timeout`` (strictly);
2. a client's own timeout must be longer than the most the proxy takes to answer: the prefill
   leg (a failed connect, then ``prefill_timeout`` on another backend) plus the wait in 1, so the
   client reads the proxy's clear 502/504 instead of giving up on its own.

For a stream, the decode bound is on its first byte (vLLM sends a stream's headers when it accepts
the request); ``decode_timeout`` then bounds the silence between chunks. A non-streamed answer's
first byte is the whole answer, so ``decode_timeout`` also caps a non-streamed generation: raise it
together with the lease for long ones.

Standard library only and Python 3.8 syntax: the kit's preflight (a GPU host's system python3)
and its local stack import this module too (tests/preflight checks both).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

#: vLLM 0.32's kv_lease_duration when kv_connector_extra_config does not set it.
VLLM_DEFAULT_KV_LEASE_S = 30


@dataclass(frozen=True)
class ProxyLimits:
    """pd-proxy's limits in seconds; the defaults are ``ProxyConfig``'s (tests/proxy pins that)."""

    connect_s: float = 5.0  # --connect-timeout
    prefill_s: float = 300.0  # --prefill-timeout: each attempt of the prefill leg
    decode_s: float = 300.0  # --decode-timeout: decode's silence, before its first byte included
    block_size_wait_s: float = 0.0  # --first-token-from-prefill: --health-timeout, else 0

    def decode_wait_s(self) -> float:
        """The longest the proxy waits for decode's first byte, from the prefill's answer."""
        return 2 * self.connect_s + self.block_size_wait_s + self.decode_s

    def answer_wait_s(self) -> float:
        """The longest the proxy takes to start answering a client (or to send its error)."""
        return self.connect_s + self.prefill_s + self.decode_wait_s()


#: How each value is named in messages: pd-proxy's flags and variables ...
PROXY_NAMES: dict[str, str] = {
    "lease": "--kv-lease-s/PD_PROXY_KV_LEASE_S",
    "connect": "--connect-timeout/PD_PROXY_CONNECT_TIMEOUT",
    "prefill": "--prefill-timeout/PD_PROXY_PREFILL_TIMEOUT",
    "decode": "--decode-timeout/PD_PROXY_DECODE_TIMEOUT",
    "block_size_wait": "--health-timeout/PD_PROXY_HEALTH_TIMEOUT",
    "client": "the client's timeout",
}
#: ... and the kit's knobs (.env.example), for preflight, the local stack and the eval.
KIT_NAMES: dict[str, str] = {
    "lease": "NIXL_KV_LEASE_S",
    "connect": "PROXY_CONNECT_TIMEOUT_S",
    "prefill": "PROXY_PREFILL_TIMEOUT_S",
    "decode": "PROXY_DECODE_TIMEOUT_S",
    "block_size_wait": "PD_PROXY_HEALTH_TIMEOUT",
    "client": "EVAL_REQUEST_TIMEOUT_S",
}


def _s(value: float) -> str:
    return f"{value:g} s"


def timeout_problems(
    lease_s: float | None,
    limits: ProxyLimits,
    client_s: float | None = None,
    names: Mapping[str, str] | None = None,
) -> list[str]:
    """Why these settings could serve a wrong answer or lose one; [] when they agree.

    ``lease_s``: the prefill's KV lease (None: not known, rule 1 skipped); ``client_s``: the
    client's request timeout (None: not known, rule 2 skipped). Each problem is one sentence that
    names both values (by ``names``, default ``PROXY_NAMES``) and the fix.
    """
    n = dict(PROXY_NAMES)
    n.update(names or {})
    problems = []
    wait = limits.decode_wait_s()
    parts = f"{n['decode']}={_s(limits.decode_s)} + 2 x {n['connect']}={_s(limits.connect_s)}"
    if limits.block_size_wait_s:
        parts += f" + {n['block_size_wait']}={_s(limits.block_size_wait_s)}"
    if lease_s is not None and not lease_s > wait:
        room = lease_s - (wait - limits.decode_s)
        fix = f"Set {n['decode']} below {room:g}" if room > 0 else "Shorten the proxy's limits"
        problems.append(
            f"the KV lease {n['lease']}={_s(lease_s)} is not longer than the longest pd-proxy "
            f"waits for decode's first byte after the prefill finished ({parts} = {_s(wait)}): "
            "decode could read KV blocks the prefill already freed and reused, and the client "
            f"would get HTTP 200 with wrong text. {fix}, or raise {n['lease']} above {wait:g}."
        )
    total = limits.answer_wait_s()
    if client_s is not None and not client_s > total:
        problems.append(
            f"{n['client']}={_s(client_s)} is not longer than the longest pd-proxy takes to "
            f"answer ({n['connect']}={_s(limits.connect_s)} + {n['prefill']}="
            f"{_s(limits.prefill_s)} + {parts} = {_s(total)}): the client would give up before "
            f"the proxy's own error reached it. Raise {n['client']} above {total:g}, or shorten "
            "the proxy's limits."
        )
    return problems
