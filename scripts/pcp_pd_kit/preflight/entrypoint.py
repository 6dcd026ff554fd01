"""The vLLM containers' entrypoint (compose/entrypoint/vllm_serve.py), loaded by path: it is no
package, and it is standard library only at import. Preflight calls its rules (the ENFORCE_EAGER
switch, each replica's GPUs) so it refuses exactly what the containers would refuse."""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType

from pcp_pd_kit import repo_root

PATH = repo_root() / "compose" / "entrypoint" / "vllm_serve.py"


@functools.lru_cache(maxsize=None)  # noqa: UP033 (functools.cache is Python 3.9+)
def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kit_vllm_serve", PATH)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load the vLLM entrypoint {PATH}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
