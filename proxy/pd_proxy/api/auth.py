"""API keys read from files: the clients' keys the proxy accepts, and the key it sends to vLLM.

Keys live in files, never on the command line (where ``ps`` would show them). A key file holds one
key per line; blank lines and lines starting with ``#`` are ignored. After a client key, optional
fields name its admission flow and share: ``sk-team-a flow=team-a weight=2 priority=0`` (a key
without ``flow=`` is its own flow, named by a short digest of the key, never the key).

Both kinds of file are re-read when their stat signature (inode, size, mtime, ctime) changes,
checked at most once per ``RELOAD_INTERVAL_S`` on the request path, so keys rotate without a
restart. A file that goes
missing, unreadable or empty keeps the last good keys and logs one error per change.

Client keys are checked by SHA-256 digest: a dict lookup finds the candidate, then
``hmac.compare_digest`` confirms it, so neither step's timing depends on how much of a secret key
the client guessed right.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from pd_proxy.config.key_files import KeyEntry, KeyFile
from pd_proxy.protocol.errors import unauthorized_response

if TYPE_CHECKING:
    from pd_proxy.metrics import ProxyMetrics

log = logging.getLogger("pd_proxy.api.auth")
request_log = logging.getLogger("pd_proxy.request")

RELOAD_INTERVAL_S = 1.0
MISSING_KEY = "missing API key: send the header 'Authorization: Bearer <key>'"
INVALID_KEY = "invalid API key"


def _digest(key: str) -> bytes:
    # surrogateescape: aiohttp decodes header bytes that are not UTF-8 that way.
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


@dataclass(frozen=True)
class Client:
    """Who a client key belongs to, for admission: its flow's name, weight and band."""

    flow: str
    weight: float = 1.0
    priority: int = 0


ANONYMOUS = Client("default")  # every request of a proxy without client keys


class ClientKeys(KeyFile):
    """Keys clients must present as ``Authorization: Bearer <key>``."""

    what = "client API key"

    def _use(self, keys: tuple[KeyEntry, ...]) -> None:
        # Digest -> (digest, client): the lookup finds a candidate, compare_digest confirms it.
        self._digests: dict[bytes, tuple[bytes, Client]] = {}
        for entry in keys:
            digest = _digest(entry.key)
            flow = entry.flow or f"key-{digest.hex()[:8]}"
            self._digests[digest] = (digest, Client(flow, entry.weight, entry.priority))

    def check(self, authorization: str | None) -> str | None:
        """``None`` when the header carries a valid key, else the message for the 401."""
        found = self.identify(authorization)
        return found if isinstance(found, str) else None

    def identify(self, authorization: str | None) -> Client | str:
        """The client a valid key names, else the message for the 401."""
        self.refresh()
        if not authorization:
            return MISSING_KEY
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if not token or scheme.lower() != "bearer":
            return MISSING_KEY
        digest = _digest(token)
        stored = self._digests.get(digest)
        if stored is None or not hmac.compare_digest(stored[0], digest):
            return INVALID_KEY
        return stored[1]


def unauthorized(
    request: web.Request, problem: str, metrics: ProxyMetrics, endpoint: str | None
) -> web.Response:
    """A bad or missing client key: a 401, counted (for an endpoint the metrics name) and logged
    in the request log, and no backend touched."""
    if endpoint is not None:
        metrics.count_request(endpoint, 401)
    if request_log.isEnabledFor(logging.INFO):
        request_log.info(
            "rid=- %s %s status=401 from=%s: %s",
            request.method,
            request.path,
            request.remote,
            problem,
        )
    return unauthorized_response(problem)
