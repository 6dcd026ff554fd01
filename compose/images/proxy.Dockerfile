# pd-proxy: the proxy package and its runtime libraries, non-root, read-only friendly.
# Context: the repository root (see .dockerignore). Base: python:3.11-slim (official) or the
# kit's debootstrap Debian base (KIT_IMAGE_BASE=local, wheels from compose/images/wheels/proxy).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
# Empty: pip's index (official). Local: "--no-index --find-links /kit/wheels".
ARG PIP_INSTALL_ARGS=""
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
COPY compose/images/ca/ /usr/local/share/ca-certificates/kit/
COPY compose/images/wheels/ /kit/wheels-all/
COPY constraints.txt /kit/constraints.txt
COPY proxy/pyproject.toml /kit/proxy/pyproject.toml
COPY proxy/pd_proxy /kit/proxy/pd_proxy
RUN set -eu; \
    if ! command -v python3 >/dev/null || ! python3 -c 'import venv, ensurepip' 2>/dev/null; then \
      apt-get update -qq; \
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        python3 python3-venv ca-certificates >/dev/null; \
      rm -rf /var/lib/apt/lists/*; \
    fi; \
    if ls /usr/local/share/ca-certificates/kit/*.crt >/dev/null 2>&1; then \
      update-ca-certificates >/dev/null 2>&1 || cat /usr/local/share/ca-certificates/kit/*.crt >>/etc/ssl/certs/ca-certificates.crt; \
    fi; \
    mv /kit/wheels-all/proxy /kit/wheels 2>/dev/null || mkdir -p /kit/wheels; \
    python3 -m venv /opt/venv; \
    # A C compiler (and Python's headers where the base lacks them) for pd-proxy's block-key
    # chain in C, removed again once it is built; the build fails if the chain is not native.
    build_deps="gcc libc6-dev"; \
    python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
      || build_deps="$build_deps python3-dev"; \
    apt-get update -qq; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $build_deps >/dev/null; \
    /opt/venv/bin/pip install -q ${PIP_INSTALL_ARGS} -c /kit/constraints.txt /kit/proxy; \
    /opt/venv/bin/python -c 'from pd_proxy.routing.cache import keys; assert keys.NATIVE, "the C part of pd-proxy was not built"'; \
    apt-get purge -y -qq --auto-remove $build_deps >/dev/null; \
    apt-get clean; rm -rf /var/lib/apt/lists/* /kit; \
    useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin pdproxy
USER 10001
EXPOSE 8000
# Exec form: python is PID 1 and gets SIGTERM itself, so in-flight requests drain on stop.
ENTRYPOINT ["pd-proxy"]
