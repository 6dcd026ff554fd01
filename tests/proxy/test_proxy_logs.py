"""The request log's fast formatter must print exactly what the stdlib formatter would."""

from __future__ import annotations

import logging
import sys

from pd_proxy.logs import FORMAT, FastFormatter


def _record(exc_info=None) -> logging.LogRecord:
    return logging.LogRecord(
        "pd_proxy.request", logging.INFO, __file__, 1, "rid=%s status=%d", ("ab12", 200), exc_info
    )


def test_fast_formatter_matches_the_stdlib_format():
    fast, std = FastFormatter(), logging.Formatter(FORMAT)
    for _ in range(2):  # the second call takes the cached-second path
        record = _record()
        assert fast.format(record) == std.format(record)


def test_fast_formatter_keeps_tracebacks():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = _record(sys.exc_info())
    text = FastFormatter().format(record)
    assert "Traceback" in text and "RuntimeError: boom" in text
