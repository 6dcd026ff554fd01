"""Live checks against servers that are down or answer garbage: a failed check, no traceback."""

import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pcp_pd_kit.localstack.live import (
    HttpError,
    _scrape_time,
    get_json,
    live_checks,
    post_json,
    scrape,
    settle_prefill,
    wait_for_scrape_after,
)
from pcp_pd_kit.localstack.report import failed
from tests.support.net import free_port


class _NotJson(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        body = b"<html>{not json} # nor metrics</html>\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = _answer
    do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def garbage_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _NotJson)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_non_json_answer_is_an_http_error(garbage_url: str) -> None:
    with pytest.raises(HttpError, match="not JSON") as info:
        get_json(f"{garbage_url}/api/v1/targets")
    assert info.value.status == 200 and "<html>" in info.value.body
    with pytest.raises(HttpError, match="not JSON"):
        post_json(f"{garbage_url}/v1/completions", {"prompt": "x"}, timeout_s=10)


def test_non_metrics_page_is_an_http_error(garbage_url: str) -> None:
    with pytest.raises(HttpError, match="not Prometheus text"):
        scrape(garbage_url)


def test_settle_and_scrape_waits_give_up_with_a_warning_not_an_exception(
    garbage_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger="pcp_pd_kit.localstack"):
        assert settle_prefill(closed, timeout_s=1) is None
        assert wait_for_scrape_after(garbage_url, "prefill", 0.0, timeout_s=1) is False
    assert "prefill had not settled after 1s" in caplog.text
    assert "Prometheus did not scrape prefill" in caplog.text


@pytest.mark.parametrize(
    ("stamp", "epoch"),
    [
        ("2026-12-01T03:50:00Z", 1796097000.0),
        ("2026-12-01T03:50:00.123456789Z", 1796097000.123456),
        ("2026-12-01T04:50:00.5+01:00", 1796097000.5),
    ],
)
def test_prometheus_scrape_times_parse(stamp: str, epoch: float) -> None:
    assert _scrape_time(stamp) == pytest.approx(epoch, abs=1e-6)


def test_live_checks_report_which_part_failed(garbage_url: str) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    urls = {"proxy": garbage_url, "decode": closed, "prometheus": garbage_url}
    checks = live_checks({**urls, "prefill": closed}, pcp=2, settle_timeout_s=1)
    names = [c.name for c in failed(checks)]
    assert names[:3] == [
        "proxy served requests",
        "decode metrics readable",
        "every Prometheus target up",
    ]
    assert "not JSON" in next(c for c in checks if c.name == "every Prometheus target up").detail
    assert all(not c.ok for c in checks)
