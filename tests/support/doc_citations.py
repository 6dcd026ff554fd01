"""What a Markdown file cites in this repository: relative links, their #anchors, and repo paths
and pytest node ids written in backticks. Pure functions over text, so a test can feed them a
broken document and see each kind of breakage found."""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

# Folders that hold no document of the kit's own: environments, caches, run output, vendored or
# generated trees.
SKIP_DIRS = frozenset(
    {".git", ".venv", "venv", "node_modules", "run", "results", ".models", "build", "generated"}
)
SKIP_SUFFIXES = (".egg-info", "_cache")
# Paths a reader creates or a run writes (git-ignored): cited as places, never shipped.
RUNTIME_PREFIXES = ("run/", "results/", ".models/", ".venv/", "secrets/", ".env")

# [text](target): the target up to a space or ')'; images and reference links alike.
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
HEADING = re.compile(r"^#+ (.+?)#*\s*$", re.MULTILINE)
SCHEME = re.compile(r"[a-z][a-z0-9+.-]*:")
# One word of a code span that may be a path: no spaces, placeholders, variables or URLs.
PATH_WORD = re.compile(r"[\w.\-/*\[\]:]+")
GLOB_CHARS = frozenset("*?[")
KUBE_RESOURCE = re.compile(r"(deploy|svc|pod|sts|ds|cm|secret)/[\w.-]+")


def skipped(name: str) -> bool:
    return name in SKIP_DIRS or name.endswith(SKIP_SUFFIXES)


def repo_files(root: Path) -> Iterator[Path]:
    """Every file under root, not descending into environments, caches or generated trees."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not skipped(d))
        for name in sorted(files):
            yield Path(folder) / name


def markdown_files(root: Path) -> list[Path]:
    """Every .md file under root, outside environments, caches and generated trees."""
    return [p for p in repo_files(root) if p.suffix == ".md"]


def prose(text: str) -> str:
    """The text without fenced code blocks (their links and spans are examples, not citations)."""
    return FENCE.sub("", text)


def relative_links(path: Path) -> list[str]:
    """Link targets that are files of this repository (no scheme, no pure #anchor)."""
    targets = (m.group(1) for m in LINK.finditer(prose(path.read_text())))
    return [t for t in targets if not SCHEME.match(t) and not t.startswith("#")]


def missing_targets(path: Path) -> list[str]:
    return [
        t for t in relative_links(path) if not (path.parent / t.split("#", 1)[0]).resolve().exists()
    ]


def heading_anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor, with GitHub's -1, -2 suffixes for repeated headings."""
    counts: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(prose(text)):
        base = heading_anchor(heading)
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(f"{base}-{n}" if n else base)
    return found


def missing_anchors(path: Path) -> list[str]:
    """Links to a Markdown file (or this one) whose #anchor is no heading there."""
    missing = []
    for target in [*relative_links(path), *(f"{path.name}{m}" for m in own_anchor_links(path))]:
        name, _, anchor = target.partition("#")
        target_path = (path.parent / name).resolve()
        if not anchor or not name.endswith(".md") or not target_path.is_file():
            continue
        if anchor not in anchors(target_path.read_text()):
            missing.append(target)
    return missing


def own_anchor_links(path: Path) -> list[str]:
    return [t for t in (m.group(1) for m in LINK.finditer(prose(path.read_text()))) if t[:1] == "#"]


def code_words(text: str) -> Iterator[str]:
    """Each word of each inline code span, trailing punctuation dropped; kubectl's resource names
    (`rollout status deploy/pcp-pd-decode`) are not paths."""
    for m in CODE_SPAN.finditer(prose(text)):
        words = m.group(2).split()
        kubectl = bool({"kubectl", "rollout"} & set(words))
        for word in words:
            word = word.rstrip(".,;:)")
            if not word or not PATH_WORD.fullmatch(word) or SCHEME.match(word.split("::")[0]):
                continue
            if kubectl and KUBE_RESOURCE.fullmatch(word):
                continue
            yield word


def cited_paths(path: Path, repo: Path) -> list[tuple[str, Path]]:
    """(as written, where it resolves) for each code-span word that names a place in the repo:
    its first segment is a top-level entry of the repo, or of the document's own folder."""
    roots = {repo: _entries(repo), path.parent: _entries(path.parent)}
    cited = []
    for word in code_words(path.read_text()):
        file_part = word.split("::", 1)[0]
        first = file_part.split("/", 1)[0]
        if "/" not in file_part and first not in TOP_FILES:
            continue
        if file_part.startswith(RUNTIME_PREFIXES) or file_part.startswith(("/", "~")):
            continue
        for base, entries in roots.items():
            if first in entries:
                cited.append((word, base / file_part))
                break
    return cited


# Top-level files cited by name alone (`compose.yaml`), checked without a slash.
TOP_FILES = frozenset({"compose.yaml", "Makefile", "pyproject.toml", "constraints.txt"})


def _entries(folder: Path) -> frozenset[str]:
    return frozenset(p.name for p in folder.iterdir()) if folder.is_dir() else frozenset()


def exists(target: Path) -> bool:
    """A path, a folder (`tests/proxy/`) or a glob that matches (`tests/x/test_*.py`)."""
    parts = target.parts
    wild = [i for i, part in enumerate(parts) if GLOB_CHARS & set(part)]
    if not wild:
        return target.exists()
    return any(Path(*parts[: wild[0]]).glob("/".join(parts[wild[0] :])))


def missing_paths(path: Path, repo: Path) -> list[str]:
    """Cited repo paths that do not exist, and node ids whose test is not in the file."""
    missing = []
    for word, target in cited_paths(path, repo):
        if not exists(target):
            missing.append(word)
        elif "::" in word and not has_node(target, word.split("::")[1:]):
            missing.append(word)
    return missing


def has_node(test_file: Path, names: list[str]) -> bool:
    """`test.py::Class::test_x[param]`: the class and function are defined in the file."""
    defined = _definitions(test_file)
    return all(name.split("[", 1)[0] in defined for name in names)


@cache
def _definitions(test_file: Path) -> frozenset[str]:
    tree = ast.parse(test_file.read_text())
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return frozenset(n.name for n in ast.walk(tree) if isinstance(n, kinds))


def cited_test_names(path: Path) -> list[str]:
    """Bare test file names in code spans (`test_faults.py`), cited without their folder."""
    return [w for w in code_words(path.read_text()) if re.fullmatch(r"test_[\w*]+\.py", w)]


def missing_test_names(path: Path, tests_dir: Path) -> list[str]:
    return [n for n in cited_test_names(path) if not any(tests_dir.rglob(n))]
