# Prometheus from its official image, under the kit's image name (the compose file names one
# image whichever base built it). Context: the repository root.
ARG BASE_IMAGE=prom/prometheus:v3.5.0
FROM ${BASE_IMAGE}
ENTRYPOINT ["/bin/prometheus"]
