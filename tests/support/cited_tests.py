"""Which documented command runs a test a document cites. A test's markers are read from its file
(decorators, `pytestmark`) and from the conftest.py files above it that add one to every test
(`item.add_marker(pytest.mark.k8s)`). The commands are the Makefile's pytest targets (`make test`
through scripts/run_tests.sh), and any `-m EXPR` the document writes in the same paragraph, table
row or list item as the citation. conftest.py's opt-in rule holds: a test marked `slow` or
`repeat` runs only where the expression names that marker."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tests.conftest import OPT_IN
from tests.support import doc_citations as dc

MAKE_TARGET = re.compile(r"^([\w-]+):", re.MULTILINE)
MARK_EXPR = re.compile(r"""-m\s+(?:"([^"]*)"|'([^']*)'|([\w-]+))""")
MAKE_CALL = re.compile(r"\bmake ([\w-]+)")
TEST_FILE = re.compile(r"test_\w*\.py")
LIST_ITEM = re.compile(r"\s*([-*+]|\d+\.)\s")


@dataclass(frozen=True)
class Cited:
    """One citation: a test file (every test in it) or one node, and the words around it."""

    word: str
    tests: dict[str, frozenset[str]]  # node name -> its markers
    unit: str


def runs(expr: str, markers: frozenset[str]) -> bool:
    """Whether `pytest -m EXPR` (empty: no -m) runs a test with these markers."""
    if any(m in markers and m not in expr for m in OPT_IN):
        return False
    return not expr or _evaluate(ast.parse(expr, mode="eval").body, markers)


