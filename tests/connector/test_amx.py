"""AMX tile permission: asked for in the worker, read back from the kernel.

On an AMX CPU a fresh process has no XTILEDATA permission until something asks; vLLM's CPU
attention then dies with SIGILL in a P/D decode's first 1-token step. These tests read the
permission back with ARCH_GET_XCOMP_PERM in fresh processes, so they fail if the request is
dropped. On a CPU without AMX there is nothing to request, and the live tests say so.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from pcp_nixl_connector.amx import AmxStatus, cpu_flags, cpu_has_amx, ensure_amx_permission

NO_AMX_REASON = (
    "this CPU has no AMX (no amx_tile in /proc/cpuinfo): the kernel has no tile data to grant, "
    "so there is no permission to check here; the same test checks it on AMX hosts"
)


def _fresh_process(code: str) -> dict:
    """Run ``code`` in a new interpreter (permissions are per process) and parse its JSON."""
    prog = "import json\n" + textwrap.dedent(code)
    out = subprocess.run(
        [sys.executable, "-c", prog], capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_flags_parsed_from_the_first_processor() -> None:
    text = "processor\t: 0\nflags\t\t: fpu sse2 amx_tile amx_bf16\n\nprocessor\t: 1\nflags\t: fpu\n"
    assert cpu_flags(text) == {"fpu", "sse2", "amx_tile", "amx_bf16"}
    assert cpu_flags("processor: 0\n") == frozenset()


def test_without_amx_nothing_is_requested_and_the_log_says_why() -> None:
    status = ensure_amx_permission(has_amx=False)
    assert status == AmxStatus(supported=False, permitted=False)
    assert "no AMX" in status.describe()


@pytest.mark.skipif(not cpu_has_amx(), reason=NO_AMX_REASON)
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
    assert result == {"before": False, "after": True, "status": [True, True]}


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
        connector.layout_from_config = lambda cfg, **kw: None
        try:
            connector.PcpCanonicalNixlConnector.__init__(obj, None, KVConnectorRole.WORKER, None)
        except Stop:
            pass
        print(json.dumps({"calls": len(calls), "after": amx.tile_data_permitted()}))
        """
    )
    assert result == {"calls": 1, "after": cpu_has_amx()}
