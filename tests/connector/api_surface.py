"""The part of vLLM's Python API the kit's connector and launcher use, read with ``ast``.

Nothing here imports vLLM: a vLLM source tree (an installed package, or the files of a wheel) is
parsed, so the GPU build's API can be checked on a machine without CUDA. What the kit uses is
read from the kit's own sources (every ``vllm`` import in connector/ and the containers'
entrypoint, the entrypoint's ``API_SERVER`` module, the vLLM classes the connector subclasses
and the methods it overrides) plus ``version_guard``'s tables.

Regenerate the committed surface of a release from its wheel (public Apache-2.0 code: the
names are kept, not the code)::

    pip download --no-deps vllm==0.33.0 -d /tmp/w
    python -m tests.connector.api_surface /tmp/w/vllm-0.33.0-*.whl \\
        > tests/connector/data/vllm-0.33.0-api.json
"""

from __future__ import annotations

import ast
import json
import sys
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
KIT_SOURCES = (
    REPO / "connector" / "pcp_nixl_connector",
    REPO / "compose" / "entrypoint",
    REPO / "scripts" / "pcp_pd_kit" / "bench" / "vllm_serve.py",
)
DATA_DIR = Path(__file__).resolve().parent / "data"

#: Reads ``vllm/a/b.py`` (or ``vllm/a/b/__init__.py``) of one vLLM tree; None when absent.
Reader = Callable[[str], str | None]


def tree_reader(root: Path) -> Reader:
    """Reader over a directory holding the ``vllm`` package (e.g. site-packages)."""

    def read(relpath: str) -> str | None:
        path = root / relpath
        return path.read_text() if path.is_file() else None

    return read


def wheel_reader(wheel: Path) -> Reader:
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())

    def read(relpath: str) -> str | None:
        return archive.read(relpath).decode() if relpath in names else None

    return read


def _module_files(module: str) -> tuple[str, str]:
    base = module.replace(".", "/")
    return f"{base}.py", f"{base}/__init__.py"


