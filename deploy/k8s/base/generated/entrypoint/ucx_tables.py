"""UCX's protocol-selection tables (UCX_PROTO_INFO=y), read line by line as UCX prints them.

Why: with UCX_PROTO_INFO=y UCX prints one table per protocol selection to stdout; the "remote
memory read by ucp_get*" table between two agents is the KV pull, and its transports say whether
the pull is CUDA IPC or TCP. The entrypoint reads them from vLLM's output as it runs
(transport.py) and from the NIXL read probe's at start (transport_check.py). Standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

_TRANSPORT = re.compile(r"([a-z][a-z0-9_]*)/[^\s,|]+")


@dataclass
class Selection:
    """One UCX protocol-selection table: its title lines and its (range, description, config)
    rows."""

    title: list[str] = field(default_factory=list)
    rows: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def heading(self) -> str:
        return " / ".join(self.title)

    def is_remote_read(self) -> bool:
        """A GET between two agents (the KV pull), not an agent reading itself (`self cfg`)."""
        text = self.heading
        return "remote memory read" in text and ("intra-node" in text or "inter-node" in text)

    def transports(self) -> set[str]:
        return {m.group(1) for _, _, config in self.rows for m in _TRANSPORT.finditer(config)}

    def problem_on_gpu(self) -> str | None:
        """Why this KV pull is wrong on a GPU host, or None."""
        if "into host memory" in self.heading or "from host memory" in self.heading:
            return "UCX sees the KV memory as host memory (a UCX build without its CUDA module?)"
        names = self.transports()
        if names and names <= {"tcp"}:
            how = ", ".join(sorted({desc for _, desc, _ in self.rows}))
            return f"the KV pull runs over TCP only ({how})"
        return None

    def summary(self) -> str:
        rows = "; ".join(f"{r} {d} {c}" for r, d, c in self.rows)
        return f"{self.heading}: {rows}"


def _cells(line: str) -> list[str] | None:
    """The cells of a table row (the log prefix before the first '|' dropped), None otherwise."""
    start = line.find("|")
    if start < 0 or not line.rstrip().endswith("|"):
        return None
    return [c.strip() for c in line.rstrip()[start + 1 : -1].split("|")]


class ProtoScanner:
    """Feed UCX's output line by line; finished selection tables come out of feed()."""

    def __init__(self) -> None:
        self.current: Selection | None = None

    def feed(self, line: str) -> Iterator[Selection]:
        cells = _cells(line)
        if cells is None:
            # The table ends at its bottom border (a border after rows) or at any other line:
            # the pull's table can be the last thing UCX prints for a while.
            border = "+--" in line
            if self.current is not None and (not border or self.current.rows):
                yield from self._close()
            return
        if len(cells) == 1:  # a title line: a new table starts after a finished one
            if self.current is not None and self.current.rows:
                yield from self._close()
            if self.current is None:
                self.current = Selection()
            self.current.title.append(cells[0])
        elif len(cells) >= 3 and self.current is not None:
            if cells[:3] != ["Range", "Description", "Config"]:
                self.current.rows.append((cells[0], cells[1], " ".join(cells[2:])))

    def close(self) -> Iterator[Selection]:
        yield from self._close()

    def _close(self) -> Iterator[Selection]:
        done, self.current = self.current, None
        if done is not None and done.rows:
            yield done
