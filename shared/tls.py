"""TLS for NATS: a private certificate authority and the server's certificate.

``diloco up --tls`` makes a CA and a certificate for nats-server signed by it; nats-server then
accepts TLS connections only, and every client verifies the server's certificate against the
CA (``--nats-ca-file``, :func:`client_context`). Keys are written readable by their owner
only. The CA's key signs nothing else and stays in the run's data folder.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared import atomic

VALID_DAYS = 365


@dataclass(frozen=True)
class ServerFiles:
    """The files nats-server and its clients need."""

    ca_cert: Path
    cert: Path
    key: Path

    def server_block(self) -> str:
        """nats-server's ``tls`` block: TLS only, with this certificate."""
        return f"tls {{ {self._settings()} }}"

    def route_block(self) -> str:
        """The ``tls`` block of nats-server's ``cluster``: routes over mutual TLS, each node
        showing this certificate (which names every node's address) and checking the other's
        against the CA, so only a holder of the cluster's key can join it."""
        return f"tls {{ {self._settings()}, verify: true }}"

    def _settings(self) -> str:
        return (
            f'cert_file: "{self.cert}", key_file: "{self.key}", ca_file: "{self.ca_cert}", '
            "timeout: 5"
        )


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _key_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_server_files(folder: Path, hosts: list[str]) -> ServerFiles:
    """Make a CA and a server certificate for ``hosts`` (names or IP addresses) in ``folder``.

    Returns:
        The CA certificate, the server's certificate and its key (``ca.pem``,
        ``server.pem``, ``server-key.pem``; keys mode 0600).
    """
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("decoupled-diloco CA")
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
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        # Client too: a node of a cluster shows it when it dials another node's route port.
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    files = ServerFiles(folder / "ca.pem", folder / "server.pem", folder / "server-key.pem")
    atomic.write_private_bytes(folder / "ca-key.pem", _key_bytes(ca_key))
    atomic.atomic_write_bytes(files.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM))
    atomic.atomic_write_bytes(files.cert, cert.public_bytes(serialization.Encoding.PEM))
    atomic.write_private_bytes(files.key, _key_bytes(key))
    return files


def client_context(ca_file: str) -> ssl.SSLContext:
    """A client's TLS context: the server's certificate must chain to ``ca_file`` and name the
    host connected to.

    Raises:
        OSError, ssl.SSLError: the CA file cannot be read.
    """
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context
