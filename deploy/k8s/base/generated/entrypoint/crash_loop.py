"""The bound on crash loops (docs/gpu.md, "Restarts").

The services run under `restart: unless-stopped`, so the engine starts them again after its own
restart or a reboot and leaves alone what was stopped by hand. Docker bounds nothing under that
policy, so the bound is here: each unasked exit is counted in the container's own filesystem
(CRASH_FILE), and after CRASH_LIMIT in a row the entrypoint stays up without starting vLLM
(unhealthy, saying why) instead of looping.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

from .console import log

# The crash-loop bound: unasked exits in a row, kept in the container's writable layer (so it
# lives as long as the container: a restart keeps it, `up --force-recreate` starts afresh). A run
# that lasted CRASH_RESET_S counts as the first of a new series; a stop asked for clears it.
CRASH_FILE = Path("/var/tmp/pcp-pd-kit/crashes.json")
CRASH_FILE_ENV = "KIT_CRASH_FILE"  # another place for the record (tests, a read-only root)
CRASH_LIMIT = 3
CRASH_RESET_S = 600.0


def next_crash_count(previous: int, crashed: bool, ran_s: float) -> int:
    """Unasked exits in a row after a run of ``ran_s`` seconds: a stop asked for clears the
    series, a crash after a long run starts a new one."""
    if not crashed:
        return 0
    return 1 if ran_s >= CRASH_RESET_S else previous + 1


def read_crashes(path: Path) -> tuple[int, str]:
    """The recorded series (count, last reason); (0, "") when absent or unreadable."""
    try:
        doc = json.loads(path.read_text())
        return int(doc["count"]), str(doc.get("last", ""))
    except (OSError, ValueError, KeyError, TypeError):
        return 0, ""


def write_crashes(path: Path, count: int, last: str) -> None:
    """Record the series; a container whose filesystem is read-only just has no bound here."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"count": count, "last": last}))
    except OSError as exc:
        log(f"cannot record crashes in {path} ({exc})")


def record_exit(path: Path, crashed: bool, ran_s: float, reason: str) -> int:
    count = next_crash_count(read_crashes(path)[0], crashed, ran_s)
    write_crashes(path, count, reason if crashed else "")
    return count


def hold_after_crash_loop(path: Path, count: int, last: str) -> int:
    """CRASH_LIMIT unasked exits in a row: stay up without vLLM (a container that exits would
    be started again at once under `unless-stopped`) until stopped; a stop clears the series,
    so `docker compose restart <service>` or a reboot gives it new tries."""
    stops = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # held for sigwait: none can slip past
    log(
        f"{count} unasked exits in a row (last: {last or 'unknown'}): not starting vLLM again, "
        "so the crash loop stops here. Fix the cause (docker compose logs), then "
        "`docker compose restart` this service (a stop clears the count)"
    )
    signal.sigwait(stops)
    write_crashes(path, 0, "")
    return 0
