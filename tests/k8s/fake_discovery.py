"""An API server that only knows which kinds exist, for `kubectl apply -k --dry-run=client`.

Client-side dry run still asks the server two things: API discovery (which group/version serves
each kind, so kubectl can map kinds to REST paths) and, per object, a GET to see whether it exists
(404 here: every object would be created). Schema validation is what kubectl would download as
OpenAPI; it is off in the apply test (`--validate=false`) and done offline by kubernetes-validate
in test_k8s_render. So a passing apply shows: the overlay builds with kustomize's default load
restrictions, every kind maps to a resource of Kubernetes 1.32 or of the CRDs the components
need, and kubectl's apply logic accepts every object.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# (group, version) -> [(plural, Kind, namespaced)]: the built-in kinds the renders use, as
# Kubernetes 1.32 serves them, and the CRDs of the optional components.
BUILTIN: dict[tuple[str, str], list[tuple[str, str, bool]]] = {
    ("", "v1"): [
        ("configmaps", "ConfigMap", True),
        ("services", "Service", True),
        ("serviceaccounts", "ServiceAccount", True),
        ("secrets", "Secret", True),
        ("namespaces", "Namespace", False),
    ],
    ("apps", "v1"): [("deployments", "Deployment", True)],
    ("rbac.authorization.k8s.io", "v1"): [
        ("roles", "Role", True),
        ("rolebindings", "RoleBinding", True),
    ],
    ("networking.k8s.io", "v1"): [("networkpolicies", "NetworkPolicy", True)],
    ("discovery.k8s.io", "v1"): [("endpointslices", "EndpointSlice", True)],
}
CRDS: dict[tuple[str, str], list[tuple[str, str, bool]]] = {
    ("monitoring.coreos.com", "v1"): [("podmonitors", "PodMonitor", True)],
    ("leaderworkerset.x-k8s.io", "v1"): [("leaderworkersets", "LeaderWorkerSet", True)],
}


def _resource_list(group: str, version: str, kinds: list[tuple[str, str, bool]]) -> dict:
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": [
            {
                "name": plural,
                "singularName": kind.lower(),
                "namespaced": namespaced,
                "kind": kind,
                "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
            }
            for plural, kind, namespaced in kinds
        ],
    }


class _Handler(BaseHTTPRequestHandler):
    served: dict[tuple[str, str], list[tuple[str, str, bool]]] = {}
    gets: list[str] = []

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # http.server calls it by this name
        path = self.path.split("?", 1)[0].rstrip("/")
        parts = path.strip("/").split("/")
        if path == "/version":
            return self._send(200, {"major": "1", "minor": "32", "gitVersion": "v1.32.0"})
        if path == "/api":
            return self._send(200, {"kind": "APIVersions", "versions": ["v1"]})
        if path == "/apis":
            groups = sorted({g for g, _ in self.served if g})
            return self._send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {
                    "name": g,
                    "versions": [{"groupVersion": f"{g}/{v}", "version": v}
                                 for gg, v in self.served if gg == g],
                    "preferredVersion": {
                        "groupVersion": f"{g}/{next(v for gg, v in self.served if gg == g)}",
                        "version": next(v for gg, v in self.served if gg == g),
                    },
                }
                for g in groups
            ]})  # fmt: skip
        key = ("", parts[1]) if parts[0] == "api" and len(parts) == 2 else None
        if parts[0] == "apis" and len(parts) == 3:
            key = (parts[1], parts[2])
        if key in self.served:
            return self._send(200, _resource_list(*key, self.served[key]))
        self.gets.append(path)
        return self._send(404, {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": f"{path} not found", "reason": "NotFound", "code": 404,
        })  # fmt: skip


@contextmanager
def discovery_server(with_crds: bool = True) -> Iterator[tuple[str, list[str]]]:
    """(server URL, paths of the object GETs it answered 404)."""
    served = {**BUILTIN, **(CRDS if with_crds else {})}
    handler = type("Handler", (_Handler,), {"served": served, "gets": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.gets
    finally:
        server.shutdown()
        server.server_close()
