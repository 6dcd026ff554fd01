"""One real run of the NIXL read probe on this CPU machine, shared by the tests that check what it
prints and how the entrypoint's start check reads it (tests/entrypoint/probe_run.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.entrypoint.probe_run import ProbeRun, run_probe


@pytest.fixture(scope="session")
def cpu_probe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProbeRun]:
    log = tmp_path_factory.mktemp("probe") / "ucx.txt"
    res = run_probe(log, "--device", "cpu", "--mib", "4", "--iters", "3")
    text = log.read_text(errors="replace") if log.exists() else ""
    yield ProbeRun(res.returncode, res.stdout, res.stderr, text, log)
