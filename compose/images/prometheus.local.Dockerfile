# Prometheus without any registry: Debian 12's package on the kit's debootstrap base, run as the
# unprivileged `nobody` like the official image. wget serves the healthcheck in both images.
ARG BASE_IMAGE=pcp-pd-kit/debian-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      prometheus wget >/dev/null \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
ENTRYPOINT ["/usr/bin/prometheus"]
