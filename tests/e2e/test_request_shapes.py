"""Every request shape of pd_proxy/routing/shapes.yaml through the real P/D stack: served with the
single
instance's answer (greedy, so token for token) or refused with a 400 naming the parameter, and
the prefill holding exactly the requests the route should, each freed at once: held == freed
after every case, no request expired, and no decode leg left waiting on KV that never comes.
"""

from __future__ import annotations

import logging
import time

import pytest

from pcp_pd_kit.localstack.live import scrape, settle_prefill
from pcp_pd_kit.localstack.report import total
from pcp_pd_kit.localstack.stack import Stack
from pd_proxy.routing.shapes import REFUSE

from .conftest import ReferenceRun
from .shape_matrix import MatrixCase, cases, send

pytestmark = pytest.mark.e2e
log = logging.getLogger("pcp_pd_kit.localstack")
HELD = "vllm:nixl_pcp_held_requests_total"
FREED = "vllm:nixl_pcp_canonical_completions_total"
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
SETTLE_S = 10.0  # decode's "done reading" reaches the prefill within milliseconds


def _counts(stack: Stack) -> tuple[float, float, float]:
    samples = scrape(stack.urls["prefill"])
    return tuple(total(samples, name) or 0.0 for name in (HELD, FREED, EXPIRED))  # type: ignore[return-value]


def _settled(stack: Stack, before: tuple[float, float, float], legs: int) -> tuple[float, ...]:
    """The counters' change once every request the prefill held for this case is freed."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        delta = tuple(a - b for a, b in zip(_counts(stack), before, strict=True))
        if (delta[0] >= legs and delta[0] == delta[1]) or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


@pytest.fixture(scope="module", autouse=True)
def _prefill_settled_before_the_matrix(pd_stack: Stack) -> None:
    """Every request an earlier test left held is released first, so each case's counter deltas
    are its own: the decode-stop test's prefill legs are released only by the lease expiring,
    tens of seconds later."""
    timeout_s = pd_stack.settings.kv_lease_s * 2
    assert settle_prefill(pd_stack.urls["prefill"], timeout_s) is not None, (
        f"the prefill still held KV {timeout_s:.0f}s after the earlier tests"
    )


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.name)
def test_request_shape(case: MatrixCase, pd_stack: Stack, reference_run: ReferenceRun) -> None:
    before = _counts(pd_stack)
    started = time.monotonic()
    reply = send(pd_stack.urls["proxy"], case.endpoint, case.body(pd_stack.served_model_name))
    elapsed = time.monotonic() - started
    held, freed, expired = _settled(pd_stack, before, case.prefill_legs)
    log.info(
        "shape %s: %d in %.2fs, prefill held %g freed %g expired %g",
        case.name,
        reply.status,
        elapsed,
        held,
        freed,
        expired,
    )
    if case.shape.route == REFUSE:
        assert reply.status == 400
        assert reply.error_param == case.shape.param
    else:
        want = reference_run.shapes[case.name]
        assert reply.status == want.status
        if want.status == 200:
            assert reply.choices == want.choices
            assert reply.usage == want.usage
    assert (held, freed, expired) == (case.prefill_legs, case.prefill_legs, 0)
