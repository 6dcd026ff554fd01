"""AMX tile permission: asked for in the worker, read back from the kernel.

On an AMX CPU a fresh process has no XTILEDATA permission until something asks; vLLM's CPU
attention then dies with SIGILL in a P/D decode's first 1-token step. The readback
(ARCH_GET_XCOMP_PERM) and the request (ARCH_REQ_XCOMP_PERM) exist on every x86-64 kernel >= 5.16,
AMX or not, so these tests make both calls on every such host, in fresh processes (permissions
are per process). Only what the kernel grants differs: tile data on AMX CPUs, EOPNOTSUPP elsewhere.
"""

from __future__ import annotations

import errno
import json
import logging
import subprocess
import sys
import textwrap

import pytest

from pcp_nixl_connector import amx
from pcp_nixl_connector.amx import AmxStatus, cpu_flags, cpu_has_amx, ensure_amx_permission

# Components every x86-64 CPU with XSAVE has: x87 (bit 0) and SSE (bit 1).
ALWAYS_PRESENT = 0b11
TILE_DATA = 1 << amx.XFEATURE_XTILEDATA  # bit 18
TILE_CFG = 1 << 17

WHY_NO_SYSCALL = amx.syscall_available()
needs_xcomp_perm = pytest.mark.skipif(
    WHY_NO_SYSCALL is not None,
    reason=f"ARCH_GET/REQ_XCOMP_PERM cannot exist on this host: {WHY_NO_SYSCALL}",
)


