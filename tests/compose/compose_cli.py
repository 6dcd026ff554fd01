"""The pinned Compose binary as the compose tests' oracle.

`docker compose config` renders compose.yaml the way `docker compose up` reads it (interpolation,
YAML merges, profiles, long-form volumes/ports/secrets, schema validation) and needs no daemon.
Every call is hermetic: an explicit --env-file (so the developer's own .env is never read) and an
environment without COMPOSE_* or any of the kit's knobs.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import COMPOSE_FILE, DEBUG_PORTS_FILE, ENV_EXAMPLE, REPO

BARE = Path(os.devnull)  # --env-file for "no .env at all": every ${VAR:-default} applies
TIMEOUT_S = 60
INSTALL_HINT = "scripts/docker_engine.sh ensure installs the pinned Compose v2 plugin"

_ENV_KEY = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=", re.MULTILINE)
# `$$` (an escaped dollar), `${NAME...}` or `$NAME`; group 1/2 hold the name.
_REFERENCE = re.compile(r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)|([A-Za-z_][A-Za-z0-9_]*))")


@functools.cache
def compose_argv() -> tuple[str, ...]:
    """`docker compose`, after checking that it runs; a clear failure when it is missing."""
    docker = shutil.which("docker")
    if docker is None:
        pytest.fail(f"the docker CLI is not installed: {INSTALL_HINT} and Docker itself")
    try:
        res = subprocess.run(
            [docker, "compose", "version"], capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"`docker compose version` did not answer in {TIMEOUT_S} s")
    if res.returncode != 0 or "Docker Compose version v2" not in res.stdout:
        pytest.fail(f"`docker compose` (v2) is not available: {INSTALL_HINT}\n{res.stderr}")
    return (docker, "compose")


def variable_names(text: str) -> set[str]:
    """Names a compose file interpolates (comment lines skipped, `$$` is a literal dollar)."""
    body = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    return {m.group(1) or m.group(2) for m in _REFERENCE.finditer(body) if m.group(0) != "$$"}


@functools.cache
def knob_names() -> frozenset[str]:
    names = set(_ENV_KEY.findall(ENV_EXAMPLE.read_text(encoding="utf-8")))
    for path in (COMPOSE_FILE, DEBUG_PORTS_FILE):
        names |= variable_names(path.read_text(encoding="utf-8"))
    return frozenset(names)


def clean_environment() -> dict[str, str]:
    """os.environ without COMPOSE_* and without any variable the kit's compose files read."""
    knobs = knob_names()
    return {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_") and k not in knobs}


def run(
    *args: str,
    env_file: Path = ENV_EXAMPLE,
    files: Sequence[Path] = (COMPOSE_FILE,),
    profiles: Iterable[str] = (),
    project_dir: Path = REPO,
) -> subprocess.CompletedProcess[str]:
    """`docker compose -f ... --env-file F [--profile P]... ARGS`, hermetic, with a timeout."""
    argv = list(compose_argv())
    for path in files:
        argv += ["-f", str(path)]
    argv += ["--project-directory", str(project_dir), "--env-file", str(env_file)]
    for profile in profiles:
        argv += ["--profile", profile]
    argv += args
    try:
        env = clean_environment()
        return subprocess.run(
            argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(argv)} did not finish in {TIMEOUT_S} s")


def _ok(res: subprocess.CompletedProcess[str]) -> str:
    if res.returncode != 0:
        pytest.fail(f"{' '.join(res.args)} exited {res.returncode}:\n{res.stderr}")
    return res.stdout


def config(**kwargs: Any) -> dict[str, Any]:
    """The rendered model (`config --format json`); kwargs as for run()."""
    return json.loads(_ok(run("config", "--format", "json", **kwargs)))


def services(**kwargs: Any) -> set[str]:
    """The services the given profiles enable (`config --services`)."""
    return set(_ok(run("config", "--services", **kwargs)).split())


def variables(**kwargs: Any) -> dict[str, dict[str, Any]]:
    """`config --variables`: name -> {DefaultValue, Required, ...} (one default per name)."""
    return json.loads(_ok(run("config", "--variables", "--format", "json", **kwargs)))


def env_file(directory: Path, overrides: Mapping[str, str], base: Path = ENV_EXAMPLE) -> Path:
    """A copy of ``base`` with ``overrides`` replacing (or appended after) its lines."""
    if any("'" in value for value in overrides.values()):
        raise ValueError("override values may not contain single quotes")
    pending = dict(overrides)
    lines = []
    for line in base.read_text(encoding="utf-8").splitlines():
        match = _ENV_KEY.match(line)
        if match and match.group(1) in pending:
            key = match.group(1)
            line = f"{key}='{pending.pop(key)}'"  # single quotes: literal, as Compose reads them
        lines.append(line)
    lines += [f"{key}='{value}'" for key, value in pending.items()]
    path = directory / f"env-{len(list(directory.glob('env-*')))}"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def edited_copy(directory: Path, replacements: Sequence[tuple[str, str]], source: Path) -> Path:
    """A copy of a compose file with text replaced (each ``old`` must occur), for tests that show
    a check failing; run it with project_dir=REPO so its relative paths still resolve."""
    text = source.read_text(encoding="utf-8")
    for old, new in replacements:
        assert old in text, f"{old!r} not in {source.name}: update this test's edit"
        text = text.replace(old, new)
    path = directory / f"edited-{len(list(directory.glob('edited-*')))}-{source.name}"
    path.write_text(text, encoding="utf-8")
    return path
