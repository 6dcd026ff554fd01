"""What a Markdown file cites in this repository: relative links, their #anchors, and repo paths
and pytest node ids, in code spans, fenced blocks and plain prose. Pure functions over text, so a
test can feed them a broken document and see each kind of breakage found."""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterable, Iterator
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
        yield from _path_words(m.group(2).split())


def fence_words(text: str) -> Iterator[str]:
    """Each word of each line of the fenced code blocks: a command's arguments (`-f x`, `--a=x`,
    quoted or in parentheses) and its comments."""
    for m in FENCE.finditer(text):
        for line in m.group(0).splitlines()[1:-1]:
            yield from _path_words(FENCE_SPLIT.split(line))


def plain_words(text: str) -> Iterator[str]:
    """Each word of the prose outside code spans and fences (link targets are checked apart);
    emphasis stars around a word dropped."""
    bare = LINK.sub("] ", CODE_SPAN.sub(" ", prose(text)))
    yield from _path_words(w.strip("*") for w in FENCE_SPLIT.split(bare))


def all_words(text: str) -> Iterator[str]:
    yield from code_words(text)
    yield from fence_words(text)
    yield from plain_words(text)


# Between the words of a fenced line or of prose: spaces, quotes, brackets, `=`, commas.
FENCE_SPLIT = re.compile(r"[\s\"'(),;=`<>]+")


def _path_words(words: Iterable[str]) -> Iterator[str]:
    words = list(words)
    kubectl = bool({"kubectl", "rollout"} & set(words))
    for word in words:
        word = word.rstrip(".,;:)")
        if not word or not PATH_WORD.fullmatch(word) or SCHEME.match(word.split("::")[0]):
            continue
        if kubectl and KUBE_RESOURCE.fullmatch(word):
            continue
        yield word


def cited_paths(path: Path, repo: Path) -> list[tuple[str, list[Path]]]:
    """(as written, where it may resolve) for each word that names a place in the repo: its first
    segment is a top-level entry of the repo, or of the document's own folder (`proxy/x.md` in
    docs/ may be either)."""
    return [c for w in all_words(path.read_text()) if (c := cited_path(w, path.parent, repo))[1]]


def cited_path(word: str, folder: Path, repo: Path) -> tuple[str, list[Path]]:
    file_part = word.split("::", 1)[0]
    first = file_part.split("/", 1)[0]
    if "/" not in file_part and first not in TOP_FILES:
        return word, []
    if file_part.startswith(RUNTIME_PREFIXES) or file_part.startswith(("/", "~")):
        return word, []
    return word, [base / file_part for base in (repo, folder) if first in _entries(base)]


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
    for word, targets in cited_paths(path, repo):
        found = [t for t in targets if exists(t)]
        if not found or ("::" in word and not has_node(found[0], word.split("::")[1:])):
            missing.append(word)
    return missing


def has_node(test_file: Path, names: list[str]) -> bool:
    """`test.py::Class::test_x[param]`: the class is defined at the top of the file and the test
    in it (a bare `test.py::test_x`: at the top)."""
    if test_file.suffix != ".py":
        return False
    scope: list[ast.stmt] = ast.parse(test_file.read_text()).body
    for name in names:
        found = [n for n in scope if isinstance(n, DEFINITIONS) and n.name == name.split("[")[0]]
        if not found:
            return False
        scope = found[0].body
    return True


DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def cited_test_names(path: Path) -> list[str]:
    """Bare test file names (`test_faults.py`), cited without their folder."""
    return [w for w in all_words(path.read_text()) if re.fullmatch(r"test_[\w*]+\.py", w)]


def missing_test_names(path: Path, tests_dir: Path) -> list[str]:
    return [n for n in cited_test_names(path) if not any(tests_dir.rglob(n))]
