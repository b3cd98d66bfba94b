"""TLS for the bus: a deployment's own certificate authority and one certificate that the
nats-servers present to clients and to each other (routes check both ends).

`llmbus serve --nats-tls` makes them in its run folder, `llmbus nats-config --tls` for
compose. Only the CA certificate leaves the folder's owner: every service checks the
server against it (shared.bus.BusAuth, `--nats-tls-ca`). The CA's key is never written —
nothing else is signed with it — so a copy of the folder cannot mint a certificate.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True, slots=True)
class TlsFiles:
    ca: Path  # the CA certificate: what clients trust
    cert: Path  # the servers' certificate (also their routes' client certificate)
    key: Path  # its private key, 0600


def make_tls_files(folder: Path, hosts: list[str], days: int = 365) -> TlsFiles:
    """A CA and a certificate for `hosts` (names or IP addresses) signed by it, in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llmbus bus CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = [_san(host) for host in hosts]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(folder / "ca.pem", folder / "server.pem", folder / "server.key")
    write_file(files.ca, ca.public_bytes(serialization.Encoding.PEM), 0o644)
    write_file(files.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    write_file(files.key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()))
    return files


def server_tls_block(files: TlsFiles, indent: str = "") -> str:
    """nats-server's `tls { … }` for client connections, or (indented) for a cluster's routes."""
    return (f'{indent}tls {{ cert_file: "{files.cert}", key_file: "{files.key}", ca_file: "{files.ca}", '
            f"timeout: 5 }}")


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def write_file(path: Path, data: bytes | str, mode: int = 0o600) -> None:
    """Created with `mode` from the start (a secret is never readable by others, even briefly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
