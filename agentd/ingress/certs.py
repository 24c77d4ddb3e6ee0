"""The default certificate: what HTTPS clients get for a host without a TLS Secret (as
ingress-nginx's "Kubernetes Ingress Controller Fake Certificate").  Made with ``cryptography``."""

from __future__ import annotations

import contextlib
import datetime
import os
import ssl
import tempfile
from pathlib import Path

DAYS = 3650


def self_signed(common_name: str, hosts: tuple[str, ...] = ()) -> bytes:
    """A self-signed EC P-256 certificate and its key, as one PEM (certificate first)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=DAYS))
    )
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(h) for h in hosts]), critical=False)
    cert = builder.sign(key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def refused(pem: bytes, directory: Path) -> str | None:
    """Why the TLS library will not load this certificate chain and key (``pem``, as the
    crt-list gets it) -- a key too small or a signature too weak for the system's security
    level, as HAProxy's OpenSSL judges it --, or None.  ``directory``: where the key may be
    written for the moment (the certificates' own, private)."""
    fd, name = tempfile.mkstemp(dir=directory, suffix=".check.pem")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(name)
        return None
    except ssl.SSLError as err:
        return err.reason or str(err)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name)


def dns_names(pem: bytes) -> tuple[str, ...]:
    """The DNS names (subjectAltName) of the first certificate in ``pem``: the names a client
    checks it against (the subject's common name is not one, as for Go's ``VerifyHostname``,
    which ingress-nginx asks, and today's browsers).  None readable: ()."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(pem)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound, x509.DuplicateExtension):
        return ()
    return tuple(sans.get_values_for_type(x509.DNSName))
