"""``v1 Secret`` and ``v1 ConfigMap``: validation as the API server does it, plus what a TLS
Secret must hold to be served.

A Secret's ``data`` values are base64 (``stringData`` is plain text, merged into ``data`` as
the API server does); keys are config keys (``[-._a-zA-Z0-9]+``).  A Secret of type
``kubernetes.io/tls`` must have ``tls.crt`` and ``tls.key`` (ValidateSecret); agentd also
checks, with the ``cryptography`` package, that ``tls.crt`` is one or more PEM certificates,
``tls.key`` a PEM private key, and that the key is the first certificate's (what an Ingress
controller would find out only when serving it: here the apply fails instead).

A ConfigMap holds ``data`` (text) and ``binaryData`` (base64); its keys are config keys.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from .validation import Invalid, obj, string, unsupported

TLS_TYPE = "kubernetes.io/tls"
OPAQUE = "Opaque"
SECRET_TYPES = (OPAQUE, TLS_TYPE)
TLS_CERT_KEY = "tls.crt"
TLS_PRIVATE_KEY_KEY = "tls.key"
MAX_SIZE = 1024 * 1024  # MaxSecretSize
_CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def config_key(key: Any, path: str) -> str:
    if not isinstance(key, str) or not key or len(key) > 253 or not _CONFIG_KEY.fullmatch(key):
        raise Invalid(f"{path}[{key}]", f"Invalid value: {key!r}: a valid config key must consist of alphanumeric "
                                        "characters, '-', '_' or '.'")  # fmt: skip
    return key


def _keys(value: Any) -> tuple[str, ...]:
    """The field names ``value`` may have (all of them: they are config keys, checked one by
    one); none unless it is an object, so that obj() says what else it is."""
    return tuple(k for k in value if isinstance(k, str)) if isinstance(value, dict) else ()


def validate_secret(doc: dict[str, Any]) -> dict[str, Any]:
    kind = string(doc.get("type", OPAQUE), "type")
    if kind not in SECRET_TYPES:
        raise unsupported("type", kind, SECRET_TYPES)
    data: dict[str, str] = {}
    raw = obj(doc.get("data"), "data", _keys(doc.get("data")))
    for key, value in raw.items():
        config_key(key, "data")
        text = string(value, f"data[{key}]")
        try:
            base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise Invalid(f"data[{key}]", "Invalid value: must be base64 encoded") from None
        data[key] = text
    plain = obj(doc.get("stringData"), "stringData", _keys(doc.get("stringData")))
    for key, value in plain.items():
        config_key(key, "stringData")
        data[key] = base64.b64encode(string(value, f"stringData[{key}]").encode()).decode()
    if sum(len(v) * 3 // 4 for v in data.values()) > MAX_SIZE:
        raise Invalid("data", f"Too long: must have at most {MAX_SIZE} bytes")
    if kind == TLS_TYPE:
        for key in (TLS_CERT_KEY, TLS_PRIVATE_KEY_KEY):
            if key not in data:
                raise Invalid(f"data[{key}]", "Required value")
        check_key_pair(base64.b64decode(data[TLS_CERT_KEY]), base64.b64decode(data[TLS_PRIVATE_KEY_KEY]))
    out: dict[str, Any] = {"type": kind, "data": data}
    if "immutable" in doc:
        if not isinstance(doc["immutable"], bool):
            raise Invalid("immutable", "Invalid value: must be a boolean")
        out["immutable"] = doc["immutable"]
    return out


def check_key_pair(cert_pem: bytes, key_pem: bytes) -> None:
    """Invalid unless ``cert_pem`` holds PEM certificates and ``key_pem`` the first one's private key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        certs = x509.load_pem_x509_certificates(cert_pem)
    except ValueError as err:
        raise Invalid(f"data[{TLS_CERT_KEY}]", f"Invalid value: not a PEM certificate ({_first_line(err)})") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as err:
        raise Invalid(f"data[{TLS_PRIVATE_KEY_KEY}]", f"Invalid value: not an unencrypted PEM private key ({_first_line(err)})") from None
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if certs[0].public_key().public_bytes(*fmt) != key.public_key().public_bytes(*fmt):
        raise Invalid(f"data[{TLS_PRIVATE_KEY_KEY}]", "Invalid value: the private key does not match the certificate in tls.crt")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def validate_configmap(doc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    data = obj(doc.get("data"), "data", _keys(doc.get("data")))
    if data:
        out["data"] = {config_key(k, "data"): string(v, f"data[{k}]") for k, v in data.items()}
    binary = obj(doc.get("binaryData"), "binaryData", _keys(doc.get("binaryData")))
    for key, value in binary.items():
        config_key(key, "binaryData")
        if key in out.get("data", {}):
            raise Invalid(f"binaryData[{key}]", "Invalid value: duplicate of key present in data")
        try:
            base64.b64decode(string(value, f"binaryData[{key}]"), validate=True)
        except (binascii.Error, ValueError):
            raise Invalid(f"binaryData[{key}]", "Invalid value: must be base64 encoded") from None
        out.setdefault("binaryData", {})[key] = value
    if "immutable" in doc:
        if not isinstance(doc["immutable"], bool):
            raise Invalid("immutable", "Invalid value: must be a boolean")
        out["immutable"] = doc["immutable"]
    return out
