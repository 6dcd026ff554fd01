"""scripts/images.sh on a machine that never built the images (no base image, no wheels, no
kit images), with fake `docker`, `debootstrap`, `id` and Python on PATH: no engine, no network.

The script runs from a copy of the checkout's few paths it reads, so nothing is written into the
repository. The fake docker keeps its images in $FAKE_DIR/images (one file per reference, holding
the image id), so the warm path (inputs-* tags) and --cold see what earlier calls built.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.fake_bin import write_executable
from tests.support.paths import REPO

SCRIPT = REPO / "scripts" / "images.sh"
BASE = "pcp-pd-kit/debian-base:bookworm"
KIT_IMAGES = ("pcp-pd-kit/pd-proxy:0.1.0", "pcp-pd-kit/prometheus:v3.5.0")
VLLM_IMAGE = "pcp-pd-kit/vllm-cpu:v0.32.0"

FAKE_DOCKER = r"""#!/usr/bin/env bash
# fake docker: images are files in $FAKE_DIR/images (name: the reference with / and : as _,
# content: its id); every call is appended to $FAKE_DIR/calls.
set -u
d="${FAKE_DIR:?}"
printf '%s\n' "$*" >>"$d/calls"
key() { printf '%s' "$1" | tr '/:' '__'; }
add() {
  printf '%s\n' "$1" >"$d/images/$(key "$1").ref"
  printf 'sha256:%s\n' "$RANDOM$RANDOM" >"$d/images/$(key "$1")"
}
last() { printf '%s' "${!#}"; }
case "$1" in
  info) exit 0 ;;
  pull) exit 1 ;;
  builder) exit 0 ;;
  compose)
    case "$*" in
      *" version"*) echo "Docker Compose version v2.40.3" ;;
      *"config --images"*) printf '%s\n' __IMAGES__ ;;
      *"config --format json"*) echo '{"services": {"prefill-cpu": {"image": "__VLLM__"}}}' ;;
      *" build"*) for ref in __KIT__; do add "$ref"; done ;;
      *) echo "fake docker: unexpected compose call: $*" >&2; exit 64 ;;
    esac ;;
  image)
    case "$2" in
      inspect)
        ref="$(last "$@")"
        [ -f "$d/images/$(key "$ref")" ] || { echo "Error: No such image: $ref" >&2; exit 1; }
        cat "$d/images/$(key "$ref")" ;;
      ls)
        repo="$(last "$@")"
        cat "$d"/images/*.ref 2>/dev/null | grep -F "$repo:" || true ;;
      rm)
        shift 2
        for ref in "$@"; do rm -f "$d/images/$(key "$ref")" "$d/images/$(key "$ref").ref"; done ;;
      *) echo "fake docker: unexpected image call: $*" >&2; exit 64 ;;
    esac ;;
  import) cat >/dev/null; add "$(last "$@")" ;;
  build)
    while [ "$#" -gt 0 ]; do [ "$1" = -t ] && { add "$2"; break; }; shift; done ;;
  tag)
    cp "$d/images/$(key "$2")" "$d/images/$(key "$3")"
    printf '%s\n' "$3" >"$d/images/$(key "$3").ref" ;;
  *) echo "fake docker: unexpected: $*" >&2; exit 64 ;;
esac
"""
FAKE_DEBOOTSTRAP = r"""#!/usr/bin/env bash
# fake debootstrap --variant=minbase SUITE DIR MIRROR: a tiny root tree, its path recorded
set -eu
printf 'debootstrap %s\n' "$*" >>"$FAKE_DIR/calls"
dir="$3"
echo "$dir" >"$FAKE_DIR/debootstrap-dir"
mkdir -p "$dir/etc" "$dir/var/cache/apt/archives" "$dir/var/lib/apt/lists"
echo 12.0 >"$dir/etc/debian_version"
touch "$dir/var/cache/apt/archives/base.deb"
"""
FAKE_ID = r"""#!/usr/bin/env bash
# fake id: root for `id -u` (debootstrap needs root), the real answer otherwise
if [ "${1:-}" = -u ]; then echo 0; else exec /usr/bin/id "$@"; fi
"""
FAKE_PYTHON = r"""#!/usr/bin/env bash
# fake python for images.sh: `-m pip download ... -d DIR` writes a wheel-shaped file, the tiny-model
# generator makes its folder, `-c` programs run on the real interpreter.
printf 'python %s\n' "$*" >>"$FAKE_DIR/calls"
if [ "$1" = -m ] && [ "$2" = pip ]; then
  while [ "$#" -gt 0 ]; do
    [ "$1" = -d ] && { mkdir -p "$2"; touch "$2/fake-1.0-py3-none-any.whl"; }
    shift
  done
  exit 0
fi
if [ "$1" = -m ]; then mkdir -p .models/tiny; exit 0; fi
exec __PYTHON__ "$@"
"""


@dataclass
class Machine:
    """A checkout copy and a fake engine that has never built anything."""

    root: Path
    fake: Path
    env: dict[str, str]

    def run(self, *args: str, script: Path | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(script or self.root / "scripts" / "images.sh"), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def calls(self) -> list[str]:
        path = self.fake / "calls"
        return path.read_text().splitlines() if path.exists() else []

    def images(self) -> set[str]:
        return {p.read_text().strip() for p in (self.fake / "images").glob("*.ref")}


@pytest.fixture
def machine(tmp_path: Path) -> Machine:
    root, fake, bin_dir = tmp_path / "kit", tmp_path / "fake", tmp_path / "bin"
    for folder in (
        root / "scripts",
        root / "compose" / "images" / "ca",
        root / "compose" / "images" / "wheels",
        root / "proxy" / "pd_proxy",
        fake / "images",
        bin_dir,
    ):
        folder.mkdir(parents=True)
    shutil.copy2(SCRIPT, root / "scripts" / "images.sh")
    for name in ("compose.yaml", "constraints.txt", "proxy/pyproject.toml"):
        (root / name).write_text(f"# stands in for {name}\n")
    (root / "proxy" / "pd_proxy" / "__init__.py").write_text("")
    docker = FAKE_DOCKER.replace("__IMAGES__", " ".join((*KIT_IMAGES, VLLM_IMAGE)))
    docker = docker.replace("__VLLM__", VLLM_IMAGE).replace("__KIT__", " ".join(KIT_IMAGES))
    write_executable(bin_dir / "docker", docker)
    write_executable(bin_dir / "debootstrap", FAKE_DEBOOTSTRAP)
    write_executable(bin_dir / "id", FAKE_ID)
    write_executable(bin_dir / "python", FAKE_PYTHON.replace("__PYTHON__", sys.executable))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KIT_", "DOCKER_", "COMPOSE_"))}
    env |= {
        "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        "FAKE_DIR": str(fake),
        "PYTHON": str(bin_dir / "python"),
        "KIT_IMAGE_BASE": "local",
        "KIT_DEBIAN_MIRROR": "http://deb.invalid/debian",
    }
    return Machine(root, fake, env)


def test_cold_machine_builds_base_wheels_and_images(machine: Machine) -> None:
    """The path a new machine takes: debootstrap base, wheels, builds, inputs-* tags; exit 0."""
    res = machine.run()
    assert res.returncode == 0, res.stderr
    assert "unbound variable" not in res.stderr, res.stderr
    calls = machine.calls()
    assert any(c.startswith("debootstrap --variant=minbase bookworm ") for c in calls), calls
    assert any(c.startswith("import ") and c.endswith(f" - {BASE}") for c in calls), calls
    # The root tree debootstrap filled is gone once the base image exists.
    tree = Path((machine.fake / "debootstrap-dir").read_text().strip())
    assert not tree.exists(), f"{tree} was left behind"
    images = machine.images()
    assert {BASE, *KIT_IMAGES, VLLM_IMAGE} <= images, images
    tags = {ref.rsplit(":", 1)[1] for ref in images if ref.rsplit(":", 1)[1].startswith("inputs-")}
    assert len(tags) == 1, images  # every kit image marked current for the same inputs
    for wheels in ("proxy", "vllm"):
        assert list((machine.root / "compose/images/wheels" / wheels).glob("*.whl")), wheels
    # Built from the local base, with the wheelhouse instead of an index.
    build = next(c for c in calls if c.startswith("build "))
    assert f"BASE_IMAGE={BASE}" in build and VLLM_IMAGE in build, build


def test_second_run_finds_the_images_current(machine: Machine) -> None:
    assert machine.run().returncode == 0
    (machine.fake / "calls").unlink()
    res = machine.run()
    assert res.returncode == 0, res.stderr
    assert "images up to date" in res.stderr, res.stderr
    builds = ("import", "build", "compose --profile cpu build")
    assert not [c for c in machine.calls() if c.startswith(builds)], machine.calls()


def test_debootstrap_failure_cleans_up_and_says_so(machine: Machine) -> None:
    failing = '#!/usr/bin/env bash\necho "$3" >"$FAKE_DIR/debootstrap-dir"\nmkdir -p "$3"\n'
    failing += "echo 'E: Failed getting release file' >&2\nexit 1\n"
    write_executable(Path(machine.env["PATH"].split(os.pathsep)[0]) / "debootstrap", failing)
    res = machine.run()
    assert res.returncode == 1, res.stderr
    assert "debootstrap failed" in res.stderr and "KIT_DEBIAN_MIRROR" in res.stderr, res.stderr
    assert "unbound variable" not in res.stderr, res.stderr
    assert not Path((machine.fake / "debootstrap-dir").read_text().strip()).exists()
    assert BASE not in machine.images()


def test_sourcing_runs_nothing_and_leaves_no_return_trap(machine: Machine) -> None:
    """Sourcing defines the functions only (no docker call); build_local_base, called from
    another function, leaves no trap behind that fires when that function returns (the old
    RETURN trap did, with its variable unset under `set -u`)."""
    script = machine.root / "scripts" / "images.sh"
    probe = (
        f'source "{script}"\n'
        '[ ! -s "$FAKE_DIR/calls" ] || { echo "sourcing ran: $(cat "$FAKE_DIR/calls")"; exit 3; }\n'
        'cd "$ROOT"; mkdir -p run\n'
        "caller() { build_local_base; echo built; }\n"
        "caller\n"
        'trap -p RETURN | grep -q . && { echo "a RETURN trap is still set"; exit 4; }\n'
        "echo done\n"
    )
    res = subprocess.run(
        ["bash", "-c", probe], env=machine.env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split() == ["built", "done"], res.stdout + res.stderr
    assert BASE in machine.images()


def test_cold_flag_removes_images_cache_and_wheels_first(machine: Machine) -> None:
    assert machine.run().returncode == 0
    before = machine.images()
    assert any(":inputs-" in ref for ref in before), before
    (machine.fake / "calls").unlink()
    res = machine.run("--cold")
    assert res.returncode == 0, res.stderr
    calls = machine.calls()
    removal = next(c for c in calls if c.startswith("image rm "))
    assert set(removal.split()[2:]) == before, (removal, before)
    assert "builder prune --all --force" in calls, calls
    # ... then the new machine's path: the removal first, then debootstrap, downloads, builds.
    first_build = calls.index(next(c for c in calls if c.startswith("import ")))
    assert calls.index(removal) < first_build
    assert sum(c.startswith("python -m pip download") for c in calls) == 2, calls
    assert {BASE, *KIT_IMAGES, VLLM_IMAGE} <= machine.images()


def test_unknown_option_is_refused(machine: Machine) -> None:
    res = machine.run("--colder")
    assert res.returncode == 1
    assert "unknown option '--colder'" in res.stderr
    assert machine.calls() == []


def test_the_inputs_tag_follows_the_proxys_c_source(machine: Machine) -> None:
    """The proxy image compiles pd-proxy's C part: an edit to it (a source, a header, a module)
    is a new inputs-* tag, so the warm path rebuilds instead of keeping an image built from the
    old one; a compiled object in the tree (``make install`` builds it in place) changes
    nothing."""
    cache = machine.root / "proxy" / "pd_proxy" / "routing" / "cache"
    cache.mkdir(parents=True)
    source = cache / "_chain.c"
    source.write_text("/* one */\n")
    probe = f'source "{machine.root}/scripts/images.sh"; cd "$ROOT"; build_inputs_tag local\n'

    def tag() -> str:
        res = subprocess.run(
            ["bash", "-c", probe], env=machine.env, capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 0 and res.stdout.startswith("inputs-"), res.stdout + res.stderr
        return res.stdout.strip()

    first = tag()
    (cache / "_chain.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    assert tag() == first
    source.write_text("/* two */\n")
    second = tag()
    assert second != first
    (cache / "keys.py").write_text("NATIVE = True\n")
    third = tag()
    assert third not in (first, second)
    (cache / "_block_table.h").write_text("/* a header */\n")
    assert tag() not in (first, second, third)
