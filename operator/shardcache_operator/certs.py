"""Webhook TLS: a CA and a serving certificate generated with `cryptography`.

Kubernetes calls admission webhooks over HTTPS only, and needs the CA in the webhook
configuration's `caBundle`. kopf's own self-signed mode relies on oscrypto, which is
broken with OpenSSL 3; nothing here uses it.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: A year: long enough not to expire under a running cluster; the chart or a restart
#: renews it (generated certificates live only as long as the operator process).
VALIDITY = datetime.timedelta(days=365)


@dataclasses.dataclass(frozen=True)
class Bundle:
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    @property
    def ca_bundle(self) -> str:
        """The base64 CA for `webhooks[].clientConfig.caBundle`."""
        return base64.b64encode(self.ca_pem).decode("ascii")


@dataclasses.dataclass(frozen=True)
class Files:
    ca_file: Path
    cert_file: Path
    key_file: Path


def service_sans(service: str, namespace: str) -> list[str]:
    """The DNS names the API server may use for a webhook Service."""
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def _general_name(san: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(san))
    except ValueError:
        return x509.DNSName(san)


def generate(
    sans: Sequence[str], *, now: datetime.datetime | None = None, common_name: str | None = None
) -> Bundle:
    """A fresh CA and a serving certificate for `sans` (DNS names and IP addresses)."""
    if not sans:
        raise ValueError("a serving certificate needs at least one DNS name or IP address")
    start = (now or datetime.datetime.now(datetime.UTC)) - datetime.timedelta(minutes=5)
    end = start + VALIDITY
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "shardcache-webhook-ca")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name or sans[0])])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName([_general_name(s) for s in sans]), False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return Bundle(
        ca_pem=ca_cert.public_bytes(serialization.Encoding.PEM),
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


def write(bundle: Bundle, directory: Path) -> Files:
    """Write ca.crt, tls.crt and tls.key (the names of a kubernetes.io/tls Secret)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = Files(directory / "ca.crt", directory / "tls.crt", directory / "tls.key")
    files.ca_file.write_bytes(bundle.ca_pem)
    files.cert_file.write_bytes(bundle.cert_pem)
    files.key_file.touch(mode=0o600)
    files.key_file.write_bytes(bundle.key_pem)
    return files
