# make compose-check's Redis: Debian's redis-server (Redis 7) on the local base, as the image the
# compose file names runs it (a `redis` user, /data its own).
ARG BASE_IMAGE=pdserve-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends redis-server && rm -rf /var/lib/apt/lists/* \
    && install -d -o redis -g redis /data
WORKDIR /data
