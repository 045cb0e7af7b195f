# make compose-check's Prometheus: Debian's (2.42) on the local base, run as its own user.
ARG BASE_IMAGE=pdserve-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends prometheus && rm -rf /var/lib/apt/lists/* \
    && install -d -o prometheus -g prometheus /prometheus
USER prometheus
WORKDIR /prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
