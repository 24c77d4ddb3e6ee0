"""``agentd apply | get | delete | label``: Kubernetes manifests in and out of etcd, kubectl-style.

These talk to etcd directly (as calicoctl does with an etcd datastore), with the ``[etcd]``
settings of the agent's configuration: ``--config`` (default ``$AGENTD_CONFIG``, else
/etc/agentd/agentd.toml; a missing default file means the defaults), ``--set
etcd.endpoints=[...]`` or ``AGENTD_ETCD_ENDPOINTS``.  No agent needs to be running.

Every problem is one line on stderr and a non-zero exit; nothing is written unless every
document of an ``apply`` is valid, also against what etcd holds (cluster IPs and node ports
taken, immutable fields): every object is checked before the first transaction.  Only a race
with another writer can stop a large apply (more than one transaction) part way: the objects
already written are then printed as usual, and the error says the apply was partial.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from . import kinds, manifests
from .kinds import Kind
from .store import Applied, PartialApply, ResourceStore, StoreError
from .ingress import load_balancer
from .validation import Invalid, dns1123_label, label_value, qualified_name

COMMANDS = ("apply", "get", "delete", "label")
ETCD_TIMEOUT = 10.0
MAX_MANIFEST_BYTES = 3 * 1024 * 1024  # the API server's request limit: /dev/zero is not read for ever


def add_commands(sub: Any, config_args: Any) -> None:
    sp = sub.add_parser("apply", help="create or update resources from Kubernetes YAML/JSON manifests")
    sp.add_argument("-f", "--filename", required=True, action="append", metavar="FILE",
                    help="manifest file, or - for stdin (repeatable)")
    sp.add_argument("-n", "--namespace", help="namespace for objects that name none (default: default)")
    config_args(sp)

    sp = sub.add_parser("get", help="list or show resources (namespaces, networkpolicies, pods, services, endpointslices, "
                                    "ingresses, ingressclasses, secrets, configmaps)")
    sp.add_argument("kind", metavar="KIND",
                    help="namespaces|ns, networkpolicies|netpol, pods|po, services|svc, endpointslices, ingresses|ing, "
                         "ingressclasses, secrets, configmaps|cm")
    sp.add_argument("name", nargs="?", metavar="[NAMESPACE/]NAME")
    scope = sp.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", help="only this namespace")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="every namespace (the default without -n; as kubectl's -A)")
    sp.add_argument("-o", "--output", choices=["table", "yaml", "json"], default="table")
    config_args(sp)

    sp = sub.add_parser("delete", help="delete one resource")
    sp.add_argument("kind", metavar="KIND")
    sp.add_argument("name", metavar="[NAMESPACE/]NAME")
    sp.add_argument("-n", "--namespace")
    config_args(sp)

    sp = sub.add_parser("label", help="set (k=v) or remove (k-) labels of a pod or namespace")
    sp.add_argument("kind", metavar="KIND")
    sp.add_argument("name", metavar="[NAMESPACE/]NAME")
    sp.add_argument("labels", nargs="+", metavar="KEY=VALUE|KEY-")
    sp.add_argument("-n", "--namespace")
    sp.add_argument("--overwrite", action="store_true", help="allow changing the value of an existing label")
    config_args(sp)


def run(args: argparse.Namespace, cfg: Any) -> int:
    """Run one resource command with the loaded configuration ``cfg``; returns the exit status."""
    args.ingress_configmap = cfg.ingress.configmap
    try:
        plan = _prepare(args)
    except (Invalid, manifests.ManifestError, OSError) as err:
        return _fail(args.command, err)
    try:
        return asyncio.run(_run(args, cfg, plan))
    except (StoreError, Invalid) as err:
        return _fail(args.command, err)


def _fail(command: str, err: BaseException) -> int:
    text = str(err) if not isinstance(err, OSError) else f"{err.filename}: {err.strerror or err}"
    sys.stderr.write(f"agentd {command}: {text}\n")
    return 1


def _prepare(args: argparse.Namespace) -> Any:
    """Everything that can be checked before talking to etcd."""
    if args.command == "apply":
        objs: list[Any] = []
        seen: dict[Any, Any] = {}  # across every -f: the same object twice is one mistake
        for path in args.filename:
            source = "stdin" if path == "-" else path
            text = _read(path, source)
            docs = manifests.read(text, source)
            objs += manifests.validate_all(
                docs, source, namespace=args.namespace, ingress_configmap=args.ingress_configmap, seen=seen
            )
        return objs
    kind = kinds.lookup(args.kind)
    # None: get without a name (all); "" is a name, refused by the kind's name check
    target = _target(kind, args.name, args.namespace) if args.name is not None else None
    if args.command == "delete" and kind.writer is not None:
        raise Invalid("", f"{kind.plural} are written by {kind.writer}")
    changes = _label_changes(args.labels) if args.command == "label" else None
    if args.command == "label" and kind not in (kinds.POD, kinds.NAMESPACE):
        raise Invalid("", f"labels of {kind.plural} are changed with agentd apply")
    return kind, target, changes


def _read(path: str, source: str) -> str:
    """The manifest at ``path`` (``-``: stdin) as text; ManifestError unless it is UTF-8 and
    at most MAX_MANIFEST_BYTES (a pipe or FIFO too: read up to one byte more, no further).
    Bytes, decoded here: stdin's own decoding depends on the locale (and lets bad bytes
    through as surrogates that fail later, unnamed)."""
    too_big = manifests.ManifestError(f"{source}: larger than {MAX_MANIFEST_BYTES} bytes")
    if path == "-":
        stdin = getattr(sys.stdin, "buffer", None)
        if stdin is None:  # already text (a test's or an embedder's stdin)
            text = sys.stdin.read(MAX_MANIFEST_BYTES + 1)
            if len(text.encode("utf-8", "surrogatepass")) > MAX_MANIFEST_BYTES:
                raise too_big
            return text
        data = stdin.read(MAX_MANIFEST_BYTES + 1)
    else:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise too_big
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise manifests.ManifestError(f"{source}: not valid UTF-8 (byte {e.start})") from None


def _target(kind: Kind, text: str, namespace: str | None) -> tuple[str, str]:
    ns, slash, name = text.rpartition("/")
    if not kind.namespaced:
        if slash:
            raise Invalid("", f"{kind.plural} are not namespaced: give NAME, not {text!r}")
        return "", kind.name_check(text, "name")
    if slash and namespace and ns != namespace:
        raise Invalid("", f"{text!r} names namespace {ns!r} but --namespace is {namespace!r}")
    ns = ns if slash else (namespace or kinds.DEFAULT_NAMESPACE)
    return dns1123_label(ns, "namespace"), kind.name_check(name, "name")


def _label_changes(items: list[str]) -> dict[str, str | None]:
    """KEY=VALUE and KEY- arguments; a key given twice is refused (kubectl: "can not both
    modify and remove a label in the same command"), not the last one silently winning."""
    changes: dict[str, str | None] = {}
    given: dict[str, str] = {}
    for item in items:
        if item.endswith("-") and "=" not in item:
            key = qualified_name(item[:-1], f"label {item!r}")
            value = None
        else:
            key, eq, text = item.partition("=")
            if not eq:
                raise Invalid("", f"label {item!r}: expected KEY=VALUE or KEY- (to remove it)")
            key = qualified_name(key, f"label {item!r}")
            value = label_value(text, f"label {item!r}")
        if key in given:
            raise Invalid("", f"label {item!r}: label {key!r} is also changed by {given[key]!r}: "
                              "give each label once in a command")  # fmt: skip
        given[key] = item
        changes[key] = value
    return changes


async def _run(args: argparse.Namespace, cfg: Any, plan: Any) -> int:
    from agentd.datastore.store import Datastore

    e = cfg.etcd
    ds = Datastore(
        e.endpoints,
        e.prefix,
        lease_ttl=e.lease_ttl,
        ca=str(e.ca) if e.ca else None,
        cert=str(e.cert) if e.cert else None,
        key=str(e.key) if e.key else None,
    )
    store = ResourceStore(ds, timeout=ETCD_TIMEOUT)
    try:
        await ds.connect(timeout=ETCD_TIMEOUT)
        if args.command == "apply" and any(o["kind"] == "Service" for o in plan):
            # Cluster IPs come from the cluster's range (the config in etcd; ours until one is stored).
            cluster = await ds.get_cluster_config(timeout=ETCD_TIMEOUT)
            store.service_cidr = cluster.service_cidr if cluster is not None else cfg.network.service_cidr
        if args.command == "apply":
            try:
                written = await store.apply(plan)
            except PartialApply as err:  # a race after the first transaction: say what was written
                for applied in err.applied:
                    print(_applied_line(applied))
                raise
            for applied in written:
                print(_applied_line(applied))
            return 0
        kind, target, changes = plan
        if args.command == "get":
            return await _get(store, kind, target, args)
        if args.command == "delete":
            assert target is not None
            await store.delete(kind, *target)
            print(f"{_ref(kind)}/{target[1]} deleted")
            return 0
        assert target is not None
        _, changed = await store.label(kind, *target, changes, overwrite=args.overwrite)
        print(f"{_ref(kind)}/{target[1]} {'labeled' if changed else 'not labeled'}")
        return 0
    except Exception as err:
        if isinstance(err, (StoreError, Invalid)):
            raise
        from agentd.datastore.store import DatastoreError

        if isinstance(err, DatastoreError):
            raise StoreError(str(err)) from None
        import aetcd
        import grpc

        if isinstance(err, (aetcd.ClientError, grpc.aio.AioRpcError)):
            # Not transient (those the datastore retried until its deadline): etcd refused the
            # request itself -- no permission on the prefix, a request it calls invalid.
            from agentd.datastore.etcd import describe

            raise StoreError(f"etcd refused the request: {describe(err)}") from None
        raise
    finally:
        await ds.close()


def _ref(kind: Kind) -> str:
    group = kind.api_version.rpartition("/")[0]
    return f"{kind.kind.lower()}.{group}" if group else kind.kind.lower()


def _applied_line(applied: Applied) -> str:
    kind = kinds.KINDS[applied.obj["kind"]]
    return f"{_ref(kind)}/{applied.obj['metadata']['name']} {applied.outcome}"


async def _get(store: ResourceStore, kind: Kind, target: tuple[str, str] | None, args: argparse.Namespace) -> int:
    if target is not None:
        obj = await store.get(kind, *target)
        if obj is None:
            ns, name = target
            where = f' in namespace "{ns}"' if kind.namespaced else ""
            raise StoreError(f'{kind.plural} "{name}" not found{where}')
        objs = [obj]
    else:
        objs = await store.list(kind, args.namespace)
    if kind is kinds.INGRESS and objs:  # status.loadBalancer: the nodes serving each one now
        classes, nodes = await store.list(kinds.INGRESS_CLASS), await store.ingress_nodes()
        for o in objs:
            o["status"] = {"loadBalancer": {"ingress": load_balancer(o, classes, nodes)}}
    if args.output in ("yaml", "json"):
        sys.stdout.write(manifests.dump(objs, args.output, as_list=target is None))
        return 0
    if not objs:
        where = f" in {args.namespace} namespace" if args.namespace and kind.namespaced else ""
        sys.stderr.write(f"No resources found{where}.\n")
        return 0
    print(plain_table(list(kind.columns), [kind.row(o) for o in objs]))
    return 0


def plain_table(headers: list[str], rows: list[list[str]]) -> str:
    """kubectl's table: left-aligned columns, three spaces apart, no borders."""
    widths = [max(len(h), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    lines = ["   ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [headers, *rows]]
    return "\n".join(lines)
