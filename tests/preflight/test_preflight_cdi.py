"""The `cdi` check on faked hosts: compose's GPU requests against an engine that hands GPUs over
through CDI (nvidia-cdi-hook installed, CDI on), through the runtime hook, or both; the CDI
devices read from docker info, `nvidia-ctk cdi list` or the spec files; and ENFORCE_EAGER."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from pcp_pd_kit.preflight import check_cdi, settings
from tests.preflight.fake_host import REAL_COMPOSE, REPO, FakeHost, consistent, uuid_of

CDI_DIR_DEVICES = ["nvidia.com/gpu=0", "nvidia.com/gpu=1", "nvidia.com/gpu=2", "nvidia.com/gpu=all"]


def _requests(host: FakeHost, *devices: dict[str, Any]) -> None:
    """prefill and decode each make these device requests."""
    deploy = {"resources": {"reservations": {"devices": list(devices)}}}
    for name in ("prefill", "decode"):
        host.services[name]["deploy"] = deploy


def _cdi_engine(host: FakeHost, devices: list[str] | None = CDI_DIR_DEVICES, *hooks: str) -> None:
    """An engine with CDI on; `devices` as docker info lists them (None: no such field)."""
    assert host.info is not None
    host.info["CDISpecDirs"] = ["/etc/cdi", "/var/run/cdi"]
    host.info.pop("Runtimes", None)
    if devices is not None:
        host.info["DiscoveredDevices"] = [{"Source": "cdi", "ID": d} for d in devices]
    host.hooks(*(hooks or (check_cdi.CDI_HOOK,)))


ALL = {"driver": "nvidia", "count": -1, "capabilities": ["gpu"]}
LISTS = {"driver": "nvidia", "device_ids": ["0,1", "2"], "capabilities": ["gpu"]}


def test_runtime_hook_engines_need_no_cdi_names(host: FakeHost) -> None:
    host.hooks(check_cdi.RUNTIME_HOOK)
    _requests(host, LISTS)  # comma lists are fine for NVIDIA_VISIBLE_DEVICES
    out = consistent(host.run())
    assert out.status("cdi") == ["ok"], out.dump()
    assert "through the NVIDIA runtime hook, not CDI" in out.text("cdi")


def test_count_all_resolves_on_a_cdi_only_host(host: FakeHost) -> None:
    _cdi_engine(host)
    _requests(host, ALL)
    out = consistent(host.run())
    assert out.returncode == 0, out.dump()
    assert out.text("cdi") == (
        "GPUs reach the containers through CDI: docker info has nvidia.com/gpu=all"
    )


@pytest.mark.parametrize(("fallback", "status"), [(False, "FAIL"), (True, "WARN")])
def test_comma_list_device_ids_on_a_cdi_engine(host: FakeHost, fallback: bool, status) -> None:
    """A comma inside one entry: device_ids ["0,1", "2"] is the CDI device nvidia.com/gpu=0,1."""
    hooks = (check_cdi.CDI_HOOK, check_cdi.RUNTIME_HOOK) if fallback else ()
    _cdi_engine(host, CDI_DIR_DEVICES, *hooks)
    _requests(host, LISTS)
    out = consistent(host.run())
    assert out.status("cdi") == [status, status], out.dump()  # prefill and decode
    text = out.text("cdi")
    assert "as the CDI device nvidia.com/gpu=0,1 (no such device)" in text
    assert "give one GPU per device_ids entry" in text
    assert "nvidia.com/gpu=2" not in text  # a single id that exists is fine


@pytest.mark.parametrize(("fallback", "status"), [(False, "FAIL"), (True, "WARN")])
def test_names_no_spec_defines(host: FakeHost, fallback: bool, status: str) -> None:
    hooks = (check_cdi.CDI_HOOK, check_cdi.RUNTIME_HOOK) if fallback else ()
    _cdi_engine(host, CDI_DIR_DEVICES, *hooks)
    _requests(host, {"driver": "nvidia", "device_ids": [uuid_of(1), "2"], "capabilities": ["gpu"]})
    out = consistent(host.run())
    assert out.status("cdi") == [status], out.dump()
    text = out.text("cdi")
    assert f"no CDI device is called nvidia.com/gpu={uuid_of(1)} (docker info lists " in text
    assert "generate the specs with 'sudo nvidia-ctk cdi generate" in text
    assert ("the runtime hook takes over" in text) is fallback


def test_devices_from_nvidia_ctk_when_docker_info_has_none(host: FakeHost) -> None:
    _cdi_engine(host, None)
    host.cdi_list = ["nvidia.com/gpu=0", "nvidia.com/gpu=all"]
    _requests(host, ALL)
    out = consistent(host.run())
    assert out.status("cdi") == ["ok"], out.dump()
    assert "'nvidia-ctk cdi list' has nvidia.com/gpu=all" in out.text("cdi")
    assert "nvidia-ctk cdi list" in host.calls()


SPEC_SORTED_KEYS = """\
---
cdiVersion: 0.5.0
containerEdits:
    deviceNodes:
        - path: /dev/nvidiactl
