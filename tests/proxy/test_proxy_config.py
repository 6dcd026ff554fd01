"""Settings from flags and PD_PROXY_* variables; bad values exit 2 with a message."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pd_proxy import cli
from pd_proxy.config import ConfigError, build_parser, load_config

P = "http://127.0.0.1:16801"
D = "http://127.0.0.1:16802"


def test_env_sets_every_option():
    env = {
        "PD_PROXY_HOST": "127.0.0.1",
        "PD_PROXY_PORT": "9001",
        "PD_PROXY_PREFILL": f"{P}, http://127.0.0.1:16803/",
        "PD_PROXY_DECODE": f"{D} http://127.0.0.1:16804",
        "PD_PROXY_CONNECT_TIMEOUT": "1.5",
        "PD_PROXY_PREFILL_TIMEOUT": "7",
        "PD_PROXY_DECODE_TIMEOUT": "8",
        "PD_PROXY_MAX_BODY_BYTES": "2M",
        "PD_PROXY_HEALTH_INTERVAL": "0.5",
        "PD_PROXY_HEALTH_TIMEOUT": "0.25",
        "PD_PROXY_DRAIN_TIMEOUT": "3",
        "PD_PROXY_LOG_LEVEL": "WARNING",
        "PD_PROXY_METRICS": "false",
        "PD_PROXY_HEALTH_FAILURES": "3",
        "PD_PROXY_HEALTH_SUCCESSES": "4",
        "PD_PROXY_TOKENIZE_TIMEOUT": "0.5",
    }
    c = load_config([], env)
    assert (c.health_failures, c.health_successes, c.tokenize_timeout) == (3, 4, 0.5)
    assert (c.host, c.port) == ("127.0.0.1", 9001)
    assert c.prefill == (P, "http://127.0.0.1:16803")
    assert c.decode == (D, "http://127.0.0.1:16804")
    assert (c.connect_timeout, c.prefill_timeout, c.decode_timeout) == (1.5, 7.0, 8.0)
    assert c.max_body_bytes == 2 * 1024 * 1024
    assert (c.health_interval, c.health_timeout, c.drain_timeout) == (0.5, 0.25, 3.0)
    assert c.log_level == "warning"
    assert c.metrics is False


def test_flags_win_over_env():
    env = {"PD_PROXY_PREFILL": P, "PD_PROXY_DECODE": D, "PD_PROXY_PORT": "9001"}
    c = load_config(["--port", "9002", "--decode", "http://127.0.0.1:16805", "--metrics"], env)
    assert c.port == 9002
    assert c.prefill == (P,)
    assert c.decode == ("http://127.0.0.1:16805",)
    assert c.metrics is True


def test_a_repeated_backend_flag_adds_to_the_list():
    """``--prefill A --prefill B`` serves both, as vllm-router and most CLIs read it."""
    b = "http://127.0.0.1:16806"
    c = load_config(["--prefill", P, "--prefill", b, "--decode", D, "--decode", b], {})
    assert c.prefill == (P, b)
    assert c.decode == (D, b)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PD_PROXY_HEALTH_FAILURES": "0"}, "health_failures must be >= 1"),
        ({"PD_PROXY_TOKENIZE_TIMEOUT": "0"}, "tokenize_timeout must be > 0"),
        ({"PD_PROXY_SIDE_CALL_TIMEOUT": "2"}, "PD_PROXY_SIDE_CALL_TIMEOUT is gone"),
        ({"PD_PROXY_PORT": "eighty"}, "PD_PROXY_PORT"),
        ({"PD_PROXY_PREFILL_TIMEOUT": "-1"}, "prefill_timeout"),
        ({"PD_PROXY_MAX_BODY_BYTES": "lots"}, "PD_PROXY_MAX_BODY_BYTES"),
        ({"PD_PROXY_METRICS": "maybe"}, "PD_PROXY_METRICS"),
        ({"PD_PROXY_LOG_LEVEL": "loud"}, "log level"),
        ({"PD_PROXY_PREFILL": "localhost:8000"}, "must look like http"),
        ({"PD_PROXY_DECODE": ""}, "--decode"),
    ],
)
def test_bad_settings_raise_config_error(env, message):
    base = {"PD_PROXY_PREFILL": P, "PD_PROXY_DECODE": D}
    with pytest.raises(ConfigError, match=message):
        load_config([], {**base, **env})


def test_main_exits_2_with_a_message_not_a_traceback(monkeypatch, capsys):
    monkeypatch.setenv("PD_PROXY_PREFILL", P)
    monkeypatch.setenv("PD_PROXY_DECODE", D)
    monkeypatch.setenv("PD_PROXY_HEALTH_INTERVAL", "often")
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert "PD_PROXY_HEALTH_INTERVAL" in err
    assert "Traceback" not in err


def test_console_script_rejects_bad_env_with_exit_2():
    package_root = str(Path(cli.__file__).resolve().parents[1])
    env = {"PYTHONPATH": package_root, "PD_PROXY_PREFILL": P, "PD_PROXY_DECODE": D}
    env["PD_PROXY_PORT"] = "x"
    proc = subprocess.run(
        [sys.executable, "-m", "pd_proxy"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "PD_PROXY_PORT" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_documents_every_option_and_its_variable():
    text = build_parser().format_help()
    for flag, env in [
        ("--prefill", "PD_PROXY_PREFILL"),
        ("--decode", "PD_PROXY_DECODE"),
        ("--host", "PD_PROXY_HOST"),
        ("--port", "PD_PROXY_PORT"),
        ("--connect-timeout", "PD_PROXY_CONNECT_TIMEOUT"),
        ("--prefill-timeout", "PD_PROXY_PREFILL_TIMEOUT"),
        ("--decode-timeout", "PD_PROXY_DECODE_TIMEOUT"),
        ("--max-body-bytes", "PD_PROXY_MAX_BODY_BYTES"),
        ("--health-interval", "PD_PROXY_HEALTH_INTERVAL"),
        ("--health-timeout", "PD_PROXY_HEALTH_TIMEOUT"),
        ("--health-failures", "PD_PROXY_HEALTH_FAILURES"),
        ("--health-successes", "PD_PROXY_HEALTH_SUCCESSES"),
        ("--tokenize-timeout", "PD_PROXY_TOKENIZE_TIMEOUT"),
        ("--drain-timeout", "PD_PROXY_DRAIN_TIMEOUT"),
        ("--log-level", "PD_PROXY_LOG_LEVEL"),
        ("--no-metrics", "PD_PROXY_METRICS"),
    ]:
        assert flag in text
        assert env in text


def held_port() -> socket.socket:
    """A loopback socket listening on an ephemeral port, so binding that port fails."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder


