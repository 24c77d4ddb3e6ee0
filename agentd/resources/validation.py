"""Field validation as the Kubernetes API server does it (apimachinery's validation package).

Every check raises :class:`Invalid` with the field path and what is wrong, rendered the
way the API server words it (``spec.ingress[0].ports[1].port: Invalid value: "HTTP": ...``),
so an operator coming from kubectl recognises the message.  Pure: no I/O.

The rules are the API server's (k8s.io/apimachinery/pkg/util/validation):

* DNS-1123 label (namespace names): ``[a-z0-9]([-a-z0-9]*[a-z0-9])?``, at most 63 characters;
* DNS-1123 subdomain (most object names): labels joined by dots, at most 253 characters;
* qualified name (label and annotation keys): ``[prefix/]name``, the prefix a DNS-1123
  subdomain, the name ``([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`` of at most 63 characters;
* label value: empty, or like a qualified name's name part;
* IANA service name (named ports): at most 15 lowercase letters, digits and single hyphens,
  at least one letter, no hyphen at either end.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any

from agentd.digits import whole_number

DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
QUALIFIED_NAME_MAX = 63
LABEL_VALUE_MAX = 63
IANA_SVC_NAME_MAX = 15
ANNOTATIONS_MAX_BYTES = 256 * 1024  # TotalAnnotationSizeLimitB

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_IANA_SVC_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")


class Invalid(ValueError):
    """One invalid field: ``path`` (``spec.ingress[0].from``) and the API server's wording."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(f"{path}: {detail}" if path else detail)
        self.path = path
        self.detail = detail


def about(err: Invalid, subject: str) -> Invalid:
    """``err`` with the object it concerns in front (``Service shop/web: spec.clusterIP: ...``),
    for the checks that need the cluster's state and so run after the documents were read,
    where the document's place is no longer known."""
    out = type(err)(err.path, err.detail)
    out.args = (f"{subject}: {err}",)
    return out


