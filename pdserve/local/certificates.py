"""A local stack's certificates (`--tls`, pdserve/shared/tls.py): a CA made for the run, a server
certificate for the NATS servers' addresses, and one client certificate per service instance
(its id the common name), all under the stack's private data directory, valid for VALID_DAYS.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 30
_CA_USAGE = x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False)


@dataclass(frozen=True)
class Files:
    """One party's PEM files."""

    cert: Path
    key: Path

    def env(self, ca: Path) -> dict[str, str]:
        """The environment of a process with these files (pdserve/shared/tls.py's TLSSettings)."""
        return {"PD_TLS_CA": str(ca), "PD_TLS_CERT": str(self.cert), "PD_TLS_KEY": str(self.key)}


class Authority:
    """A CA made now, its certificate at `ca`, and the certificates it signs, under `directory`."""

    def __init__(self, directory: Path, name: str = "pdserve local CA"):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = _name(name)
        cert = (self._builder(self._name, self._key.public_key())
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(_CA_USAGE, critical=True).sign(self._key, hashes.SHA256()))
        self.ca = directory / "ca.pem"
        self.ca.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.issued: dict[str, Files] = {}

    def _builder(self, subject: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(self._name).public_key(public_key)
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=VALID_DAYS)))

    def issue(self, name: str, addresses: tuple[str, ...] = ()) -> Files:
        """`name`'s certificate (made once): a server's names its `addresses` (IPs or host names)
        and serves; a client's (no addresses) is a client's only."""
        if name in self.issued:
            return self.issued[name]
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if addresses else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (self._builder(_name(name), key.public_key())
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if addresses:
            builder = builder.add_extension(x509.SubjectAlternativeName([_general_name(a) for a in addresses]),
                                            critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        files = Files(self.directory / f"{name}.pem", self.directory / f"{name}.key")
        files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files.key.touch(mode=0o600)
        files.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
        self.issued[name] = files
        return files


def nats_block(server: Files, ca: Path) -> str:
    """nats-server's `tls` block: its certificate, and every client's verified against `ca`."""
    return (f'tls {{ cert_file: "{server.cert}", key_file: "{server.key}", ca_file: "{ca}", verify: true, '
            f"timeout: 5 }}\n")


def redis_conf(server: Files, ca: Path, port: int) -> str:
    """redis.conf's TLS: `port` on TLS alone, every client's certificate verified against `ca`."""
    return (f"port 0\ntls-port {port}\ntls-cert-file {server.cert}\ntls-key-file {server.key}\n"
            f"tls-ca-cert-file {ca}\ntls-auth-clients yes\n")


def redis_query(client: Files, ca: Path) -> str:
    """A rediss:// URL's query naming a client's files (redis-py passes them to its SSL connection)."""
    return f"?ssl_ca_certs={ca}&ssl_certfile={client.cert}&ssl_keyfile={client.key}"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _general_name(address: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(address))
    except ValueError:
        return x509.DNSName(address)
