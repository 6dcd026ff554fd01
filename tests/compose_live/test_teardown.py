"""`down -v` of the session stack, after every other live compose test (test_cpu_deployment.py and
the fault suite in test_faults.py ran on it): nothing of the project is left behind."""

from __future__ import annotations

import pytest

# Any number of prefill replicas (conftest.ANY_PREFILL_REPLICAS): test_replicas.py leaves two
# when nothing else follows.
pytestmark = [pytest.mark.compose, pytest.mark.any_prefill_replicas]


def test_down_leaves_no_container_network_or_volume(compose_stack) -> None:
    compose_stack.compose(
        "--profile", "cpu", "down", "-v", "--remove-orphans", "--timeout", "30", timeout=300
    )
    assert compose_stack.project_objects() == {"container": [], "network": [], "volume": []}
