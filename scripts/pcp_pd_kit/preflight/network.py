"""Address ranges already in use on the host (Docker networks and kernel routes), so PD_SUBNET
can be checked for overlaps before Compose fails with "Pool overlaps with other one on this
address space" or, worse, the containers shadow a route the host needs."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Union

# typing.Union, not `A | B`: this alias is evaluated at run time, and hosts may run Python 3.8.
Net = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]  # noqa: UP007
PROJECT_LABEL = "com.docker.compose.project"
_BRIDGE_OPTION = "com.docker.network.bridge.name"


@dataclass(frozen=True)
class Taken:
    """A range in use: `what` says by whom (a Docker network or a route), `dev` its interface."""

    net: Net
    what: str
    dev: str = ""


def docker_networks(inspect_json: str, project: str) -> tuple[list[Taken], set[str]]:
    """Subnets of `docker network inspect` output, leaving out the kit's own project networks;
    also returns the bridge interfaces of those own networks (their routes are ours too)."""
    taken, own_devs = [], set()
    for net in _json_list(inspect_json):
        labels = net.get("Labels") or {}
        options = net.get("Options") or {}
        dev = options.get(_BRIDGE_OPTION) or ("br-" + str(net.get("Id", ""))[:12])
        if project and labels.get(PROJECT_LABEL) == project:
            own_devs.add(dev)
            continue
        for cfg in (net.get("IPAM") or {}).get("Config") or []:
            parsed = _network((cfg or {}).get("Subnet", ""))
            if parsed is not None:
                taken.append(Taken(parsed, f"Docker network '{net.get('Name', '?')}'", dev))
    return taken, own_devs


def ip_routes(ip_json: str) -> list[Taken]:
    """Routes from `ip -j route`, without the default route (it 'overlaps' everything)."""
    routes = []
    for route in _json_list(ip_json):
        dst = str(route.get("dst", ""))
        parsed = None if dst == "default" else _network(dst)
        if parsed is not None and parsed.prefixlen > 0:
            dev = str(route.get("dev", ""))
            routes.append(Taken(parsed, f"host route on {dev or '?'}", dev))
    return routes


def proc_routes(text: str) -> list[Taken]:
    """Routes from /proc/net/route (hex, little-endian), for hosts without `ip -j`."""
    routes = []
    for line in text.splitlines()[1:]:
        cells = line.split()
        if len(cells) < 8:
            continue
        try:
            dest = ipaddress.IPv4Address(int.from_bytes(bytes.fromhex(cells[1]), "little"))
            mask = ipaddress.IPv4Address(int.from_bytes(bytes.fromhex(cells[7]), "little"))
            parsed = ipaddress.ip_network(f"{dest}/{mask}", strict=False)
        except ValueError:
            continue
        if parsed.prefixlen > 0:
            routes.append(Taken(parsed, f"host route on {cells[0]}", cells[0]))
    return routes


def overlaps(subnet: Net, taken: Iterable[Taken], own_devs: set[str]) -> list[Taken]:
    """Every range that overlaps `subnet`, once per network (a Docker network's own bridge
    route is not listed again), ignoring routes of the kit's own bridges."""
    found: list[Taken] = []
    for item in taken:
        if item.dev in own_devs or item.net.version != subnet.version:
            continue
        if not item.net.overlaps(subnet):
            continue
        if any(f.net == item.net and f.dev == item.dev for f in found):
            continue
        found.append(item)
    return found


def free_alternative(subnet: Net, taken: list[Taken], own_devs: set[str]) -> Net | None:
    """A private range of the same size that overlaps nothing in `taken`, to suggest."""
    if subnet.version != 4:
        return None
    pools = ("172.16.0.0/12", "192.168.0.0/16", "10.0.0.0/8")
    for pool in pools:
        network = ipaddress.IPv4Network(pool)
        if subnet.prefixlen < network.prefixlen:
            continue
        for count, candidate in enumerate(network.subnets(new_prefix=subnet.prefixlen)):
            if count >= 4096:
                break
            if candidate != subnet and not overlaps(candidate, taken, own_devs):
                return candidate
    return None


def _network(text: str) -> Net | None:
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None


def _json_list(text: str) -> list[dict[str, Any]]:
    try:
        data = json.loads(text)
    except ValueError:
        return []
    return [item for item in data if isinstance(item, dict)] if isinstance(data, list) else []
