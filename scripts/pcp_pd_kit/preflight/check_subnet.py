"""PD_SUBNET against the address ranges already in use: other Docker networks (not the kit's
own, which `up` reuses) and host routes. An overlap makes `up` fail or shadows a route."""

from __future__ import annotations

import shutil
from pathlib import Path

from pcp_pd_kit.preflight import network, proc
from pcp_pd_kit.preflight.context import QUICK_S, Context
from pcp_pd_kit.preflight.report import Result, fail, ok
from pcp_pd_kit.preflight.settings import SettingsError

CHECK = "subnet"
PROC_ROUTE = Path("/proc/net/route")


def subnet(ctx: Context) -> list[Result]:
    s = ctx.need_settings()
    try:
        net = s.network("pd_subnet")
    except SettingsError as exc:
        return [fail(CHECK, str(exc))]
    project = ctx.view.project if ctx.view else ""
    taken, own_devs, notes = _docker_networks(ctx, project)
    routes = _host_routes(ctx)
    hits = network.overlaps(net, taken + routes, own_devs)
    if hits:
        names = "; ".join(f"{h.what} ({h.net})" for h in hits)
        alt = network.free_alternative(net, taken + routes, own_devs)
        such_as = f" such as {alt}" if alt else ""
        msg = (
            f"PD_SUBNET={net} overlaps {names}: set PD_SUBNET in {ctx.env_label} to a free "
            f"range{such_as} (and any fixed container addresses into it)."
        )
        return [fail(CHECK, msg)]
    note = f" ({'; '.join(notes)})" if notes else ""
    return [ok(CHECK, f"PD_SUBNET={net} overlaps no Docker network and no host route{note}")]


def _docker_networks(ctx: Context, project: str) -> tuple[list[network.Taken], set[str], list[str]]:
    if ctx.info is None:
        return [], set(), ["Docker networks not read: the daemon is not reachable"]
    listed = proc.run([ctx.docker, "network", "ls", "-q"], QUICK_S)
    ids = listed.stdout.split() if listed.ok else []
    if not ids:
        return [], set(), ([] if listed.ok else [f"docker network ls failed: {listed.detail()}"])
    inspected = proc.run([ctx.docker, "network", "inspect", *ids], QUICK_S)
    if not inspected.ok:
        return [], set(), [f"docker network inspect failed: {inspected.detail()}"]
    taken, own = network.docker_networks(inspected.stdout, project)
    return taken, own, []


def _host_routes(ctx: Context) -> list[network.Taken]:
    """`ip -j route`, else /proc/net/route (old iproute2 has no -j)."""
    if shutil.which(ctx.ip):
        out = proc.run([ctx.ip, "-j", "route"], QUICK_S)
        if out.ok and out.stdout.strip().startswith("["):
            return network.ip_routes(out.stdout)
    try:
        return network.proc_routes(PROC_ROUTE.read_text())
    except OSError:
        return []
