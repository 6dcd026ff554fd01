"""Every Markdown file of the kit cites only what exists: relative links and their #anchors,
repo paths and test files (in code spans, fenced blocks or prose), and test node ids
(`tests/x.py::test_y`) that name a real test; and every cited test runs under `make test` or a
command named beside the citation (`make test-slow`, `-m "compose and repeat"`). README.md, the
front door, also stays short."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import cited_tests as ct
from tests.support import doc_citations as dc
from tests.support.paths import REPO

README = REPO / "README.md"
README_LIMIT_BYTES = 10 * 1024
DOCS = dc.markdown_files(REPO)


def doc_id(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_readme_stays_under_10_kb() -> None:
    size = len(README.read_bytes())
    assert size < README_LIMIT_BYTES, f"README.md is {size} bytes; move detail into docs/"


def test_every_document_is_checked() -> None:
    """The walk finds the component READMEs and docs/, and skips environments and run output."""
    names = {doc_id(p) for p in DOCS}
    assert {"README.md", "docs/verification.md", "connector/README.md", "proxy/README.md"} <= names
    assert not [n for n in names if n.startswith((".venv/", "run/", "results/"))]


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_relative_links_resolve(doc: Path) -> None:
    assert dc.missing_targets(doc) == []


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_links_land_on_a_heading(doc: Path) -> None:
    assert dc.missing_anchors(doc) == []


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_cited_paths_and_tests_exist(doc: Path) -> None:
    assert dc.missing_paths(doc, REPO) == []
    assert dc.missing_test_names(doc, REPO / "tests") == []


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_cited_tests_run_under_a_documented_command(doc: Path) -> None:
    assert ct.unrun(doc, REPO) == []


def test_the_docs_cite_tests_and_the_makefile_runs_them() -> None:
    """The check sees citations (so it cannot pass on nothing) and the Makefile's commands."""
    assert sum(1 for doc in DOCS for _ in ct.citations(doc, REPO)) > 50
    commands = ct.make_commands(REPO)
    assert commands["test"] == ["not e2e and not compose", "e2e or compose"]
    assert commands["test-slow"] == ["slow"]
    assert commands["test-k8s"] == ["k8s"]


def test_the_front_doors_link_somewhere() -> None:
    for doc in (README, REPO / "docs" / "verification.md"):
        assert dc.relative_links(doc), f"{doc.name} links nowhere"


# --- the checks themselves find each kind of breakage ------------------------------------------


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "[ok](x.md) [gone](nope.md#a) [web](https://example.com) [here](#top)\n"
        "```\n[example](not-checked.md)\n```\n"
    )
    assert dc.relative_links(doc) == ["x.md", "nope.md#a"]
    assert dc.missing_targets(doc) == ["nope.md#a"]


