"""The little of the Kubernetes API the proxy needs: in-cluster credentials, LIST and WATCH.

Only what pd_proxy.discovery.k8s_service uses, on aiohttp (already a dependency) instead of a
Kubernetes
client library: the in-cluster address (``KUBERNETES_SERVICE_HOST`` / ``_PORT``), the pod's
ServiceAccount token, CA bundle and namespace (``/var/run/secrets/kubernetes.io/serviceaccount``),
a JSON ``GET`` for lists and the watch protocol (one JSON event per line of a chunked response).

The token file is re-read for every request: the kubelet rotates bound ServiceAccount tokens
(about hourly) and an old one is refused.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# Bounds one watch event's JSON line (an EndpointSlice holds at most 1000 endpoints).
MAX_EVENT_BYTES = 16 * 1024 * 1024


class KubeConfigError(ValueError):
    """Not inside a pod (no API address or credentials): the message says what is missing."""


class KubeApiError(Exception):
    """The API server answered with an error status; ``status`` is its HTTP code (410: Gone)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class InCluster:
    """Where the API server is and how this pod authenticates to it."""

    base_url: str
    token_file: Path | None
    ca_file: Path | None
    namespace: str | None

    @classmethod
    def from_environment(
        cls, environ: Mapping[str, str] | None = None, sa_dir: Path | None = None
    ) -> InCluster:
        """The pod's own view: the variables the kubelet sets and the mounted ServiceAccount."""
        environ = os.environ if environ is None else environ
        sa_dir = SERVICE_ACCOUNT_DIR if sa_dir is None else sa_dir
        host = environ.get("KUBERNETES_SERVICE_HOST", "").strip()
        port = environ.get("KUBERNETES_SERVICE_PORT", "").strip()
        if not host or not port:
            raise KubeConfigError(
                "KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are not set: not running in a pod"
            )
        host = f"[{host}]" if ":" in host else host
        token, ca, ns = sa_dir / "token", sa_dir / "ca.crt", sa_dir / "namespace"
        if not token.is_file():
            raise KubeConfigError(
                f"no ServiceAccount token at {token} (automountServiceAccountToken is off?)"
            )
        namespace = ns.read_text().strip() if ns.is_file() else None
        return cls(f"https://{host}:{port}", token, ca if ca.is_file() else None, namespace or None)

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.token_file is not None:
            headers["Authorization"] = f"Bearer {self.token_file.read_text().strip()}"
        return headers

    def ssl_context(self) -> ssl.SSLContext | bool:
        """The cluster's CA for an https API address; True (the system's CAs) otherwise."""
        if not self.base_url.startswith("https:") or self.ca_file is None:
            return True
        return ssl.create_default_context(cafile=str(self.ca_file))


def _status_message(body: bytes, status: int) -> str:
    """The ``message`` of a ``Status`` object, else the start of the body."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and doc.get("message"):
        return f"{status} {doc.get('reason') or ''}: {doc['message']}".replace(" :", ":")
    return f"{status}: {body[:200].decode(errors='replace')}"


class KubeClient:
    """LIST and WATCH over one aiohttp session (owned by the caller)."""

    def __init__(self, cluster: InCluster, session: aiohttp.ClientSession) -> None:
        self.cluster = cluster
        self.session = session
        self._ssl = cluster.ssl_context()

    def _url(self, path: str) -> str:
        return self.cluster.base_url.rstrip("/") + path

    async def list(self, path: str, params: Mapping[str, str], timeout: float) -> dict[str, Any]:
        """``GET path`` as JSON; ``KubeApiError`` on any status but 200."""
        async with self.session.get(
            self._url(path),
            params=dict(params),
            headers=self.cluster.headers(),
            ssl=self._ssl,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise KubeApiError(_status_message(body, resp.status), resp.status)
        doc = json.loads(body)
        if not isinstance(doc, dict):
            raise KubeApiError("the API server's list is not a JSON object")
        return doc

    async def watch(
        self, path: str, params: Mapping[str, str], idle_timeout: float
    ) -> AsyncIterator[dict[str, Any]]:
        """The events of ``GET path?watch=1``, each ``{"type": ..., "object": ...}``, until the
        server ends the stream; ``idle_timeout`` bounds the silence between two reads."""
        async with self.session.get(
            self._url(path),
            params={**params, "watch": "1"},
            headers=self.cluster.headers(),
            ssl=self._ssl,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=idle_timeout),
        ) as resp:
            if resp.status != 200:
                raise KubeApiError(_status_message(await resp.read(), resp.status), resp.status)
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                if len(buffer) > MAX_EVENT_BYTES:
                    raise KubeApiError(f"a watch event is larger than {MAX_EVENT_BYTES} bytes")
                for line in lines:
                    if line.strip():
                        yield _event(line)
            if buffer.strip():
                yield _event(buffer)


def _event(line: bytes) -> dict[str, Any]:
    event = json.loads(line)
    if not isinstance(event, dict) or "type" not in event or "object" not in event:
        raise KubeApiError(f"not a watch event: {line[:200]!r}")
    return event
