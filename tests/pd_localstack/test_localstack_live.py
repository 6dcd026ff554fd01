"""Live checks against servers that are down or answer garbage: a failed check, no traceback."""

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from pd_localstack.http_client import HttpError, get_json, post_json
from pd_localstack.live import live_checks, scrape, wait_for_scrape
from pd_localstack.paths import repo_root
from pd_localstack.report import failed

PORT_RANGE = range(18700, 18800)


def _free_port(skip: tuple[int, ...] = ()) -> int:
    for port in PORT_RANGE:
        if port in skip:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip("no free port in 18700-18799")


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
    server = ThreadingHTTPServer(("127.0.0.1", _free_port()), _NotJson)
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


def test_wait_for_scrape_returns_when_decode_is_down(garbage_url: str) -> None:
    closed = _free_port()
    wait_for_scrape(garbage_url, f"http://127.0.0.1:{closed}", timeout_s=600)  # no raise, no wait


def test_live_checks_report_which_part_failed(garbage_url: str) -> None:
    closed = f"http://127.0.0.1:{_free_port()}"
    urls = {"proxy": garbage_url, "decode": closed, "prometheus": garbage_url}
    checks = live_checks(urls, repo_root())
    names = [c.name for c in failed(checks)]
    assert names[:3] == [
        "proxy served requests",
        "decode metrics readable",
        "every Prometheus target up",
    ]
    assert "not JSON" in next(c for c in checks if c.name == "every Prometheus target up").detail
    assert all(not c.ok for c in checks)