def test_busy_port_exits_2_with_one_line_and_no_traceback():
    package_root = str(Path(cli.__file__).resolve().parents[1])
    with held_port() as holder:
        port = holder.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "pd_proxy", "--host", "127.0.0.1", "--port", str(port),
             "--prefill", P, "--decode", D, "--health-timeout", "0.5"],
            env={"PYTHONPATH": package_root}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"pd-proxy: error: cannot listen on 127.0.0.1:{port}: "), last
    assert "address already in use" in last.lower()
    assert "Traceback" not in proc.stderr


async def test_busy_port_still_closes_the_session_and_health_task():
    """``runner.setup()`` has started both before the bind fails; they must not outlive serve()."""
    with held_port() as holder:
        port = holder.getsockname()[1]
        config = load_config(
            ["--host", "127.0.0.1", "--port", str(port), "--prefill", P, "--decode", D]
        )
        with pytest.raises(cli.ListenError):
            await cli.serve(config)
    names = {t.get_name() for t in asyncio.all_tasks()}
    assert "pd-proxy-health" not in names


def test_settings_are_data_and_validate_lists_every_file_problem(tmp_path, capsys):
    """Parsing reads no file (a missing one is fine until ``validate``), which then names each
    problem at once; ``main`` prints one error line per problem and exits 2."""
    from pd_proxy.api.startup_checks import validate

    missing, empty = str(tmp_path / "absent"), tmp_path / "empty"
    empty.write_text("# no key\n")
    argv = ["--prefill", P, "--decode", D, "--api-key-file", missing]
    argv += ["--backend-api-key-file", str(empty), "--endpoints-file", str(tmp_path / "none.yaml")]
    config = load_config(argv, {})  # no I/O: nothing to complain about yet
    with pytest.raises(ConfigError) as info:
        validate(config)
    assert len(info.value.problems) == 3
    assert [p.split(" ", 1)[0] for p in info.value.problems] == [
        "--api-key-file",
        "--backend-api-key-file",
        "--endpoints-file",
    ]
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("pd-proxy: error: ") for line in lines)


def test_pure_problems_are_listed_together():
    with pytest.raises(ConfigError) as info:
        load_config(["--port", "70000", "--drain-timeout", "0"], {"PD_PROXY_PREFILL": P})
    assert len(info.value.problems) == 3  # no decode backend, the port, the drain timeout
