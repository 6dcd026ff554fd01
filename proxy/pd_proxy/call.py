"""One client call as the flow carries it after parsing: the ``Call`` every stage reads, and the
header fields both legs add.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pd_proxy.http.upstream import Fields
from pd_proxy.protocol.endpoints import Endpoint

if TYPE_CHECKING:
    from aiohttp import web

    from pd_proxy.config.key_files import BackendKey


@dataclass(frozen=True, slots=True, eq=False)
class Call:
    """One client request as the pipeline parsed it: what every stage after parsing reads.

    ``body`` is the client's bytes, ``client_body`` their JSON object, ``headers`` the fields both
    legs add (``backend_fields``).
    """

    request: web.Request
    endpoint: Endpoint
    body: bytes
    client_body: dict[str, Any]
    headers: Fields


def backend_fields(rid: str, key: BackendKey | None) -> Fields:
    """The header fields both legs add, encoded once: the client's Authorization is never
    forwarded (its key is for the proxy only), the backend key is sent instead."""
    if key is None:
        return Fields.of({"X-Request-Id": rid})
    return Fields.of({"X-Request-Id": rid, "Authorization": key.header()})
