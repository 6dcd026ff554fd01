"""What the checks share: where things are, the commands to call, the resolved settings and
facts looked up once (docker info, the GPU list, the image, the model's size)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pcp_pd_kit.preflight import hfcache, proc, weights
from pcp_pd_kit.preflight.gpus import Gpu
from pcp_pd_kit.preflight.settings import ComposeView, Settings

QUICK_S = 20.0  # docker info / inspect / network, nvidia-smi, ip
COMPOSE_S = 60.0  # docker compose config
CONTAINER_S = 180.0  # the NIXL import inside the image


@dataclass(frozen=True)
class ModelInfo:
    """The model's size and where it came from; `quantized` is None when unknown."""

    size: weights.ModelSize | None
    source: str
    quantized: bool | None


@dataclass
class Context:
    """State the checks share; earlier checks fill in what later ones read (settings, GPUs)."""

    compose_file: Path
    env_file: Path | None
    profiles: list[str]
    docker: str
    nvidia_smi: str
    ip: str
    environ: Mapping[str, str]
    nvidia_ctk: str = "nvidia-ctk"
    daemon_path: str = ""  # where the Docker daemon finds the NVIDIA hooks ('' = DAEMON_PATH)
    docker_found: bool = False
    compose_ok: bool = False
    view: ComposeView | None = None
    settings: Settings | None = None
    gpu_mode: bool = True
    info: dict[str, Any] | None = None  # `docker info` JSON; None while the daemon is unreachable
    gpus: list[Gpu] | None = None
    assigned: dict[str, list[Gpu]] = field(default_factory=dict)  # "prefill"/"decode" -> GPUs
    _images: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    _model: ModelInfo | None = None

    @property
    def env_label(self) -> str:
        """Where the user changes a setting, for the fix sentences."""
        return str(self.env_file) if self.env_file is not None else ".env"

    def need_settings(self) -> Settings:
        assert self.settings is not None, "checks that read settings run only after they loaded"
        return self.settings

    def model_name(self) -> str:
        """The model the selected stack serves ('' for a cpu stack without cpu_model_name)."""
        settings = self.need_settings()
        if not self.gpu_mode:
            return settings.text("cpu_model_name")
        return settings.text("model_name")

    def image(self) -> dict[str, Any] | None:
        """`docker image inspect` of VLLM_IMAGE, or None when it is not present locally (or the
        daemon cannot say). Never pulls."""
        return self.inspect(self.need_settings().text("vllm_image"))

    def inspect(self, image: str) -> dict[str, Any] | None:
        """`docker image inspect` of ``image`` (looked up once per image), or None when it is
        not present locally or the daemon cannot say. Never pulls."""
        if image not in self._images and self.info is not None:
            found: dict[str, Any] | None = None
            out = proc.run([self.docker, "image", "inspect", image], QUICK_S)
            if out.ok:
                try:
                    answer = json.loads(out.stdout)
                except ValueError:
                    answer = None
                found = answer[0] if isinstance(answer, list) and answer else {}
            self._images[image] = found
        return self._images.get(image)

    def image_known(self) -> bool:
        """Whether `image()` answers at all: it needs a reachable daemon."""
        return self.info is not None

    def model_info(self) -> ModelInfo:
        if self._model is None:
            self._model = self._look_up_model()
        return self._model

    def _look_up_model(self) -> ModelInfo:
        model = self.model_name()
        cache = self.need_settings().path("hf_cache_dir")
        path = hfcache.cached_config(cache, model)
        config = weights.read_config(path) if path is not None else None
        table = weights.from_table(model)
        if config is None:
            if table is not None:
                return ModelInfo(table, "preflight's table of known models", False)
            return ModelInfo(
                None, f"its config.json is not in {cache} and preflight's table lacks it", None
            )
        quantized = bool(config.get("quantization_config"))
        size = weights.estimate(config)
        if size is not None:
            return ModelInfo(size, f"its config.json in {cache}", quantized)
        if table is not None:
            return ModelInfo(table, "preflight's table of known models", quantized)
        why = "quantized" if quantized else "an architecture preflight cannot count"
        return ModelInfo(None, f"its config.json in {cache} describes {why}", quantized)