def test_a_link_to_a_missing_heading_is_found(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text(
        "# Figures: the 2-core CPU machine\n## P/D `make x` (y)\n## Twice\n## Twice\n"
    )
    doc = tmp_path / "a.md"
    links = (
        "[a](b.md#figures-the-2-core-cpu-machine) [b](b.md#pd-make-x-y) [c](b.md#gone) "
        "[d](b.md#twice-1) [e](b.md#twice-2) [f](#own) [g](#nowhere)\n# Own\n"
    )
    doc.write_text(links)
    assert dc.missing_anchors(doc) == ["b.md#gone", "b.md#twice-2", "a.md#nowhere"]


def test_a_missing_cited_path_is_found(tmp_path: Path) -> None:
    """Repo paths in code spans, fenced blocks and plain prose, folders, globs, paths beside the
    document; runtime paths, URLs, absolute paths, placeholders and kubectl resources left alone."""
    repo = tmp_path
    (repo / "tests").mkdir()
    (repo / "tests" / "test_a.py").write_text("def test_real():\n    pass\n")
    (repo / "pkg").mkdir()
    (repo / "pkg" / "mod.py").write_text("")
    (repo / "compose.yaml").write_text("")
    doc = repo / "pkg" / "README.md"
    doc.write_text(
        "Run `tests/test_a.py`, `tests/`, `tests/test_*.py`, `compose.yaml` and `mod.py`.\n"
        "Gone: `tests/test_gone.py`, `tests/gone/`, `tests/test_z*.py`, `pkg/old.py`.\n"
        "Beside the doc: `mod.py` is a name, `pkg/mod.py` a path.\n"
        "Commands: `pytest tests/test_a.py -k x` and `kubectl rollout status deploy/web`.\n"
        "Not ours: `run/x.log`, `results/a/`, `/metrics`, `https://x/y`, `<your>/path`.\n"
        "```\ndocker build -f tests/in_a_fence.py --out=pkg/gone.txt . # tests/test_a.py\n"
        "kubectl rollout status deploy/web; ls /models results/b <kind>-* https://x/tests/y\n"
        "pytest tests/test_a.py::test_real 'tests/test_a.py::test_quoted_gone'\n```\n"
        "In prose, **tests/prose_gone.py** (see [link text](x.md)) and pkg/mod.py, P/D.\n"
    )
    assert dc.missing_paths(doc, repo) == [
        "tests/test_gone.py",
        "tests/gone/",
        "tests/test_z*.py",
        "pkg/old.py",
        "tests/in_a_fence.py",
        "pkg/gone.txt",
        "tests/test_a.py::test_quoted_gone",
        "tests/prose_gone.py",
    ]


def test_a_node_id_without_its_test_is_found(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(
        "class TestK:\n    def test_m(self):\n        pass\n\nasync def test_async():\n    pass\n"
    )
    doc = tmp_path / "a.md"
    doc.write_text(
        "`tests/test_a.py::TestK::test_m` `tests/test_a.py::test_async[1-2]`\n"
        "`tests/test_a.py::test_renamed` `tests/test_a.py::TestK::test_gone`\n"
        "`tests/test_a.py::test_m` (a method, not a function at the top)\n"
    )
    assert dc.missing_paths(doc, tmp_path) == [
        "tests/test_a.py::test_renamed",
        "tests/test_a.py::TestK::test_gone",
        "tests/test_a.py::test_m",
    ]


def test_a_bare_test_file_name_that_exists_nowhere_is_found(tmp_path: Path) -> None:
    (tmp_path / "tests" / "sub").mkdir(parents=True)
    (tmp_path / "tests" / "sub" / "test_here.py").write_text("")
    doc = tmp_path / "a.md"
    doc.write_text("`tests/sub/test_here.py`, `test_here.py`, `test_gone.py`, `test_h*.py`\n")
    assert dc.missing_test_names(doc, tmp_path / "tests") == ["test_gone.py"]


def test_a_cited_test_no_documented_command_runs_is_found(tmp_path: Path) -> None:
    """`make test` leaves out slow and repeat tests; a citation of one passes only beside a
    command that runs it (a Makefile target or a `-m` expression naming its marker)."""
    (tmp_path / "Makefile").write_text(
        "test:  ## all\n\tbash scripts/run.sh\n"
        "test-slow:\n\t$(PY) -m pytest -ra -m slow\nlint:\n\truff check .\n"
    )
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "run.sh").write_text(
        '# both pytest runs\n"$PY" -m pytest -m "not e2e" \\\n  -x\n"$PY" -m pytest -m e2e\n'
    )
    (tmp_path / "tests" / "k").mkdir(parents=True)
    (tmp_path / "tests" / "k" / "conftest.py").write_text(
        "def pytest_collection_modifyitems(items):\n"
        "    for item in items:\n        item.add_marker(pytest.mark.slow)\n"
    )
    (tmp_path / "tests" / "k" / "test_k.py").write_text("def test_k():\n    pass\n")
    (tmp_path / "tests" / "test_a.py").write_text(
        "import pytest\npytestmark = [pytest.mark.e2e]\n\ndef test_plain():\n    pass\n\n"
        "@pytest.mark.slow\n@pytest.mark.repeat\ndef test_both():\n    pass\n\n"
        "@pytest.mark.slow\nclass TestS:\n    def test_m(self):\n        pass\n"
    )
    doc = tmp_path / "a.md"
    doc.write_text(
        "Plain: `tests/test_a.py` and `tests/test_a.py::test_plain`.\n\n"
        "- `tests/test_a.py::TestS::test_m` (`make test-slow`)\n"
        "- `tests/test_a.py::TestS` alone\n"
        "- `tests/test_a.py::test_both` (`make test-slow`)\n\n"
        '| `tests/test_a.py::test_both[1]` | `pytest -m "slow and repeat"` |\n'
        "| `test_k.py` | nothing |\n\n"
        "```\npython -m pytest tests/test_a.py::test_both\n```\n"
    )
    assert ct.make_commands(tmp_path) == {"test": ["not e2e", "e2e"], "test-slow": ["slow"]}
    assert ct.unrun(doc, tmp_path) == [
        "tests/test_a.py::TestS (e2e, slow)",
        "tests/test_a.py::test_both (e2e, repeat, slow)",
        "test_k.py (slow)",
        "tests/test_a.py::test_both (e2e, repeat, slow)",
    ]
