"""Early, clear refusal on unsupported vLLM; the light import path stays vLLM-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pcp_nixl_connector import releases, version_guard
from tests.support.paths import CONNECTOR_DIR


@pytest.mark.parametrize(
    "version,want", [("0.32.0", (0, 32)), ("0.33.1rc1", (0, 33)), ("v0.34.0", (0, 34)), ("x", None)]
)
def test_parse_version(version, want):
    assert version_guard.parse_version(version) == want


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "1.0.0", "dev"])
def test_unsupported_versions_are_refused_by_name(version):
    with pytest.raises(
        version_guard.UnsupportedVllmError, match=r"0\.32\.x, 0\.33\.x and 0\.34\.x"
    ):
        version_guard.check_vllm(version, allow_override=False)


def test_the_guard_reads_the_one_list_of_releases():
    assert version_guard.SUPPORTED_VLLM_MINORS == tuple(r.minor for r in releases.RELEASES)
    assert all(r.series in version_guard.SUPPORTED_TEXT for r in releases.RELEASES)


@pytest.mark.vllm
def test_installed_vllm_is_supported():
    assert version_guard.parse_version(version_guard.check_vllm()) in (
        version_guard.SUPPORTED_VLLM_MINORS
    )


@pytest.mark.vllm
@pytest.mark.parametrize("version", ["0.34.0", "0.34.2", "0.33.0", "0.32.1"])
def test_supported_releases_pass_the_guard(version):
    """Every patch release of a listed minor, 0.34 included, with the APIs in place (those of
    the installed vLLM: the 0.34.0 wheel's are checked in test_vllm_api_surface.py)."""
    assert version_guard.check_vllm(version, allow_override=False) == version


@pytest.mark.vllm
def test_missing_api_is_named(monkeypatch):
    monkeypatch.setitem(
        version_guard.REQUIRED_APIS, "vllm.distributed.parallel_state", ("get_pcp_group_gone",)
    )
    with pytest.raises(version_guard.UnsupportedVllmError, match="get_pcp_group_gone"):
        version_guard.check_vllm("0.32.0")


def test_metric_names_import_without_vllm():
    code = (
        "import sys; import pcp_nixl_connector as p; "
        "assert 'vllm' not in sys.modules, 'vllm imported'; print(p.DEDUP_METRIC_NAMES)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(CONNECTOR_DIR)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "vllm:nixl_pcp_canonical_completions_total" in out.stdout