devices:
    - containerEdits:
        deviceNodes:
            - path: /dev/nvidia0
      name: "0"
    - name: GPU-abc  # the uuid strategy
      containerEdits:
        mounts:
            - hostPath: /x
              name: not-a-device
    - name: all
kind: nvidia.com/gpu
"""
SPEC_TWO_SPACES = 'cdiVersion: "0.6.0"\nkind: nvidia.com/gpu\ndevices:\n  - name: "1"\n'


def test_spec_files_as_nvidia_ctk_writes_them() -> None:
    assert check_cdi.spec_devices(SPEC_SORTED_KEYS) == {
        "nvidia.com/gpu=0",
        "nvidia.com/gpu=GPU-abc",
        "nvidia.com/gpu=all",
    }
    assert check_cdi.spec_devices(SPEC_TWO_SPACES) == {"nvidia.com/gpu=1"}
    spec = {"kind": "nvidia.com/gpu", "devices": [{"name": "0"}, {"name": "all"}]}
    assert check_cdi.spec_devices(json.dumps(spec)) == {"nvidia.com/gpu=0", "nvidia.com/gpu=all"}
    assert check_cdi.spec_devices("devices:\n- name: all\n") == set()  # no kind: no names


def test_devices_from_the_spec_folders(host: FakeHost) -> None:
    folder = host.tmp / "cdi"
    folder.mkdir()
    (folder / "nvidia.yaml").write_text(SPEC_SORTED_KEYS)
    (folder / "notes.txt").write_text("kind: nvidia.com/gpu\ndevices:\n- name: 7\n")
    _cdi_engine(host, None)
    assert host.info is not None
    host.info["CDISpecDirs"] = [str(folder), str(host.tmp / "absent")]
    _requests(host, ALL)
    out = consistent(host.run())
    assert out.text("cdi") == (
        f"GPUs reach the containers through CDI: the CDI specs {folder / 'nvidia.yaml'} "
        "has nvidia.com/gpu=all"
    )
    _requests(host, {"driver": "nvidia", "device_ids": ["7"], "capabilities": ["gpu"]})
    out = consistent(host.run())
    assert out.status("cdi") == ["FAIL"] and "nvidia.com/gpu=7" in out.text("cdi")


def test_no_device_list_anywhere_is_a_warning(host: FakeHost) -> None:
    _cdi_engine(host, None)
    assert host.info is not None
    host.info["CDISpecDirs"] = [str(host.tmp / "absent")]
    _requests(host, ALL)
    out = consistent(host.run())
    assert out.status("cdi") == ["WARN"]
    assert "so nvidia.com/gpu=all went unchecked" in out.text("cdi")


def test_cdi_driver_requests_need_cdi_on(host: FakeHost) -> None:
    _requests(host, {"driver": "cdi", "device_ids": ["nvidia.com/gpu=all"]})
    host.services["prefill"]["deploy"]["resources"]["reservations"]["devices"][0][
        "capabilities"
    ] = ["gpu"]
    out = consistent(host.run())
    assert out.status("cdi") == ["FAIL"], out.dump()
    assert "request CDI devices (driver: cdi) but the engine has CDI off" in out.text("cdi")
    _cdi_engine(host)
    assert consistent(host.run()).status("cdi") == ["ok"]


def test_requests_of_the_repo_compose_file(tmp_path) -> None:
    """The kit's compose.yaml, rendered by the real Compose: every GPU service asks for
    nvidia.com/gpu=all, which every NVIDIA CDI spec defines."""
    if not REAL_COMPOSE.is_file():
        pytest.skip(f"no Docker Compose plugin at {REAL_COMPOSE}")
    empty = tmp_path / "empty.env"
    empty.write_text("")
    argv = settings.config_argv(str(REAL_COMPOSE), REPO / "compose.yaml", empty, [])
    proc = subprocess.run([str(REAL_COMPOSE), *argv[2:]], capture_output=True, text=True,
                          timeout=60, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    view = settings.parse_config(proc.stdout)
    assert sorted(check_cdi.requests(view)) == [
        ("decode", "nvidia", "nvidia.com/gpu=all"),
        ("prefill", "nvidia", "nvidia.com/gpu=all"),
    ]


@pytest.mark.parametrize(
    ("value", "status"),
    [("", []), ("1", ["ok"]), ("0", []), ("off", []), ("true", ["ok"]), ("yes", ["FAIL"])],
)
def test_enforce_eager_agrees_with_the_entrypoint(
    host: FakeHost, value: str, status: list[str]
) -> None:
    host.settings["enforce_eager"] = value
    out = consistent(host.run())
    assert out.status("enforce-eager") == status, out.dump()
    if status == ["FAIL"]:
        assert f"KIT_ENFORCE_EAGER='{value}' (ENFORCE_EAGER)" in out.text("enforce-eager")
