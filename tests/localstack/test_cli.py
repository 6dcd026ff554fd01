"""The CLI turns bad input into one clear line and exit 2, before starting any process."""

import pytest

from pcp_pd_kit.cli import main
from tests.support.net import busy_port


def test_bad_env_value_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CPU_BLOCK_SIZE", "forty")
    assert main(["up"]) == 2
    assert "CPU_BLOCK_SIZE='forty'" in capsys.readouterr().err


def test_busy_port_is_reported_before_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with busy_port() as port:
        monkeypatch.setenv("LOCAL_PROMETHEUS_PORT", str(port))
        assert main(["demo"]) == 2
    err = capsys.readouterr().err
    assert f"prometheus port {port}" in err and "already in use" in err


def test_uncached_model_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MODEL", "nobody-here/not-a-cached-model-xyz")
    assert main(["up"]) == 2
    assert "not in the local Hugging Face cache" in capsys.readouterr().err
