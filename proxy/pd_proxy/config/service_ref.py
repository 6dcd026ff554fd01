"""A Kubernetes Service named on the command line, ``[NAMESPACE/]SERVICE[:PORT]``, parsed once:
a configuration value (pd_proxy.discovery.k8s_service watches it)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_DNS1035 = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_PORT_NAME = re.compile(r"(?=.*[a-z])[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?")


@dataclass(frozen=True)
class ServiceRef:
    """``[NAMESPACE/]SERVICE[:PORT]``: PORT is the Service port's name or the endpoint port."""

    name: str
    namespace: str | None = None
    port: str | int | None = None

    def __str__(self) -> str:
        text = f"{self.namespace}/{self.name}" if self.namespace else self.name
        return text if self.port is None else f"{text}:{self.port}"


def parse_service_ref(value: str) -> ServiceRef:
    """``ValueError`` naming what is wrong with ``value``."""
    text = value.strip()
    rest, _, port_text = text.partition(":")
    namespace, _, name = rest.rpartition("/")
    if not _DNS1035.fullmatch(name):
        raise ValueError(f"{name!r} is not a Service name (lowercase DNS-1035 label)")
    if namespace and not _DNS1123.fullmatch(namespace):
        raise ValueError(f"{namespace!r} is not a namespace name")
    port: str | int | None = None
    if port_text:
        if port_text.isdigit() and 1 <= int(port_text) <= 65535:
            port = int(port_text)
        elif _PORT_NAME.fullmatch(port_text):
            port = port_text
        else:
            raise ValueError(f"port {port_text!r} is neither 1-65535 nor a port name")
    elif ":" in text:
        raise ValueError("empty port after ':'")
    return ServiceRef(name, namespace or None, port)
