"""The GPU requests of compose.yaml against the way the Docker engine hands GPUs to containers.

An engine whose `nvidia` device driver goes through CDI first (moby PR 50228: it does when
`nvidia-cdi-hook` is installed) turns each `device_ids` entry into the CDI device
`nvidia.com/gpu=<entry>` and `count: all` into `nvidia.com/gpu=all`, and `up` fails on a name no CDI
spec defines unless the older runtime hook (`nvidia-container-runtime-hook`) takes over. A
`device_ids` entry "0,1" becomes `nvidia.com/gpu=0,1`, which never exists. `driver: cdi` requests
always need CDI. The devices the engine knows come from `docker info` (DiscoveredDevices), else
`nvidia-ctk cdi list`, else the spec files in its CDI spec folders."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from pcp_pd_kit.preflight import proc
from pcp_pd_kit.preflight.context import QUICK_S, Context
from pcp_pd_kit.preflight.report import Result, fail, ok, warn
from pcp_pd_kit.preflight.settings import ComposeView, device_requests, gpu_services

CHECK = "cdi"
KIND = "nvidia.com/gpu"
CDI_HOOK, RUNTIME_HOOK = "nvidia-cdi-hook", "nvidia-container-runtime-hook"
#: systemd's default PATH, where dockerd looks for the hooks.
DAEMON_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")
GENERATE = "sudo nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml"
_QUALIFIED = re.compile(r"^[a-z0-9][a-z0-9.-]*/[A-Za-z0-9][A-Za-z0-9._-]*=\S+$")


def requests(view: ComposeView) -> list[tuple[str, str, str]]:
    """(service, "nvidia" or "cdi", CDI device name) for each device a GPU service requests, as
    the engine names it."""
    return [
        (name, driver, cdi_name)
        for name in gpu_services(view)
        for device in device_requests(view.services[name])
        if device.get("driver") in ("nvidia", "cdi") or "gpu" in (device.get("capabilities") or [])
        for driver in ["cdi" if device.get("driver") == "cdi" else "nvidia"]
        for cdi_name in _names(device, driver)
    ]


def _names(device: dict[str, Any], driver: str) -> list[str]:
    ids = [str(i) for i in device.get("device_ids") or []]
    if ids:
        return [i if "=" in i or driver == "cdi" else f"{KIND}={i}" for i in ids]
    count = str(device.get("count", ""))
    if count in ("-1", "all"):
        return [f"{KIND}=all"]
    return [f"{KIND}={i}" for i in range(int(count) if count.isdigit() else 0)]


def spec_devices(text: str) -> set[str]:
    """Qualified device names a CDI spec defines: JSON, or YAML as nvidia-ctk writes it (a light
    reader: the top-level `kind:`, and the `name:` of each item of the top-level `devices:`)."""
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        kind = str(data.get("kind") or "")
        items = [d for d in data.get("devices") or [] if isinstance(d, dict) and "name" in d]
        return {f"{kind}={d['name']}" for d in items} if kind else set()
    kind, names, in_devices = "", [], False
    item: int | None = None  # the indentation of the devices' "- " items
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].rstrip()
        body, indent = line.strip(), len(line) - len(line.lstrip())
        if not body or body.startswith("#"):
            continue
        if indent == 0 and not body.startswith("- "):
            key, _, value = body.partition(":")
            in_devices, item = key == "devices", None
            kind = _unquote(value) if key == "kind" else kind
        elif in_devices:
            if body.startswith("- "):
                item = indent if item is None else item
                if indent == item:
                    body, indent = body[2:].lstrip(), indent + 2
            if item is not None and indent == item + 2 and body.startswith("name:"):
                names.append(_unquote(body[len("name:") :]))
    return {f"{kind}={n}" for n in names} if kind else set()


def _unquote(value: str) -> str:
    return value.strip().strip("'\"")


def known_devices(ctx: Context, spec_dirs: list[str]) -> tuple[set[str] | None, str]:
    """The CDI devices the engine can inject, and where that list came from (None: unknown)."""
    discovered = (ctx.info or {}).get("DiscoveredDevices")
    if isinstance(discovered, list):
        ids = {str(d.get("ID")) for d in discovered if isinstance(d, dict)}
        return {i for i in ids if "=" in i}, "docker info"
    out = proc.run([ctx.nvidia_ctk, "cdi", "list"], QUICK_S)
    if out.ok:
        listed = {ln.strip() for ln in out.stdout.splitlines() if _QUALIFIED.match(ln.strip())}
        return listed, "'nvidia-ctk cdi list'"
    names: set[str] = set()
    read: list[str] = []
    for folder in map(Path, spec_dirs or SPEC_DIRS):
        for path in sorted(folder.glob("*")) if folder.is_dir() else []:
            if path.suffix in (".yaml", ".yml", ".json") and path.is_file():
                names |= spec_devices(path.read_text(encoding="utf-8", errors="replace"))
                read.append(str(path))
    if read:
        return names, "the CDI specs " + ", ".join(read)
    return None, "neither docker info nor 'nvidia-ctk cdi list' nor a CDI spec file"


def _hooks(ctx: Context) -> set[str]:
    folders = [d for d in (ctx.daemon_path or DAEMON_PATH).split(os.pathsep) if d]
    return {
        hook
        for hook in (CDI_HOOK, RUNTIME_HOOK)
        if any(os.access(os.path.join(d, hook), os.X_OK) for d in folders)
    }


def cdi(ctx: Context) -> list[Result]:
    if ctx.info is None or ctx.view is None:
        return []  # the daemon or the settings check already failed
    wanted = requests(ctx.view)
    spec_dirs = [str(d) for d in ctx.info.get("CDISpecDirs") or []]
    cdi_on = bool(spec_dirs) or bool(ctx.info.get("DiscoveredDevices"))
    hooks = _hooks(ctx)
    checked = [w for w in wanted if w[1] == "cdi" or (cdi_on and CDI_HOOK in hooks)]
    if not checked:
        how = "the NVIDIA runtime hook" if RUNTIME_HOOK in hooks else "the engine's nvidia driver"
        return [
            ok(CHECK, f"GPU requests go through {how}, not CDI: no CDI device names to resolve")
        ]
    if not cdi_on:
        msg = (
            f"{', '.join(sorted({w[0] for w in checked}))} request CDI devices (driver: cdi) but "
            'the engine has CDI off: enable it ("features": {"cdi": true} in /etc/docker/'
            f"daemon.json, then restart Docker) and generate the specs with '{GENERATE}'."
        )
        return [fail(CHECK, msg)]
    known, source = known_devices(ctx, spec_dirs)
    # The runtime hook takes over when CDI cannot inject a driver-nvidia request.
    fallback = RUNTIME_HOOK in hooks
    lists = sorted({(w[0], w[2]) for w in checked if "," in w[2].partition("=")[2]})
    results = []
    for service, name in lists:
        msg = (
            f"{service} asks for several GPUs in one device_ids entry, which this engine looks up "
            f"as the CDI device {name} (no such device): give one GPU per device_ids entry (the "
            "kit's compose.yaml uses count: all)."
        )
        results.append(warn(CHECK, msg) if fallback else fail(CHECK, msg))
    names = sorted({w[2] for w in checked} - {name for _, name in lists})
    if known is None:
        msg = f"could not list the engine's CDI devices ({source}), so {', '.join(names)} "
        return results + [warn(CHECK, msg + "went unchecked: compare 'nvidia-ctk cdi list'.")]
    missing = [n for n in names if n not in known]
    if missing:
        msg = (
            f"the engine hands GPUs over through CDI, and no CDI device is called "
            f"{', '.join(missing)} ({source} lists {', '.join(sorted(known)[:8]) or 'none'}): "
            f"generate the specs with '{GENERATE}' (again after a driver or GPU change), or ask "
            "for devices it lists in compose.yaml (the kit's asks for nvidia.com/gpu=all)."
        )
        only_nvidia = all(w[1] == "nvidia" for w in checked if w[2] in missing)
        if fallback and only_nvidia:
            results.append(warn(CHECK, msg[:-1] + " (meanwhile the runtime hook takes over)."))
        else:
            results.append(fail(CHECK, msg))
    if not results:
        results.append(
            ok(CHECK, f"GPUs reach the containers through CDI: {source} has {', '.join(names)}")
        )
    return results
