"""What every discovery source shares (DNS names, the endpoints file, Kubernetes Services): the
error one poll raises and the one spelling of a discovered address as a backend URL.

A leaf module, so that pd_proxy.discovery.watch and the sources it drives
(pd_proxy.discovery.k8s_service) need
not import each other.
"""

from __future__ import annotations


class DiscoveryError(Exception):
    """One poll found nothing usable; the message says why, for the warning."""


def address_url(address: str, port: int) -> str | None:
    """``http://ADDR:PORT`` (IPv6 in brackets); None for a scoped IPv6 address URLs cannot hold."""
    if "%" in address:
        return None
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"
