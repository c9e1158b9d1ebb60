"""The secured local stack's certificates: a private CA and the broker's certificate, made with ``cryptography``.

``ensure_pki`` writes, once, under ``<home>/security``:

* ``ca.pem`` (the CA certificate every client trusts) and ``ca.key`` (its key, 0600);
* ``kafka/broker.pem``: the broker's PKCS#8 key and certificate chain in one PEM file (Kafka's
  ``ssl.keystore.type=PEM``), valid for the stack's host name and address.

Keys are ECDSA P-256; certificates are valid for a year and renewed when a certificate is
missing, expires within 30 days, or does not name the host the stack now listens on.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 365
RENEW_DAYS = 30


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Tangram local stack"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _fresh(path: Path, names: set[str] | None = None) -> bool:
    """True when the certificate in ``path`` is valid for ``RENEW_DAYS`` more and names every host in ``names``."""
    try:
        cert = x509.load_pem_x509_certificates(path.read_bytes())[0]
    except (OSError, ValueError, IndexError):
        return False
    if cert.not_valid_after_utc - dt.timedelta(days=RENEW_DAYS) < dt.datetime.now(dt.timezone.utc):
        return False
    if names:
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            return False
        have = {*san.get_values_for_type(x509.DNSName), *map(str, san.get_values_for_type(x509.IPAddress))}
        return names <= have
    return True


def _alt_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def ensure_ca(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA in ``folder`` (``ca.pem``, ``ca.key``), made if missing or about to expire."""
    cert_path, key_path = folder / "ca.pem", folder / "ca.key"
    if _fresh(cert_path) and key_path.is_file():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        return x509.load_pem_x509_certificate(cert_path.read_bytes()), key
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name("Tangram local CA")).issuer_name(_name("Tangram local CA"))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    _write_private(key_path, _key_pem(key))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def ensure_server_cert(folder: Path, name: str, hosts: list[str]) -> Path:
    """``<folder>/<name>.pem``: a server key and certificate chain for ``hosts``, signed by the CA in ``folder``."""
    path = folder / name / f"{name}.pem"
    names = set(hosts)
    ca_cert, ca_key = ensure_ca(folder)
    if _fresh(path, names) and _signed_by(path, ca_cert):
        return path
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName([_alt_name(h) for h in sorted(names)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    _write_private(path, _key_pem(key) + cert.public_bytes(serialization.Encoding.PEM)
                   + ca_cert.public_bytes(serialization.Encoding.PEM))
    return path


def _signed_by(path: Path, ca: x509.Certificate) -> bool:
    """True when the certificate in ``path`` carries ``ca``'s signature (a renewed CA invalidates it)."""
    try:
        x509.load_pem_x509_certificates(path.read_bytes())[0].verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True
