"""TLS on NATS: every connection encrypted, and both ends proven by certificate (mutual TLS).
The servers present a certificate for their addresses; each service instance presents one of
its own (its id as the subject's common name), and the servers take a connection only with a
certificate their CA signed (`verify: true`), then the instance's user and password as
without TLS (pdserve/shared/grants.py).

A process finds its files in PD_TLS_CA (the CA that signed the servers' certificates), and
PD_TLS_CERT / PD_TLS_KEY (its own certificate and key), all PEM. Redis on TLS is a rediss:// URL
naming its files in its query (ssl_ca_certs, ssl_certfile, ssl_keyfile: redis-py's own). The local stack (`make run
RUN_ARGS=--tls`) makes a CA and every certificate at start (pdserve/local/certificates.py)
under its private data directory; a deployment mounts its own.
"""

from __future__ import annotations

import ssl

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class TLSSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PD_TLS_", extra="ignore")

    ca: str = Field("", description="PEM file of the CA that signed the NATS servers' certificates (set: TLS)")
    cert: str = Field("", description="PEM file of this instance's certificate (mutual TLS)")
    key: str = Field("", description="PEM file of this instance's private key")


def client_context(settings: TLSSettings | None = None) -> ssl.SSLContext | None:
    """The TLS a client of NATS uses: None when PD_TLS_CA is unset (plain connections)."""
    s = settings or TLSSettings()
    if not s.ca:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=s.ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if s.cert:
        ctx.load_cert_chain(s.cert, s.key or None)
    return ctx
