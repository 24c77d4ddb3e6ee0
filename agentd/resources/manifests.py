"""Manifests in and out: Kubernetes YAML or JSON, one document or many, and ``kind: List``.

Text that is JSON (a stream of JSON values) is read as JSON; the rest with PyYAML's safe
loader, with the strictness the API server's decoder has and PyYAML lacks: a key given twice
in one mapping is an error (kubectl: "mapping key already defined"), not a silent "last one
wins"; no YAML 1.1 base-60 numbers (``10:30`` is a string, as in YAML 1.2, not 630); and
aliases may not expand a manifest by more than MAX_ALIAS_NODES nodes (the API server refuses
"excessive aliasing": a kilobyte of anchors of lists of aliases can stand for gigabytes).
Every problem is one line naming the source, the document and, for syntax errors, the line
and column.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from . import ingress_settings, kinds
from .validation import Invalid

try:  # libyaml's C loader when PyYAML was built with it
    _BaseLoader: type = yaml.CSafeLoader  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover
    _BaseLoader = yaml.SafeLoader


class ManifestError(ValueError):
    """A manifest that cannot be read or is invalid; the message is one line."""


MAX_ALIAS_NODES = 100_000  # nodes that aliases may add to a manifest source, beyond those written


class _StrictLoader(_BaseLoader):  # type: ignore[misc, valid-type]
    pass


# PyYAML's YAML 1.1 int and float resolvers without the base-60 forms (YAML 1.2 and the API
# server's decoder have none: ``10:30`` is the string "10:30", not 630).
_YAML_INT, _YAML_FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_NO_BASE60 = {
    _YAML_INT: re.compile(
        r"""^(?:[-+]?0b[0-1_]+
        |[-+]?0[0-7_]+
        |[-+]?(?:0|[1-9][0-9_]*)
        |[-+]?0x[0-9a-fA-F_]+)$""",
        re.VERBOSE,
    ),
    _YAML_FLOAT: re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?
        |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.VERBOSE,
    ),
}
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, _NO_BASE60.get(tag, regexp)) for tag, regexp in resolvers]
    for first, resolvers in _BaseLoader.yaml_implicit_resolvers.items()
}


def _mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    out: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "found an unhashable key", key_node.start_mark
            ) from None
        if key in out:
            raise yaml.constructor.ConstructorError(
                None, None, f"mapping key {json.dumps(key, default=str)} already defined", key_node.start_mark
            )
        out[key] = loader.construct_object(value_node, deep=deep)
    return out


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


@dataclass(frozen=True)
class Document:
    where: str  # "document 2" or "document 2, item 3" (of a kind: List)
    raw: dict[str, Any]


def _yaml_error(source: str, err: yaml.YAMLError) -> ManifestError:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or getattr(err, "context", None) or str(err)
    where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark is not None else ""
    text = " ".join(str(problem).split())
    return ManifestError(f"{source}:{where} {text}")


def read(text: str, source: str = "-") -> list[Document]:
    """Every object in ``text`` (YAML or JSON; ``---``-separated documents; ``kind: List``)."""
    docs: list[Document] = []
    try:
        loaded = _json_stream(text, source)
        if loaded is None:
            loaded = list(yaml.load_all(text, Loader=_StrictLoader))  # noqa: S506 - a safe loader
            _check_aliases(loaded, source)
    except yaml.YAMLError as err:
        raise _yaml_error(source, err) from None
    except (RecursionError, ValueError) as err:  # absurd nesting; digits beyond int's limit
        if isinstance(err, ManifestError):
            raise
        raise ManifestError(f"{source}: cannot read: {type(err).__name__}") from None
    for position, doc in enumerate((d for d in loaded if d is not None), start=1):
        where = f"document {position}"
        if isinstance(doc, dict) and doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            docs += [_document(item, f"{where}, item {i}", source) for i, item in enumerate(doc["items"], start=1)]
        else:
            docs.append(_document(doc, where, source))
    if not docs:
        raise ManifestError(f"{source}: no objects to apply")
    return docs


def _json_stream(text: str, source: str) -> list[Any] | None:
    """The values of ``text`` if it is JSON (one value or several, whitespace between), else
    None (then it is read as YAML: a flow-style YAML mapping starts with ``{`` too).  JSON's
    own rules, not YAML 1.1's: surrogate-pair escapes, ``8e1`` is a number."""
    if text.lstrip()[:1] not in ("{", "["):
        return None

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise ManifestError(f"{source}: mapping key {json.dumps(key)} already defined")
            out[key] = value
        return out

    decoder = json.JSONDecoder(object_pairs_hook=pairs)
    values, at, end = [], 0, len(text)
    try:
        while True:
            while at < end and text[at] in " \t\r\n":
                at += 1
            if at == end:
                return values
            value, at = decoder.raw_decode(text, at)
            values.append(value)
    except json.JSONDecodeError:
        return None


def _check_aliases(loaded: list[Any], source: str) -> None:
    """Refuse YAML whose aliases stand for more than MAX_ALIAS_NODES nodes beyond those
    written.  Each object is counted once through an identity memo (linear in what was
    read), a node reached again through an alias counts again; strings count by length."""
    sizes: dict[int, int] = {}  # id of a list or dict: its nodes, aliases expanded
    long_strings: set[int] = set()
    written = 0

    def weight(obj: Any) -> int:
        return 1 + len(obj) // 64 if isinstance(obj, str) else 1

    frames: list[list[Any]] = [[loaded, iter(loaded), 1]]
    path = {id(loaded)}
    while frames:
        frame = frames[-1]
        for child in frame[1]:
            key = id(child)
            if key in sizes:
                frame[2] += sizes[key]
            elif key in path:
                raise ManifestError(f"{source}: an alias refers to a node that holds it")
            elif isinstance(child, (dict, list)):
                frames.append([child, iter([*child.keys(), *child.values()] if isinstance(child, dict) else child), 1])
                path.add(key)
                break
            else:
                w = weight(child)
                frame[2] += w
                if w == 1:
                    written += 1
                elif key not in long_strings:  # a long string once, however often it is aliased
                    long_strings.add(key)
                    written += w
        else:
            frames.pop()
            path.discard(id(frame[0]))
            sizes[id(frame[0])] = frame[2]
            written += 1
            if frames:
                frames[-1][2] += frame[2]
    if sizes[id(loaded)] - written > MAX_ALIAS_NODES:
        raise ManifestError(
            f"{source}: aliases expand this to more than {MAX_ALIAS_NODES} nodes beyond those written "
            "(excessive aliasing)"
        )


def _document(doc: Any, where: str, source: str) -> Document:
    if not isinstance(doc, dict):
        raise ManifestError(f"{source}: {where}: a manifest must be an object, not {type(doc).__name__}")
    return Document(where, doc)


def validate_all(
    docs: Iterable[Document], source: str, *, namespace: str | None = None,
    ingress_configmap: str | None = "kube-system/agentd-ingress",
    seen: dict[tuple[str, str, str], tuple[object, str, str]] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Validate every document (nothing is written unless all are valid); one line on error.
    The ConfigMap ``ingress_configmap`` (NAMESPACE/NAME) holds the Ingress controller's
    settings: its keys are checked too.  ``seen`` (shared by the sources of one apply) maps
    each object already taken to its source and document: the same object twice is refused."""
    out = []
    seen = {} if seen is None else seen
    this_call = object()  # "-f a.yaml -f a.yaml": the same source, another reading of it
    for doc in docs:
        label = _label(doc)
        try:
            given = (doc.raw.get("metadata") or {}).get("namespace") if isinstance(doc.raw.get("metadata"), dict) else None
            if namespace is not None and given not in (None, "", namespace):
                raise Invalid(
                    "metadata.namespace",
                    f"the namespace from the provided object {json.dumps(given)} does not match the namespace "
                    f"{json.dumps(namespace)}; pass --namespace={given} or remove it",
                )
            obj = kinds.validate(doc.raw, default_namespace=namespace or kinds.DEFAULT_NAMESPACE)
            if obj["kind"] == "ConfigMap" and "/".join(kinds.identity(obj)[1:]) == ingress_configmap:
                ingress_settings.parse(obj.get("data"))
        except Invalid as err:
            raise ManifestError(f"{source}: {doc.where}{label}: {err}") from None
        kind = kinds.KINDS[obj["kind"]]
        if kind.writer is not None:
            raise ManifestError(
                f"{source}: {doc.where}{label}: {kind.kind} objects are written by {kind.writer}"
            )
        key = kinds.identity(obj)
        if key in seen:
            call, first, where = seen[key]
            raise ManifestError(
                f"{source}: {doc.where}{label}: the same object is also {where}"
                + ("" if call is this_call else f" of {first}")
            )
        seen[key] = (this_call, source, doc.where)
        out.append(obj)
    return out


def _label(doc: Document) -> str:
    raw = doc.raw
    meta = raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {}
    kind, name, ns = raw.get("kind"), meta.get("name"), meta.get("namespace")
    if not isinstance(kind, str) or not kind:
        return ""
    if isinstance(name, str) and name:
        return f" ({kind} {ns}/{name})" if isinstance(ns, str) and ns else f" ({kind} {name})"
    return f" ({kind})"


# ------------------------------------------------------------------ out


def dump(objs: list[Mapping[str, Any]], fmt: str, *, as_list: bool) -> str:
    """``-o yaml`` / ``-o json``: one object as itself, several (or a listing) as ``kind: List``."""
    data: Any = {"apiVersion": "v1", "kind": "List", "items": list(objs)} if as_list else objs[0]
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
