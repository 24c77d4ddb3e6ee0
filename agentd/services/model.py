"""What every node serves: Services with their endpoints, from the resources in etcd.  Pure.

A Service with a selector takes its endpoints from the pod records (the NetworkPolicy
issue's workload endpoints, every node's): every pod of its namespace whose labels match,
each a ready endpoint, its port the service port's ``targetPort`` (a number, or the name of
one of the pod's container ports with the same protocol; a pod without that name is not an
endpoint of that port, as in Kubernetes), its ``hostname`` the pod's ``spec.hostname`` when the
pod's ``spec.subdomain`` is the Service's name (as Kubernetes' EndpointSlice controller gives it).  A Service without a selector takes them from the
EndpointSlices labelled ``kubernetes.io/service-name: <service>`` in its namespace (each
slice port by name, ``""`` for an unnamed service port), with their conditions and ``hostname``.

:func:`build` gives one :class:`ServicePort` per (service, port, IP family): the unit the
data path programs.  A dual-stack Service is two of each: its IPv4 cluster IP with the IPv4
addresses of its endpoints, its IPv6 one with their IPv6 addresses (as kube-proxy runs one
proxier per family): a selector takes each pod's address of the family, EndpointSlices count
for the family of their ``addressType``.  A headless Service has one per family too, without
a cluster IP (DNS gives its endpoints of each family).  Which endpoints take new connections is :meth:`ServicePort.usable`: the ready
ones; when none is ready, the serving ones that are terminating (Kubernetes' "terminating
endpoints" fallback, KEP-1669), so a rolling update does not black-hole a service.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from agentd.resources import ipfamilies
from agentd.resources.service import SERVICE_NAME_LABEL, endpoint_ready, endpoint_serving, endpoint_terminating

Obj = Mapping[str, Any]


@dataclass(frozen=True, order=True)
class Endpoint:
    ip: str
    port: int
    node: str | None = None
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    pod: str | None = None  # "namespace/name" of a pod record
    # An EndpointSlice endpoint's ``hostname`` ("": none), or a selected pod's ``spec.hostname``
    # when its ``spec.subdomain`` is the Service: a headless Service gives it the DNS name
    # ``<hostname>.<service>.<namespace>.svc.<domain>`` (a StatefulSet's pods have theirs).
    hostname: str = ""


@dataclass(frozen=True)
class ServicePort:
    namespace: str
    service: str
    port_name: str  # "" for the single unnamed port
    protocol: str  # TCP | UDP | SCTP
    port: int
    cluster_ip: str | None  # None: headless (no virtual IP)
    node_port: int | None
    affinity_timeout: int | None  # ClientIP affinity (seconds), None: none
    internal_local: bool  # internalTrafficPolicy Local: this node's endpoints only, for the cluster IP
    external_local: bool  # externalTrafficPolicy Local: this node's endpoints only, for the node port
    endpoints: tuple[Endpoint, ...]
    family: int = 4  # the IP version of its cluster IP and endpoints
    primary: bool = True  # of the Service's primary family (spec.ipFamilies[0]: its clusterIP's)
    created: float = float("inf")  # the Service's creationTimestamp (seconds; none: inf): the older of two claiming one VIP or node port wins

    @property
    def key(self) -> tuple[str, str, str, int, int]:
        return (self.namespace, self.service, self.protocol, self.port, self.family)

    @property
    def l4(self) -> str:
        return self.protocol.lower()

    def usable(self, node: str | None = None) -> tuple[Endpoint, ...]:
        """The endpoints new connections go to (``node``: only that node's)."""
        mine = [e for e in self.endpoints if node is None or e.node == node]
        ready = [e for e in mine if e.ready]
        if ready:
            return tuple(sorted(set(ready), key=order))
        return tuple(sorted({e for e in mine if e.serving and e.terminating}, key=order))

    def cluster_ip_endpoints(self, node: str | None) -> tuple[Endpoint, ...]:
        """Those new connections to its cluster IP go to on ``node`` (internalTrafficPolicy)."""
        return self.usable(node) if self.internal_local else self.usable()

    def node_port_endpoints(self, node: str | None) -> tuple[Endpoint, ...]:
        """Those new connections to its node port from outside ``node`` go to
        (externalTrafficPolicy; from the node itself it takes every usable one)."""
        return self.usable(node) if self.external_local else self.usable()

    def short_circuit_endpoints(self, node: str | None) -> tuple[Endpoint, ...]:
        """Those new connections to its node port from ``node`` itself or its pods go to:
        every usable one, also under externalTrafficPolicy Local -- kube-proxy's short-circuit
        to its cluster policy chain (agentd.services.compiler): the ready ones wherever they
        are, so this node's terminating ones take none while others are ready (KEP-1669), as
        through the cluster IP.  (``node`` does not change it: the same for every node.)"""
        return self.usable()


# A headless Service without ports still has a DNS name, its endpoints' addresses (CoreDNS
# gives it a port of its own for that, -1): this one, port 0, stands for "every address".
NO_PORTS = {"name": "", "protocol": "TCP", "port": 0, "targetPort": 0}


def build(services: Iterable[Obj], slices: Iterable[Obj], pods: Iterable[Obj]) -> list[ServicePort]:
    """Every (service, port) with its endpoints."""
    by_service: dict[tuple[str, str], list[Obj]] = {}
    for s in slices:
        name = (s["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL)
        if name:
            by_service.setdefault((s["metadata"]["namespace"], name), []).append(s)
    pods_by_ns: dict[str, list[Obj]] = {}
    for p in pods:
        pods_by_ns.setdefault(p["metadata"]["namespace"], []).append(p)
    out = []
    for svc in services:
        meta, spec = svc["metadata"], svc["spec"]
        ns = meta["namespace"]
        selector = spec.get("selector") or {}
        timeout = (spec.get("sessionAffinityConfig") or {}).get("clientIP", {}).get("timeoutSeconds")
        vips = ipfamilies.cluster_ips(spec)
        created = _created(meta)
        for index, family in enumerate(ipfamilies.families_of(spec)):
            version = ipfamilies.VERSION[family]
            cluster_ip = None
            if not ipfamilies.headless(spec):
                if index >= len(vips):
                    continue  # no address of this family (yet): nothing to translate
                cluster_ip = vips[index]
            for port in spec.get("ports") or ([NO_PORTS] if ipfamilies.headless(spec) else []):
                if selector:
                    endpoints = _from_pods(port, selector, pods_by_ns.get(ns, []), version, meta["name"])
                else:
                    endpoints = _from_slices(port, by_service.get((ns, meta["name"]), []), family)
                out.append(
                    ServicePort(
                        namespace=ns, service=meta["name"], port_name=port.get("name", ""), protocol=port["protocol"],
                        port=port["port"], cluster_ip=cluster_ip,
                        node_port=port.get("nodePort") if spec["type"] == "NodePort" else None,
                        affinity_timeout=timeout if spec.get("sessionAffinity") == "ClientIP" else None,
                        internal_local=spec.get("internalTrafficPolicy") == "Local",
                        external_local=spec.get("externalTrafficPolicy") == "Local",
                        endpoints=unique(endpoints), family=version, primary=index == 0, created=created,
                    )
                )  # fmt: skip
    return out


def order(e: Endpoint) -> tuple[Any, ...]:
    """The order of endpoints (a slot's, a listing's): by address and port, then the rest;
    explicit, as one without a node (None) and one with a node cannot be compared field by field."""
    return (e.ip, e.port, e.node or "", e.ready, e.serving, e.terminating, e.pod or "", e.hostname)


def unique(endpoints: Iterable[Endpoint]) -> tuple[Endpoint, ...]:
    """One endpoint per address and port, as kube-proxy keeps one (EndpointSlices may list an
    address twice, in one slice or two, with other conditions or without ``nodeName``): the
    ready one, else a serving one, else a non-terminating one (then the first in
    :func:`order`), with the node, pod and hostname the other copy names where it names none."""
    best: dict[tuple[str, int], Endpoint] = {}
    for e in endpoints:
        had = best.get((e.ip, e.port))
        if had is None:
            best[(e.ip, e.port)] = e
            continue
        keep, other = sorted((had, e), key=lambda x: (not x.ready, not x.serving, x.terminating, order(x)))
        best[(e.ip, e.port)] = replace(keep, node=keep.node or other.node, pod=keep.pod or other.pod,
                                       hostname=keep.hostname or other.hostname)  # fmt: skip
    return tuple(sorted(best.values(), key=order))


def _created(meta: Obj) -> float:
    try:
        return float(calendar.timegm(time.strptime(meta.get("creationTimestamp") or "", "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return float("inf")


def matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


class PodIndex:
    """Pod records by namespace and by label (``key=value``), kept as records come and go, so
    that a Service's selector is matched against the pods carrying one of its labels (the
    fewest), not against every pod of its namespace: a full rebuild of the table costs the
    pods, not Services x pods.  :meth:`candidates` gives them in the order :meth:`namespace`
    does (the order records were last put), so :func:`build` gives the same endpoints from
    them as from the whole namespace.  A pod whose labels are not a mapping of strings (a
    record no selector should match, kept as it is) is a candidate of every selector."""

    def __init__(self) -> None:
        self._seq = 0
        self._by_ns: dict[str, dict[str, tuple[int, Obj]]] = {}  # namespace -> name -> (order, record)
        self._by_label: dict[tuple[str, str, str], dict[str, None]] = {}  # (ns, key, value) -> names, in order
        self._odd: dict[str, dict[str, None]] = {}  # namespace -> pods whose labels cannot be indexed

    @staticmethod
    def _labels(pod: Obj) -> Mapping[str, str] | None:
        meta = pod.get("metadata") if isinstance(pod, Mapping) else None
        labels = (meta.get("labels") or {}) if isinstance(meta, Mapping) else None
        if isinstance(labels, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            return labels
        return None

    def put(self, ns: str, name: str, pod: Obj) -> None:
        self.drop(ns, name)
        self._seq += 1
        self._by_ns.setdefault(ns, {})[name] = (self._seq, pod)
        labels = self._labels(pod)
        if labels is None:
            self._odd.setdefault(ns, {})[name] = None
            return
        for k, v in labels.items():
            self._by_label.setdefault((ns, k, v), {})[name] = None

    def drop(self, ns: str, name: str) -> None:
        pods = self._by_ns.get(ns)
        had = pods.pop(name, None) if pods is not None else None
        if had is None:
            return
        if not pods:
            del self._by_ns[ns]
        labels = self._labels(had[1])
        groups = [(self._odd, ns)] if labels is None else [(self._by_label, (ns, k, v)) for k, v in labels.items()]
        for index, key in groups:
            group = index[key]  # type: ignore[index]
            del group[name]
            if not group:
                del index[key]  # type: ignore[arg-type]

    def namespace(self, ns: str) -> list[Obj]:
        """Every pod of ``ns``."""
        return [pod for _, pod in self._by_ns.get(ns, {}).values()]

    def candidates(self, ns: str, selector: Any) -> list[Obj]:
        """The pods of ``ns`` that may match ``selector`` (those carrying its rarest label, and
        the unindexed ones); every pod of ``ns`` for a selector that is not a mapping of strings."""
        if not isinstance(selector, Mapping) or not selector or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in selector.items()):
            return self.namespace(ns)
        pods = self._by_ns.get(ns, {})
        names: dict[str, None] | None = None
        for k, v in selector.items():
            group = self._by_label.get((ns, k, v), {})
            if names is None or len(group) < len(names):
                names = group
            if not names:
                break
        odd = self._odd.get(ns, {})
        chosen = [pods[n] for n in (names or {})] + [pods[n] for n in odd]
        if odd:
            chosen.sort(key=lambda x: x[0])
        return [pod for _, pod in chosen]


def _from_pods(port: Obj, selector: Mapping[str, str], pods: list[Obj], version: int, service: str) -> list[Endpoint]:
    """The pods of ``selector`` as endpoints of ``port`` of Service ``service`` (of their namespace)."""
    out = []
    target = port["targetPort"]
    for pod in pods:
        ip = _pod_address(pod, version)
        if not ip or not matches(selector, pod["metadata"].get("labels") or {}):
            continue
        number = target if isinstance(target, int) else _named_port(pod, target, port["protocol"])
        if number is None:
            continue
        name = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        out.append(Endpoint(ip, number, pod["spec"].get("nodeName"), pod=name, hostname=_hostname(pod, service)))
    return out


def _hostname(pod: Obj, service: str) -> str:
    """The pod's endpoint's ``hostname`` for Service ``service``: its ``spec.hostname`` when its
    ``spec.subdomain`` names that Service, else none -- as Kubernetes' EndpointSlice controller
    sets it (ShouldSetHostname), which gives the pod ``<hostname>.<service>.<ns>.svc.<domain>``."""
    spec = pod["spec"]
    hostname = spec.get("hostname") or ""
    return hostname if hostname and spec.get("subdomain") == service else ""


def _pod_address(pod: Obj, version: int) -> str | None:
    """The pod's address of IP ``version`` (podIPs holds one of each family the pod has)."""
    status = pod.get("status") or {}
    for entry in status.get("podIPs") or ([{"ip": status["podIP"]}] if status.get("podIP") else []):
        if (":" in entry["ip"]) == (version == 6):
            return str(entry["ip"])
    return None


def _named_port(pod: Obj, name: str, protocol: str) -> int | None:
    for container in pod["spec"].get("containers", []):
        for p in container.get("ports", []):
            if p.get("name") == name and p["protocol"] == protocol:
                return int(p["containerPort"])
    return None


def _from_slices(port: Obj, slices: list[Obj], family: str) -> list[Endpoint]:
    out = []
    for s in slices:
        if s.get("addressType", "IPv4") != family:
            continue  # the slices of the other family are the other ServicePort's
        if port is NO_PORTS:  # every address of the slice, whatever its ports
            out.extend(Endpoint(e["addresses"][0], 0, e.get("nodeName"), ready=endpoint_ready(e),
                                serving=endpoint_serving(e), terminating=endpoint_terminating(e),
                                hostname=e.get("hostname", ""))
                       for e in s.get("endpoints", []))
            continue
        for sp in s.get("ports", []):
            if sp.get("name", "") != port.get("name", "") or sp["protocol"] != port["protocol"] or "port" not in sp:
                continue
            for e in s.get("endpoints", []):
                out.append(
                    Endpoint(
                        e["addresses"][0], sp["port"], e.get("nodeName"),
                        ready=endpoint_ready(e), serving=endpoint_serving(e), terminating=endpoint_terminating(e),
                        hostname=e.get("hostname", ""),
                    )
                )  # fmt: skip
    return out