def _fresh_process(code: str) -> dict:
    """Run ``code`` in a new interpreter (permissions are per process) and parse its JSON."""
    prog = "import json\n" + textwrap.dedent(code)
    out = subprocess.run(
        [sys.executable, "-c", prog], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_flags_parsed_from_the_first_processor() -> None:
    text = "processor\t: 0\nflags\t\t: fpu sse2 amx_tile amx_bf16\n\nprocessor\t: 1\nflags\t: fpu\n"
    assert cpu_flags(text) == {"fpu", "sse2", "amx_tile", "amx_bf16"}
    assert cpu_flags("processor: 0\n") == frozenset()


@pytest.mark.parametrize(
    ("system", "machine", "release", "available"),
    [
        ("Linux", "x86_64", "6.18.44-fc-v669", True),
        ("Linux", "x86_64", "5.16.0", True),
        ("Linux", "x86_64", "5.15.0-91-generic", False),
        ("Linux", "x86_64", "4.19.0", False),
        ("Linux", "aarch64", "6.8.0", False),
        ("Darwin", "x86_64", "23.1.0", False),
    ],
)
def test_where_the_syscall_exists(system: str, machine: str, release: str, available: bool) -> None:
    why_not = amx.syscall_available(machine, release, system)
    assert (why_not is None) == available, why_not


def test_without_amx_nothing_is_requested_and_the_log_says_why() -> None:
    status = ensure_amx_permission(has_amx=False)
    assert status == AmxStatus(supported=False, permitted=False)
    assert "no AMX" in status.describe()


@needs_xcomp_perm
def test_the_readback_succeeds_on_every_x86_64_host() -> None:
    """Not only on AMX CPUs: a readback that fails (a truncated pointer gives EFAULT) used to
    come back as 0, and every AMX host then logged a refusal that never happened."""
    result = _fresh_process(
        """
        from pcp_nixl_connector import amx
        print(json.dumps({"mask": amx.permitted_xfeatures()}))
        """
    )
    mask = result["mask"]
    assert mask & ALWAYS_PRESENT == ALWAYS_PRESENT, hex(mask)
    assert mask < 1 << 63, hex(mask)
    # Tile data is a dynamic component: nobody asked in a fresh process, whatever the CPU.
    assert not mask & TILE_DATA, hex(mask)
    # The tile config (bit 17) is listed exactly where the CPU has AMX.
    assert bool(mask & TILE_CFG) == cpu_has_amx(), hex(mask)


@needs_xcomp_perm
def test_a_refused_call_raises_with_the_kernels_errno() -> None:
    with pytest.raises(OSError) as caught:
        amx._arch_prctl(0x1FFF, 0)  # no such arch_prctl code
    assert caught.value.errno == errno.EINVAL
    assert "0x1fff" in str(caught.value)


@needs_xcomp_perm
def test_the_tile_data_request_is_granted_exactly_where_the_cpu_has_amx() -> None:
    """The request runs on every host; the kernel grants tile data only on AMX CPUs (0x202e7 ->
    0x602e7 on a Sapphire Rapids, for example) and answers EOPNOTSUPP elsewhere."""
    result = _fresh_process(
        """
        from pcp_nixl_connector import amx
        before = amx.permitted_xfeatures()
        try:
            amx.request_xfeature(amx.XFEATURE_XTILEDATA)
            refused = None
        except OSError as exc:
            refused = exc.errno
        print(json.dumps({"before": before, "after": amx.permitted_xfeatures(),
                          "refused": refused}))
        """
    )
    before, after = result["before"], result["after"]
    if cpu_has_amx():
        assert result["refused"] is None
        assert after == before | TILE_DATA, (hex(before), hex(after))
    else:
        assert result["refused"] == errno.EOPNOTSUPP
        assert after == before, (hex(before), hex(after))


@needs_xcomp_perm
def test_a_fresh_process_lacks_tile_permission_until_it_asks() -> None:
    result = _fresh_process(
        """
        from pcp_nixl_connector import amx
        before = amx.tile_data_permitted()
        status = amx.ensure_amx_permission()
        print(json.dumps({"before": before, "after": amx.tile_data_permitted(),
                          "status": [status.supported, status.permitted]}))
        """
    )
    has = cpu_has_amx()
    assert result == {"before": False, "after": has, "status": [has, has]}


def test_a_refused_readback_is_logged_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> int:
        raise OSError(errno.EFAULT, "arch_prctl(0x1022) failed: Bad address (rc -1)")

    monkeypatch.setattr(amx, "permitted_xfeatures", refuse)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    amx.logger.addHandler(handler)
    try:
        status = ensure_amx_permission(has_amx=True)
    finally:
        amx.logger.removeHandler(handler)
    assert status == AmxStatus(supported=True, permitted=False)
    errors = [r.getMessage() for r in records if r.levelno == logging.ERROR]
    assert any("Bad address" in m for m in errors), errors


@pytest.mark.vllm
def test_the_connector_worker_asks_before_building_the_nixl_worker() -> None:
    """The WORKER-role constructor runs in vLLM's CPU worker process before any model step."""
    result = _fresh_process(
        """
        from pcp_nixl_connector import amx, connector, cpu_tuning
        calls = []
        real = amx.ensure_amx_permission
        connector.ensure_amx_permission = lambda: calls.append(1) or real()
        connector.is_cpu_platform = lambda: True
        class Stop(Exception):
            pass
        def stop(*a, **k):
            raise Stop
        connector.tuned_worker_init = stop
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        obj = connector.PcpCanonicalNixlConnector.__new__(connector.PcpCanonicalNixlConnector)
        connector.NixlBaseConnector.__init__ = lambda self, *a: setattr(
            self, "kv_transfer_config", type("C", (), {"kv_connector_extra_config": {}})())
        connector.placement_from_configs = lambda own, engine: connector.Placement(known=False)
        connector.layout_from_config = lambda cfg, **kw: None
        from types import SimpleNamespace
        cfg = SimpleNamespace(kv_transfer_config=None, model_config=SimpleNamespace(dtype="f32"))
        try:
            connector.PcpCanonicalNixlConnector.__init__(obj, cfg, KVConnectorRole.WORKER, None)
        except Stop:
            pass
        print(json.dumps({"calls": len(calls), "after": amx.tile_data_permitted()}))
        """
    )
    assert result == {"calls": 1, "after": cpu_has_amx()}


@pytest.mark.parametrize(
    ("status", "dtype", "stops"),
    [
        (AmxStatus(supported=True, permitted=False), "torch.bfloat16", True),
        (AmxStatus(supported=True, permitted=False), "torch.float32", False),
        (AmxStatus(supported=True, permitted=True), "torch.bfloat16", False),
        (AmxStatus(supported=False, permitted=False), "torch.bfloat16", False),
    ],
)
def test_a_refusal_stops_a_bf16_worker_at_start_with_the_reason(
    status: AmxStatus, dtype: str, stops: bool
) -> None:
    """The result is acted on: a bf16 worker without tile permission would SIGILL at decode's
    first step, so it stops at start naming the way out; float32 never runs AMX code."""
    problem = amx.amx_problem(status, dtype)
    assert (problem is not None) is stops
    if problem:
        assert "SIGILL" in problem and "--dtype float32" in problem