def show(value: Any, limit: int = 60) -> str:
    """A value as the API server quotes it in messages (JSON), cut to ``limit`` characters."""
    try:
        text = json.dumps(value, default=str, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def required(path: str) -> Invalid:
    return Invalid(path, "Required value")


def invalid(path: str, value: Any, why: str) -> Invalid:
    return Invalid(path, f"Invalid value: {show(value)}: {why}")


def unsupported(path: str, value: Any, supported: tuple[str, ...]) -> Invalid:
    return Invalid(path, f"Unsupported value: {show(value)}: supported values: {', '.join(map(show, supported))}")


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def wrong_type(path: str, value: Any, want: str) -> Invalid:
    return Invalid(path, f"Invalid value: {show(value)}: must be {want}, not {type_name(value)}")


# ------------------------------------------------------------------ shapes


def obj(value: Any, path: str, allowed: tuple[str, ...], *, ignored: tuple[str, ...] = ()) -> dict[str, Any]:
    """``value`` as a JSON object with only ``allowed`` (or silently dropped ``ignored``) keys.

    Unknown fields are an error, as with kubectl's strict field validation: a misspelt
    ``podselector`` must not silently select every pod.  A null object counts as empty.
    """
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise wrong_type(path, value, "an object")
    out: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise Invalid(path, f"field names must be strings, not {show(key)}")
        if key in ignored:
            continue
        if key not in allowed:
            where = f"{path}.{key}" if path else key
            raise Invalid(where, "unknown field")
        if item is not None:  # JSON null is "not set", as in the API server's decoder
            out[key] = item
    return out


def array(value: Any, path: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise wrong_type(path, value, "an array")
    return value


def string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise wrong_type(path, value, "a string")
    return value


def integer(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)  # JSON has one number type: 80.0 is 80
        raise wrong_type(path, value, "an integer")
    return value


# ------------------------------------------------------------------ names and labels


def dns1123_label(value: Any, path: str) -> str:
    text = string(value, path)
    if not text:
        raise required(path)
    if len(text) > DNS1123_LABEL_MAX:
        raise invalid(path, text, f"must be no more than {DNS1123_LABEL_MAX} characters")
    if not _DNS1123_LABEL.fullmatch(text):
        raise invalid(
            path,
            text,
            "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
            "and must start and end with an alphanumeric character",
        )
    return text


def dns1123_subdomain(value: Any, path: str) -> str:
    text = string(value, path)
    if not text:
        raise required(path)
    if len(text) > DNS1123_SUBDOMAIN_MAX:
        raise invalid(path, text, f"must be no more than {DNS1123_SUBDOMAIN_MAX} characters")
    if not _DNS1123_SUBDOMAIN.fullmatch(text):
        raise invalid(
            path,
            text,
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
            "and must start and end with an alphanumeric character",
        )
    return text


def qualified_name(value: Any, path: str) -> str:
    text = string(value, path)
    prefix, slash, name = text.rpartition("/")
    if not slash:
        name = text
    elif not prefix:
        raise invalid(path, text, "prefix part must be non-empty")
    elif len(prefix) > DNS1123_SUBDOMAIN_MAX or not _DNS1123_SUBDOMAIN.fullmatch(prefix):
        raise invalid(path, text, "prefix part must be a lowercase RFC 1123 subdomain")
    if not name:
        raise invalid(path, text, "name part must be non-empty")
    if len(name) > QUALIFIED_NAME_MAX:
        raise invalid(path, text, f"name part must be no more than {QUALIFIED_NAME_MAX} characters")
    if not _QUALIFIED_NAME.fullmatch(name):
        raise invalid(
            path,
            text,
            "name part must consist of alphanumeric characters, '-', '_' or '.', "
            "and must start and end with an alphanumeric character",
        )
    return text


def label_value(value: Any, path: str) -> str:
    text = string(value, path)
    if len(text) > LABEL_VALUE_MAX:
        raise invalid(path, text, f"must be no more than {LABEL_VALUE_MAX} characters")
    if text and not _QUALIFIED_NAME.fullmatch(text):
        raise invalid(
            path,
            text,
            "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
            "and must start and end with an alphanumeric character",
        )
    return text


def labels(value: Any, path: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise wrong_type(path, value, "an object")
    out = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise Invalid(path, f"label keys must be strings, not {show(key)}")
        qualified_name(key, path)
        # YAML turns `app: true` or `tier: 1` into a bool or a number; the API server rejects them too.
        out[key] = label_value(item, path)
    return out


def annotations(value: Any, path: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise wrong_type(path, value, "an object")
    out = {}
    size = 0
    for key, item in value.items():
        if not isinstance(key, str):
            raise Invalid(path, f"annotation keys must be strings, not {show(key)}")
        qualified_name(key.lower(), path)  # the API server lower-cases annotation keys to check them
        out[key] = string(item, f"{path}[{key}]")
        size += len(key) + len(out[key])
    if size > ANNOTATIONS_MAX_BYTES:
        raise Invalid(path, f"Too long: must have at most {ANNOTATIONS_MAX_BYTES} bytes")
    return out


def iana_svc_name(text: str, path: str) -> str:
    if len(text) > IANA_SVC_NAME_MAX:
        raise invalid(path, text, f"must be no more than {IANA_SVC_NAME_MAX} characters")
    if not _IANA_SVC_NAME.fullmatch(text):
        raise invalid(path, text, "must contain only alpha-numeric characters (a-z, 0-9), and hyphens (-)")
    if "--" in text:
        raise invalid(path, text, "must not contain consecutive hyphens")
    if not any("a" <= c <= "z" for c in text):
        raise invalid(path, text, "must contain at least one letter (a-z)")
    return text


def port_number(value: Any, path: str) -> int:
    number = integer(value, path)
    if not 1 <= number <= 65535:
        raise invalid(path, number, "must be between 1 and 65535, inclusive")
    return number


# ------------------------------------------------------------------ selectors

SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def label_selector(value: Any, path: str) -> dict[str, Any]:
    """metav1.LabelSelector, checked as ValidateLabelSelector does; returned normalised."""
    sel = obj(value, path, ("matchLabels", "matchExpressions"))
    out: dict[str, Any] = {}
    if "matchLabels" in sel:
        out["matchLabels"] = labels(sel["matchLabels"], f"{path}.matchLabels")
    exprs = []
    for i, item in enumerate(array(sel.get("matchExpressions"), f"{path}.matchExpressions")):
        where = f"{path}.matchExpressions[{i}]"
        req = obj(item, where, ("key", "operator", "values"))
        if "key" not in req:
            raise required(f"{where}.key")
        key = qualified_name(req["key"], f"{where}.key")
        if "operator" not in req:
            raise required(f"{where}.operator")
        op = string(req["operator"], f"{where}.operator")
        if op not in SELECTOR_OPERATORS:
            raise Invalid(f"{where}.operator", f"Invalid value: {show(op)}: not a valid selector operator")
        values = [label_value(v, f"{where}.values[{j}]") for j, v in enumerate(array(req.get("values"), f"{where}.values"))]
        if op in ("In", "NotIn") and not values:
            raise Invalid(f"{where}.values", "Required value: must be specified when `operator` is 'In' or 'NotIn'")
        if op in ("Exists", "DoesNotExist") and values:
            raise Invalid(
                f"{where}.values", "Forbidden: may not be specified when `operator` is 'Exists' or 'DoesNotExist'"
            )
        expr: dict[str, Any] = {"key": key, "operator": op}
        if values:
            expr["values"] = values
        exprs.append(expr)
    if exprs:
        out["matchExpressions"] = exprs
    return out


# ------------------------------------------------------------------ networks

PROTOCOLS = ("TCP", "UDP", "SCTP")


def cidr(value: Any, path: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """A CIDR as the API server's ParseCIDRSloppy takes it (host bits may be set)."""
    text = string(value, path)
    # a zone (fe80::%eth0/64): Python's ip_network takes one, the API server's ParseCIDR and
    # nftables do not (it would reach the compiled rule and fail the node's policy sync)
    if "/" not in text or "%" in text:
        raise invalid(path, text, "must be a valid CIDR (e.g. 10.0.0.0/8 or 2001:db8::/32)")
    address, _, length = text.partition("/")
    # A prefix length only: ip_network would take a netmask (10.0.0.0/255.0.0.0) or a hostmask
    # (10.0.0.0/0.0.0.255, read as /24), which the API server refuses.  Leading zeros, as many
    # as there are, as Go's dtoi reads them ("/008" is /8; int() refuses over 4300 digits).
    bits = whole_number(length, 3, zeros=True)
    if bits is None:
        raise invalid(path, text, "must be a valid CIDR (e.g. 10.0.0.0/8 or 2001:db8::/32)")
    text = f"{address}/{bits}"
    try:
        if ":" not in address and address.count(".") == 3:
            # IPv4 octets with leading zeros, which ParseCIDRSloppy reads as decimal (010 is 10,
            # 00000000010 too: no limit on the zeros) and Python refuses: the API server takes
            # "010.0.0.0/8" (strict validation off).  More than three digits after them: invalid.
            octets = [whole_number(o, 3, zeros=True) for o in address.split(".")]
            if None not in octets:
                text = ".".join(map(str, octets)) + f"/{bits}"
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise invalid(path, value, "must be a valid CIDR (e.g. 10.0.0.0/8 or 2001:db8::/32)") from None


def protocol(value: Any, path: str) -> str:
    text = string(value, path)
    if text not in PROTOCOLS:
        raise unsupported(path, text, PROTOCOLS)
    return text

