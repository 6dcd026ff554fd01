"""Minimal stdlib HTTP helpers: the launcher must not need an event loop or extra packages."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class HttpError(RuntimeError):
    """A request that failed; carries the status (None when nothing answered) and the body."""

    def __init__(self, url: str, status: int | None, body: str) -> None:
        super().__init__(f"{url}: {status if status is not None else 'no answer'}: {body[:500]}")
        self.url = url
        self.status = status
        self.body = body


def _fetch(request: urllib.request.Request | str, timeout_s: float) -> tuple[int, str]:
    """Status and body text; every way of failing becomes an HttpError."""
    url = request if isinstance(request, str) else request.full_url
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        raise HttpError(url, exc.code, exc.read().decode(errors="replace")) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise HttpError(url, None, str(exc)) from None


def get_text(url: str, timeout_s: float = 10.0) -> str:
    return _fetch(url, timeout_s)[1]


def _decode_json(url: str, status: int | None, text: str) -> Any:
    """json.loads, with a body that is not JSON raised as HttpError like any other bad answer."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise HttpError(url, status, f"not JSON ({exc}): {text}") from None


def get_json(url: str, params: dict[str, str] | None = None, timeout_s: float = 10.0) -> Any:
    if params:
        url = f"{url}?{urllib.parse.urlencode(params)}"
    return _decode_json(url, *_fetch(url, timeout_s))


def post_json(url: str, payload: dict[str, Any], timeout_s: float = 300.0) -> Any:
    request = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    return _decode_json(url, *_fetch(request, timeout_s))
