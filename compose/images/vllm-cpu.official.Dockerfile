# The cpu profile's vLLM image from vLLM's official CPU image: it lacks NIXL (the CUDA image
# ships it), so add the pinned nixl. Context: the repository root (see .dockerignore).
ARG BASE_IMAGE=vllm/vllm-openai-cpu:v0.32.0-x86_64
FROM ${BASE_IMAGE}
ARG PIP_INSTALL_ARGS=""
COPY compose/images/ca/ /usr/local/share/ca-certificates/kit/
COPY constraints.txt /kit/constraints.txt
RUN set -eu; \
    if ls /usr/local/share/ca-certificates/kit/*.crt >/dev/null 2>&1; then update-ca-certificates; fi; \
    (python3 -m pip --version >/dev/null 2>&1 || python3 -m ensurepip); \
    python3 -m pip install --no-cache-dir ${PIP_INSTALL_ARGS} -c /kit/constraints.txt nixl; \
    python3 -c 'import nixl, vllm'