def _evaluate(node: ast.expr, markers: frozenset[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in markers
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not _evaluate(node.operand, markers)
    if isinstance(node, ast.BoolOp):
        values = (_evaluate(v, markers) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    raise ValueError(f"not a marker expression: {ast.unparse(node)}")


def make_commands(repo: Path) -> dict[str, list[str]]:
    """Each Makefile target that runs pytest: its `-m` expressions ('' for none). A target that
    runs a script of the repo takes the script's pytest runs."""
    makefile = (repo / "Makefile").read_text()
    starts = [(m.group(1), m.end()) for m in MAKE_TARGET.finditer(makefile)]
    commands = {}
    for i, (target, start) in enumerate(starts):
        end = starts[i + 1][1] if i + 1 < len(starts) else len(makefile)
        recipe = "\n".join(line for line in makefile[start:end].splitlines() if line[:1] == "\t")
        for script in re.findall(r"scripts/[\w.-]+\.sh", recipe):
            recipe += "\n" + (repo / script).read_text().replace("\\\n", " ")
        lines = [line for line in recipe.splitlines() if not line.lstrip().startswith("#")]
        exprs = [_pytest_expr(line) for line in lines if " pytest" in line]
        if exprs:
            commands[target] = exprs
    return commands


def _pytest_expr(line: str) -> str:
    after = line.split(" pytest", 1)[1]
    found = [next(g for g in m.groups() if g is not None) for m in MARK_EXPR.finditer(after)]
    return found[0] if found else ""


def named_exprs(unit: str, commands: dict[str, list[str]]) -> list[str]:
    """The marker expressions of the commands a piece of a document names: `make test-slow`,
    `pytest -m "compose and repeat" ...` (`-m pytest` of `python -m pytest` is no marker)."""
    exprs = [e for target in MAKE_CALL.findall(unit) for e in commands.get(target, [])]
    for m in MARK_EXPR.finditer(unit):
        value = next(g for g in m.groups() if g is not None)
        if value != "pytest":
            exprs.append(value)
    return exprs


def units(text: str) -> Iterator[str]:
    """The document in the pieces a citation and its command share: a paragraph, a list item, a
    table row, a heading, or a fenced block."""
    block: list[str] = []
    fence = ""
    for line in text.splitlines():
        if fence:
            block.append(line)
            if line.lstrip().startswith(fence):
                yield "\n".join(block)
                block, fence = [], ""
            continue
        starts_fence = line.lstrip().startswith(("```", "~~~"))
        if block and (not line.strip() or starts_fence or _starts_piece(line)):
            yield "\n".join(block)
            block = []
        if starts_fence:
            fence = line.lstrip()[:3]
        if line.strip():
            block.append(line)
        if line.lstrip().startswith(("|", "#")) and not fence:
            yield "\n".join(block)
            block = []
    if block:
        yield "\n".join(block)


def _starts_piece(line: str) -> bool:
    return bool(LIST_ITEM.match(line)) or line.lstrip().startswith(("|", "#"))


def citations(doc: Path, repo: Path) -> Iterator[Cited]:
    """Each test file or node the document cites (a bare `test_x.py` found once under tests/),
    with its tests' markers."""
    tests_dir = repo / "tests"
    for unit in units(doc.read_text()):
        for word in dict.fromkeys(dc.all_words(unit)):
            for file in _test_files(word, doc.parent, repo, tests_dir):
                node = "::".join(n.split("[")[0] for n in word.split("::")[1:])
                marks = markers(file, repo)
                chosen = {k: v for k, v in marks.items() if _is_node(k, node)}
                if chosen:
                    yield Cited(word, chosen, unit)


def _is_node(name: str, cited: str) -> bool:
    """A test is cited by its file (`cited` empty), its own name, or its class's."""
    return not cited or name == cited or name.startswith(cited + "::")


def _test_files(word: str, folder: Path, repo: Path, tests_dir: Path) -> list[Path]:
    if TEST_FILE.fullmatch(word):
        found = sorted(tests_dir.rglob(word))
        return found if len(found) == 1 else []
    _, targets = dc.cited_path(word, folder, repo)
    files: list[Path] = []
    for target in targets:
        parts = target.parts
        wild = [i for i, p in enumerate(parts) if dc.GLOB_CHARS & set(p)]
        matches = Path(*parts[: wild[0]]).glob("/".join(parts[wild[0] :])) if wild else [target]
        files += [f for f in matches if f.is_file() and TEST_FILE.fullmatch(f.name)]
    return [f for f in dict.fromkeys(files) if tests_dir in f.parents]


def unrun(doc: Path, repo: Path) -> list[str]:
    """Cited tests no documented command runs: a cited node (or, for a file, every test in it)
    left out of `make test`, and of every command the document names beside the citation."""
    commands = make_commands(repo)
    found = []
    for cited in citations(doc, repo):
        exprs = commands["test"] + named_exprs(cited.unit, commands)
        if not any(runs(e, m) for e in exprs for m in cited.tests.values()):
            marks = sorted(set().union(*cited.tests.values()) & {*OPT_IN, "k8s", "e2e", "compose"})
            found.append(f"{cited.word} ({', '.join(marks)})")
    return found


@cache
def markers(test_file: Path, repo: Path) -> dict[str, frozenset[str]]:
    """Each test of the file (`test_x`, `TestK::test_m`) and its markers."""
    tree = ast.parse(test_file.read_text())
    inherited = _folder_markers(test_file, repo) | _pytestmark(tree.body)
    found = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            in_class = inherited | _decorators(node) | _pytestmark(node.body)
            for method in node.body:
                if _is_test(method):
                    found[f"{node.name}::{method.name}"] = in_class | _decorators(method)
        elif _is_test(node):
            found[node.name] = inherited | _decorators(node)
    return found


def _is_test(node: ast.stmt) -> bool:
    funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
    return isinstance(node, funcs) and node.name.startswith("test")


def _mark_names(node: ast.expr) -> frozenset[str]:
    """`pytest.mark.x`, `pytest.mark.x(...)`, or a list of them."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return frozenset().union(*(_mark_names(e) for e in node.elts))
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "pytest.mark":
        return frozenset({node.attr})
    return frozenset()


def _decorators(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> frozenset[str]:
    return frozenset().union(*(_mark_names(d) for d in node.decorator_list))


def _pytestmark(body: list[ast.stmt]) -> frozenset[str]:
    marks: frozenset[str] = frozenset()
    for node in body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            marks |= _mark_names(node.value)
    return marks


def _folder_markers(test_file: Path, repo: Path) -> frozenset[str]:
    """Markers a conftest.py above the file adds to each of its tests (`item.add_marker(...)`)."""
    marks: frozenset[str] = frozenset()
    for folder in test_file.parents:
        if folder == repo:
            break
        conftest = folder / "conftest.py"
        if conftest.is_file():
            for node in ast.walk(ast.parse(conftest.read_text())):
                if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(".add_marker"):
                    marks |= frozenset().union(*(_mark_names(a) for a in node.args))
    return marks
