"""A fake GPU host for preflight tests: `docker`, `nvidia-smi` and `ip` are bash scripts in
tmp_path that print canned answers from files the test controls."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.fake_bin import write_executable
from tests.support.net import free_ports
from tests.support.paths import REPO

SCRIPT = REPO / "scripts" / "preflight.sh"
REAL_COMPOSE = Path("/usr/local/lib/docker/cli-plugins/docker-compose")

FAKE_DOCKER = r"""#!/usr/bin/env bash
# fake docker: answers from $FAKE_DIR/<name>.out (exit status <name>.rc, default 0); a missing
# .out file means "fails". Every call is appended to $FAKE_DIR/calls.
d="${FAKE_DIR:?}"
printf '%s\n' "$*" >>"$d/calls"
answer() {
  [[ -f "$d/$1.out" ]] || { echo "fake docker: $1 fails" >&2; exit 1; }
  cat "$d/$1.out"
  exit "$(cat "$d/$1.rc" 2>/dev/null || echo 0)"
}
case "$1" in
  compose)
    [[ "$2" == version ]] && answer compose-version
    [[ -f "$d/compose-real" ]] && exec "$(cat "$d/compose-real")" "${@:2}"
    answer compose-config ;;
  info) answer info ;;
  image)  # image inspect NAME: image-inspect-NAME.out (NAME with / : @ as _) if present
    per="image-inspect-$(printf '%s' "$3" | tr '/:@' '___')"
    [[ -f "$d/$per.out" ]] && answer "$per"
    answer image-inspect ;;
  run) answer run ;;
  network) [[ "$2" == ls ]] && answer network-ls; answer network-inspect ;;
  ps) answer ps ;;
  rm) exit 0 ;;
  *) echo "fake docker: unexpected: $*" >&2; exit 64 ;;
