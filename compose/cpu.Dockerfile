# The cpu profile's vLLM image: vLLM's official CPU image plus NIXL, which the CUDA image already
# ships (INSTALL_KV_CONNECTORS) and the CPU image does not. Built by `docker compose --profile cpu`.
ARG VLLM_CPU_IMAGE=vllm/vllm-openai-cpu:v0.32.0-x86_64
FROM ${VLLM_CPU_IMAGE}
ARG NIXL_VERSION=1.5.1
# The image's Python may be a uv venv without pip: bootstrap it with ensurepip first.
RUN (python3 -m pip --version >/dev/null 2>&1 || python3 -m ensurepip) \
    && python3 -m pip install --no-cache-dir "nixl==${NIXL_VERSION}" \
    && python3 -c "import nixl"
