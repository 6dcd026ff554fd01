"""Logging setup: one line per request without one write syscall per line.

At a thousand requests a second a flushed-per-record handler costs a ``write`` (and a ``getpid``)
per request; lines are instead buffered and flushed every ``FLUSH_INTERVAL_S`` seconds, and at once
for warnings and errors, so problems still show up immediately.

With ``--workers`` several processes share one stderr: each then tags its lines (``[worker 2 pid
1234]``) and writes only whole lines, at most ``PIPE_BUF`` bytes at a time, so lines of different
processes never interleave.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import select
import sys
import time

FLUSH_INTERVAL_S = 0.5
FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# Writes up to this size to a pipe are atomic (POSIX); Linux's is 4096.
PIPE_BUF = getattr(select, "PIPE_BUF", 512)


class FastFormatter(logging.Formatter):
    """``FORMAT`` without a ``strftime`` per record: the seconds part is cached per second.

    ``tag`` goes between the logger name and the message, e.g. ``[worker 2 pid 1234] ``.
    """

    def __init__(self, tag: str = "") -> None:
        super().__init__(FORMAT.replace("%(message)s", tag.replace("%", "%%") + "%(message)s"))
        self._tag = tag
        self._second = -1
        self._stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info or record.stack_info:  # rare: let the stdlib render tracebacks
            return super().format(record)
        second = int(record.created)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", self.converter(record.created))
        return (
            f"{self._stamp},{int(record.msecs):03d} {record.levelname} {record.name} "
            f"{self._tag}{record.getMessage()}"
        )


class BufferedHandler(logging.StreamHandler):
    """A stream handler whose per-record flush only happens for WARNING and above."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stream.write(self.format(record) + self.terminator)
            if record.levelno >= logging.WARNING:
                self.stream.flush()
        except Exception:  # logging must never break a request
            self.handleError(record)

    def flush(self) -> None:
        self.acquire()
        try:
            self.stream.flush()
        except (OSError, ValueError):
            pass
        finally:
            self.release()


class LineHandler(logging.Handler):
    """Buffered like ``BufferedHandler``, for a stderr that several processes share.

    Lines are kept whole and written in pieces of at most ``PIPE_BUF`` bytes, each a run of whole
    lines, so no line is ever split between two writes (a pipe never interleaves such a write with
    another process's).
    """

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd
        self._lines: list[bytes] = []
        self._size = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = (self.format(record) + "\n").encode("utf-8", "replace")
            self._lines.append(line)
            self._size += len(line)
            if record.levelno >= logging.WARNING or self._size >= PIPE_BUF:
                self._write_out()
        except Exception:  # logging must never break a request
            self.handleError(record)

    def flush(self) -> None:
        self.acquire()
        try:
            self._write_out()
        finally:
            self.release()

    def _write_out(self) -> None:
        piece: list[bytes] = []
        size = 0
        for line in self._lines:
            if piece and size + len(line) > PIPE_BUF:
                self._write(b"".join(piece))
                piece, size = [], 0
            piece.append(line)
            size += len(line)
        if piece:
            self._write(b"".join(piece))
        self._lines.clear()
        self._size = 0

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._fd, view) :]
            except OSError:  # stderr closed or non-blocking and full: drop, never raise
                return


def setup_logging(level: int, tag: str | None = None) -> logging.Handler:
    """Root logging to stderr through a buffer; returns the handler for periodic flushes.

    ``tag`` (several processes on one stderr) prefixes each message and keeps lines whole.
    """
    logging.logProcesses = False  # each would cost a getpid() syscall per record
    logging.logThreads = False
    logging.logMultiprocessing = False
    logging._srcfile = None  # no stack walk per record to find the caller (the HOWTO's tip)
    handler: logging.Handler
    if tag is not None:
        sys.stderr.flush()
        handler = LineHandler(sys.stderr.fileno())
        handler.setFormatter(FastFormatter(tag))
    else:
        raw = open(sys.stderr.fileno(), "wb", buffering=0, closefd=False)
        stream = io.TextIOWrapper(
            io.BufferedWriter(raw, 1 << 16), encoding="utf-8", errors="replace"
        )
        handler = BufferedHandler(stream)
        handler.setFormatter(FastFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return handler


async def flush_periodically(handler: logging.Handler, interval: float = FLUSH_INTERVAL_S) -> None:
    """Flush buffered log lines every ``interval`` seconds until cancelled (then once more)."""
    try:
        while True:
            await asyncio.sleep(interval)
            handler.flush()
    finally:
        handler.flush()