esac
"""
FAKE_TOOL = r"""#!/usr/bin/env bash
# fake __NAME__: prints $FAKE_DIR/__NAME__.out, exit status __NAME__.rc (missing .out: fails)
d="${FAKE_DIR:?}"
printf '__NAME__ %s\n' "$*" >>"$d/calls"
[[ -f "$d/__NAME__.out" ]] || { echo "__NAME__: failed" >&2; exit 9; }
cat "$d/__NAME__.out"
exit "$(cat "$d/__NAME__.rc" 2>/dev/null || echo 0)"
"""

H100 = ("NVIDIA H100 80GB HBM3", 81559, "9.0")
A100 = ("NVIDIA A100-SXM4-80GB", 81920, "8.0")
L40S = ("NVIDIA L40S", 46068, "8.9")
L4 = ("NVIDIA L4", 23034, "8.9")
H200 = ("NVIDIA H200", 143771, "9.0")

#: DeepSeek-V2-Lite-Chat's config.json, the fields the size estimate reads.
DSV2_LITE_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 27,
    "vocab_size": 102400, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 64,
    "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
}  # fmt: skip
MODEL = "deepseek-ai/DeepSeek-V2-Lite-Chat"

# The GPU servers' KV-pull settings as compose.yaml renders them.
GPU_UCX_ENV = {"UCX_TLS": "cuda_ipc,cuda_copy,tcp,sm,self", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}


def gpu_rows(*models: tuple[str, int, str], driver: str = "580.95.05") -> list[str]:
    """nvidia-smi CSV rows, one GPU per model tuple, indices from 0."""
    return [
        f"{i}, {uuid_of(i)}, {name}, {mib}, {cap}, {driver}"
        for i, (name, mib, cap) in enumerate(models)
    ]


def uuid_of(index: int) -> str:
    return f"GPU-{index:08d}-aaaa-bbbb-cccc-{index:012d}"


def cache_model(cache: Path, model: str, config: dict[str, Any], blob_bytes: int = 0) -> Path:
    """Put `model` in an HF cache the way huggingface_hub lays it out; a sparse blob of
    `blob_bytes` stands for downloaded weights without using the disk."""
    repo = cache / "hub" / ("models--" + model.replace("/", "--"))
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    if blob_bytes:
        (repo / "blobs").mkdir(exist_ok=True)
        with open(repo / "blobs" / "weights", "wb") as blob:
            blob.truncate(blob_bytes)
    return snapshot


@dataclass
class Outcome:
    """One preflight run: exit status, the parsed --json results (if any), raw output."""

    returncode: int
    stdout: str
    stderr: str
    results: list[dict[str, str]] = field(default_factory=list)

    def of(self, check: str) -> list[dict[str, str]]:
        return [r for r in self.results if r["check"] == check]

    def status(self, check: str) -> list[str]:
        return [r["status"] for r in self.of(check)]

    def text(self, check: str) -> str:
        return "\n".join(r["message"] for r in self.of(check))

    @property
    def fails(self) -> list[dict[str, str]]:
        return [r for r in self.results if r["status"] == "FAIL"]

    def dump(self) -> str:
        return self.stdout + self.stderr


class FakeHost:
    """A healthy 3 x H100 host by default; tests change the attributes, then `run()`."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.fake_dir = tmp / "fake"
        self.bin = tmp / "bin"
        # Where the fake dockerd finds the NVIDIA hooks (none: hooks() installs them).
        self.daemon_bin = tmp / "daemon-bin"
        for folder in (self.fake_dir, self.bin, tmp / "docker-root", self.daemon_bin):
            folder.mkdir(parents=True, exist_ok=True)
        write_executable(self.bin / "docker", FAKE_DOCKER)
        for tool in ("nvidia-smi", "ip", "nvidia-ctk"):
            write_executable(self.bin / tool, FAKE_TOOL.replace("__NAME__", tool))
        self.cache = tmp / "hf"
        cache_model(self.cache, MODEL, DSV2_LITE_CONFIG, blob_bytes=32 * 10**9)
        self.token_file = tmp / "hf_token"
        self.token_file.write_text("")
        proxy, prometheus, grafana = free_ports(3)
        self.settings: dict[str, Any] = {
            "model_name": MODEL,
            "vllm_image": "vllm/vllm-openai:v0.32.0",
            "prefill_tp_size": "1",
            "prefill_pcp_size": "2",
            "decode_tp_size": "1",
            "prefill_gpus": "0,1",
            "decode_gpus": "2",
            "prefill_gpu_memory_utilization": "0.85",
            "decode_gpu_memory_utilization": "0.85",
            "moe_backend": "auto",
            "max_model_len": "4096",
            "hf_cache_dir": str(self.cache),
            "hf_token_file": str(self.token_file),
            "pd_subnet": "172.28.0.0/24",
            "proxy_port": str(proxy),
            "prometheus_port": str(prometheus),
            "grafana_port": str(grafana),
            "bind_address": "127.0.0.1",
        }
        gpu_device = {"driver": "nvidia", "capabilities": ["gpu"], "device_ids": ["0"]}
        reservation = {"resources": {"reservations": {"devices": [gpu_device]}}}
        self.services: dict[str, Any] = {
            "prefill": {
                "image": "vllm",
                "profiles": ["gpu"],
                "deploy": reservation,
                "environment": dict(GPU_UCX_ENV),
            },
            "decode": {
                "image": "vllm",
                "profiles": ["gpu"],
                "deploy": reservation,
                "environment": dict(GPU_UCX_ENV),
            },
            "prometheus": {"image": "prom/prometheus"},
        }
        self.secrets: dict[str, Any] = {"hf_token": {"file": str(self.token_file)}}
        self.compose_config: str | None = None  # raw override of the whole JSON
        self.compose_config_rc = 0
        self.compose_version: str | None = "2.29.1"
        self.gpus: list[str] | None = gpu_rows(H100, H100, H100)
        self.info: dict[str, Any] | None = {
            "Runtimes": {"runc": {"path": "runc"}, "nvidia": {"path": "nvidia-container-runtime"}},
            "DockerRootDir": str(tmp / "docker-root"),
        }
        self.image: dict[str, Any] | None = {"Config": {"Env": ["CUDA_VERSION=13.0.1"]}}
        # Per-image `docker image inspect` answers (None: not pulled); others get `image`.
        self.images: dict[str, dict[str, Any] | None] = {}
        self.nixl_rc = 0
        self.nixl_output = ""
        self.networks: list[dict[str, Any]] = [
            {"Name": "bridge", "Id": "f" * 64, "Labels": {},
             "Options": {"com.docker.network.bridge.name": "docker0"},
             "IPAM": {"Config": [{"Subnet": "172.17.0.0/16", "Gateway": "172.17.0.1"}]}},
            {"Name": "host", "Id": "e" * 64, "Labels": {}, "IPAM": {"Config": []}},
        ]  # fmt: skip
        self.routes: list[dict[str, Any]] | None = [
            {"dst": "default", "gateway": "192.0.2.1", "dev": "eth0"},
            {"dst": "172.17.0.0/16", "dev": "docker0"},
            {"dst": "192.0.2.0/24", "dev": "eth0"},
        ]
        self.ps = ""
        self.cdi_list: list[str] | None = None  # `nvidia-ctk cdi list` (None: it fails)
        self.compose_real: Path | None = None
        self.compose_file = tmp / "compose.yaml"
        self.compose_file.write_text("# stands in for the repo's compose.yaml\n")
        base = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_", "PREFLIGHT_"))}
        for key in [k for k in base if k.startswith("COMPOSE_")]:
            del base[key]
        self.env: dict[str, str] = {
            **base,
            "FAKE_DIR": str(self.fake_dir),
            "PREFLIGHT_DOCKER": str(self.bin / "docker"),
            "PREFLIGHT_NVIDIA_SMI": str(self.bin / "nvidia-smi"),
            "PREFLIGHT_IP": str(self.bin / "ip"),
            "PREFLIGHT_NVIDIA_CTK": str(self.bin / "nvidia-ctk"),
            "PREFLIGHT_DAEMON_PATH": str(self.daemon_bin),
            "PREFLIGHT_COMPOSE_FILE": str(self.compose_file),
        }

    def hooks(self, *names: str) -> None:
        """Install the NVIDIA hooks dockerd would find: nvidia-cdi-hook and/or
        nvidia-container-runtime-hook (empty executables: only their presence counts)."""
        for name in names:
            write_executable(self.daemon_bin / name, "#!/bin/sh\nexit 0\n")

    # -- answers -----------------------------------------------------------------------------
    def _answer(self, name: str, text: str | None, rc: int = 0) -> None:
        out, rc_file = self.fake_dir / f"{name}.out", self.fake_dir / f"{name}.rc"
        if text is None:
            out.unlink(missing_ok=True)
            rc_file.unlink(missing_ok=True)
            return
        out.write_text(text)
        rc_file.write_text(str(rc))

    def config_json(self) -> str:
        return json.dumps({
            "name": "pcp-pd-kit",
            "services": self.services,
            "networks": {"pd": {"name": "pcp-pd-kit_pd"}},
            "secrets": self.secrets,
            "x-kit-settings": self.settings,
        })  # fmt: skip

    def write(self) -> None:
        version = None if self.compose_version is None else self.compose_version + "\n"
        self._answer("compose-version", version)
        config = self.compose_config if self.compose_config is not None else self.config_json()
        self._answer("compose-config", config, self.compose_config_rc)
        real = self.fake_dir / "compose-real"
        if self.compose_real is None:
            real.unlink(missing_ok=True)
        else:
            real.write_text(str(self.compose_real))
        self._answer("info", None if self.info is None else json.dumps(self.info))
        self._answer("image-inspect", None if self.image is None else json.dumps([self.image]))
        for old in self.fake_dir.glob("image-inspect-*"):
            old.unlink()
        for name, info in self.images.items():
            key = "image-inspect-" + name.replace("/", "_").replace(":", "_").replace("@", "_")
            self._answer(key, json.dumps([info]) if info is not None else "", 0 if info else 1)
        self._answer("run", self.nixl_output, self.nixl_rc)
        ids = "".join(net["Id"][:12] + "\n" for net in self.networks)
        self._answer("network-ls", ids)
        self._answer("network-inspect", json.dumps(self.networks))
        self._answer("ps", self.ps)
        gpus = None if self.gpus is None else "".join(row + "\n" for row in self.gpus)
        self._answer("nvidia-smi", gpus)
        self._answer("ip", None if self.routes is None else json.dumps(self.routes))
        listing = None if self.cdi_list is None else "".join(n + "\n" for n in self.cdi_list)
        self._answer("nvidia-ctk", listing)

    def calls(self) -> list[str]:
        path = self.fake_dir / "calls"
        return path.read_text().splitlines() if path.exists() else []

    # -- running -----------------------------------------------------------------------------
    def run(self, *args: str, json_output: bool = True, python: str | None = None,
            **env: str | None) -> Outcome:  # fmt: skip
        """Run preflight (the shell wrapper, or `python -m pcp_pd_kit.preflight` with `python`)."""
        self.write()
        (self.fake_dir / "calls").unlink(missing_ok=True)
        environ = dict(self.env)
        for key, value in env.items():
            if value is None:
                environ.pop(key, None)
            else:
                environ[key] = value
        argv = [str(SCRIPT)] if python is None else [python, "-m", "pcp_pd_kit.preflight"]
        if python is not None:
            environ["PYTHONPATH"] = str(REPO / "scripts")
        argv += [*args, *(["--json"] if json_output else [])]
        proc = subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=120)
        out = Outcome(proc.returncode, proc.stdout, proc.stderr)
        if json_output and proc.stdout.strip():
            out.results = json.loads(proc.stdout)
        return out


def python_for(version: str) -> str | None:
    """A working interpreter of `version` (e.g. '3.8') on this machine, for compatibility runs
    (pyenv shims exist for versions that are not selected, so each candidate is tried)."""
    candidates = [f"python{version}"]
    pyenv = Path.home() / ".pyenv" / "versions"
    if pyenv.is_dir():
        candidates += [str(p / "bin" / "python") for p in sorted(pyenv.glob(version + ".*"))]
    for candidate in candidates:
        found = _which(candidate)
        if not found:
            continue
        probe = subprocess.run([found, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True, timeout=30)  # fmt: skip
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return found
    return None


def _which(name: str) -> str | None:
    if os.sep in name:
        return name if os.access(name, os.X_OK) else None
    return shutil.which(name)


def consistent(out: Outcome) -> Outcome:
    """Every run: exit status = number of FAILs, each FAIL one sentence that names the fix."""
    assert out.results, out.dump()
    assert out.returncode == len(out.fails), out.dump()
    for result in out.results:
        assert set(result) == {"check", "status", "message"}
        assert result["status"] in ("ok", "WARN", "FAIL")
        assert "\n" not in result["message"]
    for result in out.fails:
        assert result["message"].endswith(".") and ": " in result["message"], result
    return out