# -- one module's surface -------------------------------------------------------------------------
def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module of ``from <level dots><name> import ...`` inside ``module``."""
    if level == 0:
        return name or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join([*parts, name] if name else parts)


def _imports(tree: ast.Module, module: str, is_package: bool) -> dict[str, str]:
    """Top-level alias -> dotted target (``from a import B as C``: C -> a.B)."""
    table: dict[str, str] = {}
    for node in _top_level(tree.body):
        if isinstance(node, ast.ImportFrom):
            source = _resolve(module, is_package, node.level, node.module)
            for alias in node.names:
                table[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    table[alias.asname] = alias.name
                else:
                    head = alias.name.split(".")[0]
                    table[head] = head
    return table


def _top_level(body: Iterable[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, looking into if/try blocks (conditional definitions)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _top_level(block)
            for handler in node.handlers:
                yield from _top_level(handler.body)


def _targets(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _dotted(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        inner = _dotted(expr.value)
        return f"{inner}.{expr.attr}" if inner else None
    if isinstance(expr, ast.Subscript):  # Generic[T] and the like
        return _dotted(expr.value)
    return None


def _class_members(node: ast.ClassDef) -> list[str]:
    """Methods, class attributes and the ``self.X`` attributes any method assigns."""
    members: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            members.add(item.name)
        members.update(_targets(item))
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
            if isinstance(sub.value, ast.Name) and sub.value.id == "self":
                members.add(sub.attr)
    return sorted(members)


def module_surface(source: str, module: str, is_package: bool) -> dict[str, Any]:
    """Top-level names, whether it runs as ``__main__``, and each class's bases and members."""
    tree = ast.parse(source)
    imports = _imports(tree, module, is_package)
    names: set[str] = set(imports)
    classes: dict[str, Any] = {}
    main_guard = False
    for node in _top_level(tree.body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            bases = []
            for base in node.bases:
                dotted = _dotted(base)
                if dotted is None:
                    continue
                head, _, rest = dotted.partition(".")
                if head in imports:
                    target = imports[head]
                    bases.append(f"{target}.{rest}" if rest else target)
                else:
                    bases.append(f"{module}.{dotted}")
            classes[node.name] = {"bases": bases, "members": _class_members(node)}
        elif isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            main_guard = True
        names.update(_targets(node))
    return {"names": sorted(names), "main_guard": main_guard, "classes": classes}


# -- a vLLM tree's surface, as far as the kit reaches ----------------------------------------------
@dataclass
class Surface:
    """Module -> module_surface(), for the modules read so far from one vLLM tree."""

    modules: dict[str, dict[str, Any]] = field(default_factory=dict)
    absent: set[str] = field(default_factory=set)

    def has_module(self, module: str) -> bool:
        return module in self.modules

    def has_name(self, module: str, name: str) -> bool:
        """``from module import name`` works: a defined name, or a submodule."""
        return name in self.modules.get(module, {}).get("names", ()) or (
            f"{module}.{name}" in self.modules
        )

    def class_entry(self, dotted: str) -> dict[str, Any] | None:
        """The class ``module.Class``, following re-exports (``from x import C`` in module)."""
        for _ in range(8):
            module, _, name = dotted.rpartition(".")
            info = self.modules.get(module)
            if info is None:
                return None
            if name in info["classes"]:
                return dict(info["classes"][name], qualname=dotted)
            target = _reexport_target(info, module, name)
            if target is None:
                return None
            dotted = target
        return None

    def members(self, dotted: str) -> set[str] | None:
        """Members of a class with those of its vLLM base classes; None when unknown."""
        entry = self.class_entry(dotted)
        if entry is None:
            return None
        found = set(entry["members"])
        for base in entry["bases"]:
            if base.startswith("vllm."):
                inherited = self.members(base)
                if inherited is not None:
                    found |= inherited
        return found

    def pruned(self, classes: Iterable[str], names: set[tuple[str, str]]) -> Surface:
        """Only the ``names`` asked about (and ``main``), and the class entries and re-exports
        on the way to ``classes``' members."""
        keep_classes: set[str] = set()
        keep_reexports: set[str] = set()
        pending = list(classes)
        while pending:
            dotted = pending.pop()
            module, _, name = dotted.rpartition(".")
            info = self.modules.get(module)
            if info is None or dotted in keep_classes | keep_reexports:
                continue
            if name in info["classes"]:
                keep_classes.add(dotted)
                pending.extend(info["classes"][name]["bases"])
            elif name in info["reexports"]:
                keep_reexports.add(dotted)
                pending.append(info["reexports"][name])
        modules = {}
        for module, info in self.modules.items():
            modules[module] = {
                "names": [n for n in info["names"] if n == "main" or (module, n) in names],
                "main_guard": info["main_guard"],
                "classes": {
                    n: c for n, c in info["classes"].items() if f"{module}.{n}" in keep_classes
                },
                "reexports": {
                    n: t for n, t in info["reexports"].items() if f"{module}.{n}" in keep_reexports
                },
            }
        return Surface(modules=modules, absent=set(self.absent))

    def to_json(self, version: str, source: str, checked: Iterable[str] = ()) -> str:
        """One module per line, so a regenerated file diffs by module. ``checked``: the kit's
        needs it was made for (a later kit that needs more asks for a new file)."""
        lines = [f"  {json.dumps(m)}: {json.dumps(self.modules[m], sort_keys=True)}"
                 for m in sorted(self.modules)]  # fmt: skip
        head = f'{{"vllm_version": {json.dumps(version)}, "source": {json.dumps(source)},\n'
        absent = f'"absent": {json.dumps(sorted(self.absent))},\n'
        head += f'"checked": {json.dumps(sorted(checked))},\n'
        return head + absent + '"modules": {\n' + ",\n".join(lines) + "\n}}\n"

    @classmethod
    def from_json(cls, text: str) -> tuple[str, Surface]:
        data = json.loads(text)
        return str(data["vllm_version"]), cls(modules=data["modules"], absent=set(data["absent"]))

    @staticmethod
    def checked_in(text: str) -> set[str]:
        return set(json.loads(text)["checked"])


def _reexport_target(info: dict[str, Any], module: str, name: str) -> str | None:
    return info.get("reexports", {}).get(name)


def _load(read: Reader, module: str, surface: Surface, record_absent: bool = True) -> None:
    """Parse ``module`` (and its packages, and its classes' base modules) into ``surface``."""
    if not record_absent:
        plain, package = _module_files(module)
        if read(plain) is None and read(package) is None:
            return
    queue = [module]
    while queue:
        module = queue.pop()
        if not module.startswith("vllm") or module in surface.modules or module in surface.absent:
            continue
        plain, package = _module_files(module)
        text, is_package = read(plain), False
        if text is None:
            text, is_package = read(package), True
        if text is None:
            surface.absent.add(module)
            continue
        info = module_surface(text, module, is_package)
        info["reexports"] = {
            alias: target
            for alias, target in _imports(ast.parse(text), module, is_package).items()
            if target.startswith("vllm.")
        }
        surface.modules[module] = info
        for entry in info["classes"].values():
            queue.extend(base.rpartition(".")[0] for base in entry["bases"])
        if "." in module:
            queue.append(module.rpartition(".")[0])


def read_modules(read: Reader, wanted: Iterable[str], classes: Iterable[str] = ()) -> Surface:
    """Parse the ``wanted`` modules of one vLLM tree, then whatever it takes to find the
    members of ``classes`` (dotted names), following re-exports and base classes."""
    surface = Surface()
    for module in wanted:
        _load(read, module, surface)
    pending = list(classes)
    for _ in range(64):
        if not pending:
            break
        dotted = pending.pop()
        module, _, name = dotted.rpartition(".")
        _load(read, module, surface)
        info = surface.modules.get(module)
        if info is None:
            continue
        if name in info["classes"]:
            pending.extend(b for b in info["classes"][name]["bases"] if b.startswith("vllm."))
            continue
        target = info["reexports"].get(name)
        if target is not None:
            pending.append(target)
    return surface


# -- what the kit uses -----------------------------------------------------------------------------
@dataclass(frozen=True)
class KitNeeds:
    """``names``: what the kit imports, each a tuple of alternatives ((module, name) pairs: a
    ``try: ... except ImportError:`` import accepts either); ``modules``: modules it imports or
    runs; ``main_modules``: modules it runs with ``python -m``; ``members``: class -> members
    the kit calls (version_guard's table); ``overrides``: vLLM class -> the methods a kit subclass
    defines (vLLM's API only where the base has them)."""

    names: frozenset[tuple[tuple[str, str], ...]]
    modules: frozenset[str]
    main_modules: frozenset[str]
    members: dict[str, frozenset[str]]
    overrides: dict[str, frozenset[str]]

    def classes(self) -> set[str]:
        return set(self.members) | set(self.overrides)

    def fingerprint(self) -> set[str]:
        """Every need as one string, to tell whether a surface file was made for them."""
        found = {f"module {m}" for m in self.modules | self.main_modules}
        found |= {" or ".join(f"{m}.{n}" for m, n in alts) for alts in self.names}
        for cls, members in (*self.members.items(), *self.overrides.items()):
            found |= {f"{cls}.{member}" for member in members}
        return found

    def all_modules(self) -> set[str]:
        found = set(self.modules) | set(self.main_modules)
        for alternatives in self.names:
            found |= {module for module, _name in alternatives}
        found |= {cls.rpartition(".")[0] for cls in self.classes()}
        return found


def _kit_files() -> list[Path]:
    files = (([root] if root.is_file() else list(root.rglob("*.py"))) for root in KIT_SOURCES)
    return sorted(path for group in files for path in group)


def _catches_import_error(node: ast.Try) -> bool:
    names = {ast.unparse(h.type) for h in node.handlers if h.type is not None}
    return bool(names & {"ImportError", "ModuleNotFoundError"})


def _vllm_imports(nodes: Iterable[ast.AST]) -> list[tuple[str, str]]:
    return [
        (node.module, alias.name)
        for node in nodes
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
        and node.module.split(".")[0] == "vllm"
        for alias in node.names
    ]  # fmt: skip


def kit_needs() -> KitNeeds:
    """Read the kit's sources (and version_guard's tables) for what they use of vLLM."""
    sys.path.insert(0, str(REPO / "connector"))
    sys.path.insert(0, str(REPO / "compose" / "entrypoint"))
    try:
        from vllm_serve.command import API_SERVER

        from pcp_nixl_connector import version_guard
    finally:
        del sys.path[:2]
    names: set[tuple[tuple[str, str], ...]] = set()
    modules: set[str] = set(version_guard.REQUIRED_APIS)
    overrides: dict[str, set[str]] = {}
    for module, attrs in version_guard.REQUIRED_APIS.items():
        names.update(((module, a),) for a in attrs)
    for path in _kit_files():
        tree = ast.parse(path.read_text())
        alternatives: set[tuple[str, str]] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and _catches_import_error(node):
                either = _vllm_imports(ast.walk(ast.Module(body=node.body, type_ignores=[])))
                handlers = [n for h in node.handlers for n in ast.walk(h)]
                either += _vllm_imports(handlers)
                if either:
                    names.add(tuple(sorted(either)))
                    alternatives.update(either)
        imported: dict[str, str] = {}
        for module, name in _vllm_imports(ast.walk(tree)):
            if (module, name) not in alternatives:
                names.add(((module, name),))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                modules.update(a.name for a in node.names if a.name.split(".")[0] == "vllm")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [imported[b.id] for b in node.bases if isinstance(b, ast.Name)
                         and imported.get(b.id, "").startswith("vllm.")]  # fmt: skip
                overridden = {
                    item.name
                    for item in node.body
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                    and not item.name.startswith("__")
                }
                for base in bases:
                    overrides.setdefault(base, set()).update(overridden)
    return KitNeeds(
        names=frozenset(names),
        modules=frozenset(modules),
        main_modules=frozenset({API_SERVER}),
        members={k: frozenset(v) for k, v in version_guard.REQUIRED_MEMBERS.items()},
        overrides={k: frozenset(v) for k, v in overrides.items()},
    )


def missing(surface: Surface, needs: KitNeeds, reference: Surface) -> list[str]:
    """What the kit uses that ``surface`` lacks. A method a kit subclass defines counts only
    where the ``reference`` tree (the vLLM the kit was written against) has it on the base:
    there it overrides vLLM's, and an override that no longer overrides is silently dead."""
    gaps: list[str] = []
    for module in sorted(needs.modules | needs.main_modules):
        if not surface.has_module(module):
            gaps.append(f"module {module}")
    for module in sorted(needs.main_modules):
        info = surface.modules.get(module)
        if info is not None and not ("main" in info["names"] and info["main_guard"]):
            gaps.append(f"{module}: main() run under __main__")
    for alternatives in sorted(needs.names):
        if not any(surface.has_name(module, name) for module, name in alternatives):
            gaps.append(" or ".join(f"{module}.{name}" for module, name in alternatives))
    for cls in sorted(needs.classes()):
        have = surface.members(cls)
        if have is None:
            gaps.append(f"class {cls}")
            continue
        known = reference.members(cls) or set()
        wanted = needs.members.get(cls, frozenset()) | (needs.overrides.get(cls, set()) & known)
        gaps.extend(f"{cls}.{m}" for m in sorted(wanted - have))
    return gaps


def surface_for(read: Reader, needs: KitNeeds) -> Surface:
    surface = read_modules(read, needs.all_modules(), needs.classes())
    for alternatives in needs.names:  # `from package import submodule`
        for module, name in alternatives:
            if module in surface.modules and name not in surface.modules[module]["names"]:
                _load(read, f"{module}.{name}", surface, record_absent=False)
    return surface


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].endswith(".whl"):
        print(__doc__, file=sys.stderr)
        return 2
    wheel = Path(argv[0])
    version = wheel.name.split("-")[1]
    needs = kit_needs()
    pairs = {pair for alternatives in needs.names for pair in alternatives}
    surface = surface_for(wheel_reader(wheel), needs).pruned(needs.classes(), pairs)
    sys.stdout.write(surface.to_json(version, wheel.name, needs.fingerprint()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
