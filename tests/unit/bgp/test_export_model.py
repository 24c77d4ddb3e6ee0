"""Model-based tests of the export side: what a speaker's neighbours end up holding.

Speaker A originates a random, changing set of IPv4 and IPv6 prefixes (random ORIGIN,
AS_PATH, MED, LOCAL_PREF, RFC 1997 well-known and ordinary communities, large
communities, explicit next hops; single prefixes and bulks that need several UPDATEs)
while sessions are reset, peers are deconfigured and configured again, speakers crash
and come back (graceful restart), freeze past their hold time, ask for a route refresh,
and time passes.  Whenever the network is quiet again, every Adj-RIB-In, Adj-RIB-Out
count and Loc-RIB must be exactly what a small model of RFC 4271 §5/§9.2, RFC 1997 and
RFC 4456 says, with nothing stale left over; every UPDATE on the wire must decode
cleanly and be at most 4096 octets.

Two topologies of three speakers in a MemoryNetwork (float clock, no sockets, no sleeps):

* A and B in AS 65000 and C in AS 65001, fully meshed: A->B iBGP (LOCAL_PREF added, next
  hop kept or self), A->C eBGP (AS prepended, next hop self, MED kept as A set it), and B
  passes A's routes on to C (eBGP, MED not propagated); no copy ever comes back.
* A and B iBGP peers of route reflector R, each a client or not, switching at random;
  B sometimes IPv4-only (RFC 4760: it gets no IPv6 routes).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address
from typing import NamedTuple

from hypothesis import given, settings
from hypothesis import strategies as st

from bgp import Origination, PeerSettings
from bgp.testing import MemoryNetwork, RawHarness, RawPeer, make_speaker, speaker_pair
from bgp.views import peer_views
from proto.attributes import (
    AS_SEQUENCE,
    NO_ADVERTISE,
    NO_EXPORT,
    NO_EXPORT_SUBCONFED,
    AsPath,
    AsPathSegment,
    ClusterList,
    Communities,
    LargeCommunities,
    LocalPref,
    MultiExitDisc,
    NextHop,
    Origin,
    OriginatorId,
    PathAttributes,
)
from proto.errors import ErrorCode
from proto.messages import (
    CodecContext,
    MessageReader,
    MessageType,
    Notification,
    RouteRefresh,
    Update,
)
from proto.nlri import IPV4_UNICAST, IPV6_UNICAST, prefix_from_str, prefix_to_str

FAMILY = {4: IPV4_UNICAST, 6: IPV6_UNICAST}
# A few odd lengths (default route, host routes) and enough /24s and /64s that a bulk of
# them needs more than one 4096-octet UPDATE.
POOL = {
    4: [prefix_from_str(t)[1] for t in ("0.0.0.0/0", "10.0.0.0/8", "192.0.2.1/32", "198.51.100.128/25")]
    + [prefix_from_str(f"10.{i // 256}.{i % 256}.0/24")[1] for i in range(1100)],
    6: [prefix_from_str(t)[1] for t in ("::/0", "2001:db8::1/128", "2001:db8:ffff::/127")]
    + [prefix_from_str(f"2001:db8:{i:x}:1::/64")[1] for i in range(500)],
}
EXPLICIT_NEXT_HOP = {4: IPv4Address("10.9.9.9"), 6: IPv6Address("fd00::99")}
DEFAULT_LOCAL_PREF = 100
CLUSTER_ID = IPv4Address("1.1.1.1")
MAX_UPDATE = 4096


def _name(key: tuple[int, bytes]) -> str:
    return prefix_to_str(FAMILY[key[0]][0], key[1])


# --------------------------------------------------------------- what A originates


@dataclass(frozen=True)
class Spec:
    """The attributes of one origination, as the test thinks of them."""

    origin: int
    asns: tuple[int, ...]
    med: int | None
    local_pref: int | None
    communities: tuple[int, ...]
    large: tuple[tuple[int, int, int], ...]
    explicit_next_hop: bool

    def origination(self, key: tuple[int, int]) -> Origination:
        f, i = key
        nh = EXPLICIT_NEXT_HOP[f] if self.explicit_next_hop else None
        return Origination(FAMILY[f], POOL[f][i], _attributes(self), nh)

    def to_ibgp(self) -> bool:
        return NO_ADVERTISE not in self.communities

    def to_ebgp(self) -> bool:  # RFC 1997: no confederations here, so SUBCONFED is NO_EXPORT
        return not {NO_ADVERTISE, NO_EXPORT, NO_EXPORT_SUBCONFED} & set(self.communities)


@functools.lru_cache(maxsize=1024)
def _attributes(spec: Spec) -> PathAttributes:
    items = [Origin(spec.origin), AsPath((AsPathSegment(AS_SEQUENCE, spec.asns),) if spec.asns else ())]
    if spec.med is not None:
        items.append(MultiExitDisc(spec.med))
    if spec.local_pref is not None:
        items.append(LocalPref(spec.local_pref))
    if spec.communities:
        items.append(Communities(spec.communities))
    if spec.large:
        items.append(LargeCommunities(spec.large))
    return PathAttributes(tuple(items))


_ordinary = st.sampled_from([(65000 << 16) | 1, (65000 << 16) | 2, NO_EXPORT, NO_ADVERTISE, NO_EXPORT_SUBCONFED])
_communities = st.tuples(st.lists(_ordinary, max_size=3), st.one_of(st.just(0), st.integers(1, 250))).map(
    lambda t: tuple(t[0]) + tuple((65010 << 16) | i for i in range(t[1]))
)
_large = st.one_of(st.just(()), st.integers(1, 80).map(lambda n: tuple((4200000000, 1, i) for i in range(n))))
_spec = st.builds(
    Spec,
    origin=st.integers(0, 2),
    # 65001 is C's AS: C must drop those (RFC 4271 §9.1.2), A and B still send them.
    asns=st.lists(st.sampled_from([64512, 65001, 4200000000]), max_size=3).map(tuple),
    med=st.none() | st.sampled_from([0, 7, 2**32 - 1]),
    local_pref=st.none() | st.sampled_from([0, 50, 200]),
    communities=_communities,
    large=_large,
    explicit_next_hop=st.booleans(),
)


# --------------------------------------------------------------- what a receiver holds


class View(NamedTuple):
    """A received path, normalized: which attributes it has and their values."""

    codes: frozenset[int]
    origin: int | None
    as_path: tuple[tuple[int, tuple[int, ...]], ...]
    med: int | None
    local_pref: int | None
    communities: tuple[int, ...]
    large: tuple[tuple[int, int, int], ...]
    originator_id: IPv4Address | None
    cluster_list: tuple[IPv4Address, ...]
    next_hop: object


def _view_of(path) -> View:
    a = path.attributes
    return View(
        frozenset(x.code for x in a),
        a.origin,
        tuple((s.type, s.asns) for s in a.as_path.segments),
        a.med,
        a.local_pref,
        a.communities,
        a.large_communities,
        a.originator_id,
        a.cluster_list,
        path.next_hop,
    )


def _codes(spec: Spec, f: int, med: bool, *extra: int) -> frozenset[int]:
    codes = {1, 2, *extra}
    if f == 4:
        codes.add(3)  # NEXT_HOP for IPv4; IPv6 carries it in MP_REACH_NLRI
    if med:
        codes.add(4)
    if spec.communities:
        codes.add(8)
    if spec.large:
        codes.add(32)
    return frozenset(codes)


def ibgp_view(spec: Spec, f: int, self_next_hop) -> View:
    """A's own route to an internal peer: LOCAL_PREF present (§5.1.5), next hop as configured or self."""
    return View(
        _codes(spec, f, spec.med is not None, 5),
        spec.origin,
        ((AS_SEQUENCE, spec.asns),) if spec.asns else (),
        spec.med,
        DEFAULT_LOCAL_PREF if spec.local_pref is None else spec.local_pref,
        spec.communities,
        spec.large,
        None,
        (),
        EXPLICIT_NEXT_HOP[f] if spec.explicit_next_hop else self_next_hop,
    )


def ebgp_view(spec: Spec, f: int, self_next_hop, *, originator: bool) -> View:
    """To an external peer from AS 65000: AS prepended (§5.1.2), next hop self (§5.1.3), no
    LOCAL_PREF (§5.1.5), MED only from the AS's own speaker that set it (§5.1.4)."""
    med = spec.med if originator else None
    return View(
        _codes(spec, f, med is not None),
        spec.origin,
        ((AS_SEQUENCE, (65000, *spec.asns)),),
        med,
        None,
        spec.communities,
        spec.large,
        None,
        (),
        self_next_hop,
    )


def reflected_view(v: View, originator: IPv4Address) -> View:
    """RFC 4456 §8: ORIGINATOR_ID and CLUSTER_LIST added, everything else (next hop too) kept."""
    return v._replace(codes=v.codes | {9, 10}, originator_id=originator, cluster_list=(CLUSTER_ID, *v.cluster_list))


# --------------------------------------------------------------- the lab


@dataclass(frozen=True)
class Node:
    address: str
    asn: int
    next_hop_v6: IPv6Address | None = None
    cluster_id: IPv4Address | None = None
    families: tuple[int, ...] = (4, 6)

    def self_next_hop(self, f: int):
        return _self_next_hop(self, f)


@functools.lru_cache(maxsize=64)
def _self_next_hop(node: Node, f: int):
    if f == 4:
        return IPv4Address(node.address)
    return node.next_hop_v6 or IPv6Address("::ffff:" + node.address)  # sessions run over IPv4


class Lab:
    """Three speakers in a MemoryNetwork plus what the test says they should hold."""

    def __init__(
        self, nodes: dict[str, Node], links: list[tuple[str, str]], reflector: str | None = None, clients=()
    ) -> None:
        self.nodes = nodes
        self.links = links
        self.reflector = reflector
        self.configured = {d: True for x, y in links for d in ((x, y), (y, x))}
        self.client = {n: n in clients for n in nodes}
        self.origins: dict[tuple[int, int], Spec] = {}
        self._made: dict[tuple[tuple[int, int], Spec], Origination] = {}
        self.largest_update = 0
        self.net = MemoryNetwork()
        self.net.tamper = self._watch
        for name in nodes:
            self._boot(name)

    # ---- plumbing

    def speaker(self, name: str):
        return self.net.speaker(self.nodes[name].address)

    def up(self, x: str, y: str) -> bool:
        return self.configured.get((x, y), False) and self.configured.get((y, x), False)

    def only_shared_families(self, x: str, y: str, views: dict) -> dict:
        """RFC 4760: only the families both OPENs named."""
        shared = set(self.nodes[x].families) & set(self.nodes[y].families)
        return {k: v for k, v in views.items() if k[0] in shared}

    def _settings(self, x: str, y: str) -> PeerSettings:
        n = self.nodes[y]
        return PeerSettings(n.address, n.asn, rr_client=x == self.reflector and self.client[y])

    def _boot(self, name: str, restarting: bool = False) -> None:
        n = self.nodes[name]
        peers = [self._settings(name, y) for (x, y), on in self.configured.items() if x == name and on]
        kw = {}
        if n.next_hop_v6 is not None:
            kw["next_hop_v6"] = n.next_hop_v6
        if n.cluster_id is not None:
            kw["cluster_id"] = n.cluster_id
        if n.families != (4, 6):
            kw["families"] = tuple(FAMILY[f] for f in n.families)
        sp = make_speaker(n.address, n.asn, peers, now=self.net.now, restarting=restarting, **kw)
        if name == "A":
            sp.set_originated(self._originations(), self.net.now)
        self.net.replace(n.address, sp)
        sp.start(self.net.now)

    def _originations(self) -> list[Origination]:
        made = self._made
        out = []
        for item in self.origins.items():
            o = made.get(item)
            if o is None:
                o = made[item] = item[1].origination(item[0])
            out.append(o)
        return out

    def _watch(self, src: str, dst: str, data: bytes) -> bytes:
        """Every byte on the wire, as the MemoryNetwork delivers it (whole messages)."""
        reader = MessageReader(max_message_len=65535)
        reader.feed(data)
        for msg_type, body in reader.messages():
            size = 19 + len(body)
            if msg_type == MessageType.UPDATE:
                self.largest_update = max(self.largest_update, size)
                assert size <= MAX_UPDATE, f"{src}->{dst}: UPDATE of {size} octets"
                update = Update.decode(body)
                assert not update.errors, f"{src}->{dst}: UPDATE with errors {update.errors}"
            elif msg_type == MessageType.NOTIFICATION:
                note = Notification.decode(body)
                # Expected: Cease (deconfigured, configuration change, collision) and the hold
                # timer of a frozen peer.  Anything else means someone sent something wrong.
                assert note.code in (ErrorCode.CEASE, ErrorCode.HOLD_TIMER_EXPIRED), f"{src}->{dst}: {note}"
        assert not reader.buffered, f"{src}->{dst}: {reader.buffered} octets of a partial message"
        return data

    # ---- operations

    def apply(self, op: tuple) -> None:
        kind, now, net = op[0], self.net.now, self.net
        if kind in ("set", "del", "bulk", "unbulk", "scatter"):
            f = op[1]
            if kind == "set":
                self.origins[(f, op[2])] = op[3]
            elif kind == "scatter":  # neighbouring prefixes, each with its own attributes
                for j, spec in enumerate(op[3]):
                    self.origins[(f, op[2] + j)] = spec
            elif kind == "del":
                self.origins.pop((f, op[2]), None)
            else:
                for i in range(op[2], min(op[2] + op[3], len(POOL[f]))):
                    if kind == "bulk":
                        self.origins[(f, i)] = op[4]
                    else:
                        self.origins.pop((f, i), None)
            self.speaker("A").set_originated(self._originations(), now)
        elif kind == "reset":  # the TCP connection dies under both ends (no NOTIFICATION)
            ax, ay = (self.nodes[n].address for n in op[1])
            for (a, conn), (b, bconn) in list(net.links.items()):
                if {a, b} == {ax, ay} and (a, conn) in net.links:
                    del net.links[(a, conn)]
                    net.links.pop((b, bconn), None)
                    net.speaker(a).connection_lost(conn, now)
                    net.speaker(b).connection_lost(bconn, now)
        elif kind == "toggle":  # x deconfigures y (Cease), or configures it again
            x, y = op[1]
            sp = self.speaker(x)
            if self.configured[(x, y)]:
                sp.remove_peer(self.nodes[y].address, now)
            else:
                sp.add_peer(self._settings(x, y), now)
            self.configured[(x, y)] = not self.configured[(x, y)]
        elif kind == "client":  # the reflector's configuration changes a peer's client flag
            assert self.reflector is not None
            self.client[op[1]] = not self.client[op[1]]
            r = self.reflector
            peers = [self._settings(r, y) for (x, y), on in self.configured.items() if x == r and on]
            self.speaker(r).set_peers(peers, now)
        elif kind == "crash":  # killed and restarted at once; A may come back with fewer prefixes
            _, name, restarting, forget = op
            if name == "A" and forget:
                self.origins = {k: v for k, v in self.origins.items() if k[1] % 2 == 0}
            net.crash(self.nodes[name].address)
            self._boot(name, restarting)
        elif kind == "freeze":  # SIGSTOP past the hold time, then SIGCONT
            net.freeze(self.nodes[op[1]].address)
            net.run(duration=100)
            net.freeze(self.nodes[op[1]].address, False)
        elif kind == "time":
            net.run(duration=op[1])
        elif kind == "refresh":  # x asks y for its routes again (RFC 2918)
            (x, y), f = op[1], op[2]
            peer = self.speaker(x).peers.get(self.nodes[y].address)
            if peer is not None and peer.established is not None:
                peer.established.send_messages([RouteRefresh(FAMILY[f][0], 1).encode()], now)
                # Delivered at once: a ROUTE-REFRESH read together with the session's end is
                # test_route_refresh_read_together_with_a_cease below.
                net.run(duration=0)
        else:
            raise AssertionError(op)

    def settle(self) -> None:
        """Run until every configured session is Established with End-of-RIB both ways and no
        graceful-restart state is left (simulated time only)."""
        self.net.run(duration=0)
        self.net.run_until(self._quiet, timeout=900, step=1.0)

    def _quiet(self) -> bool:
        for x, y in self.links:
            if self.up(x, y):
                for a, b in ((x, y), (y, x)):
                    peer = self.speaker(a).peers.get(self.nodes[b].address)
                    if peer is None or peer.established is None:
                        return False
        for name in self.nodes:
            sp = self.speaker(name)
            if sp.initial_sync_pending() or any(p.graceful_restart for p in peer_views(sp)):
                return False
        return True

    # ---- checking

    def adj_in(self, rx: str, tx: str) -> dict[tuple[int, bytes], View]:
        adj = self.speaker(rx).rib.adj_in.get(self.nodes[tx].address)
        out: dict[tuple[int, bytes], View] = {}
        if adj is None:
            return out
        views: dict[int, View] = {}
        for f, family in FAMILY.items():
            for prefix, path in adj.tables.get(family, {}).items():
                assert not path.stale, f"{rx} still holds a stale route from {tx}: {_name((f, prefix))}"
                v = views.get(id(path))
                if v is None:
                    v = views[id(path)] = _view_of(path)
                out[(f, prefix)] = v
        return out

    def check(self, sent: dict, received: dict) -> None:
        """``sent[(rx, tx)]``: what tx's Adj-RIB-Out toward rx must hold (counted);
        ``received[(rx, tx)]``: rx's Adj-RIB-In from tx, for every linked pair (others empty)."""
        for x, y in self.links:
            for rx, tx in ((x, y), (y, x)):
                _assert_same(self.adj_in(rx, tx), received.get((rx, tx), {}), f"{rx}'s Adj-RIB-In from {tx}")
        for (rx, tx), views in sent.items():
            n = self.speaker(tx).adj_out_count(self.nodes[rx].address)
            assert n == len(views), f"{tx}'s Adj-RIB-Out toward {rx}: {n} routes, model says {len(views)}"
        for name in self.nodes:
            want: Counter = Counter()
            for (rx, _), views in received.items():
                if rx == name:
                    want.update(views.keys())
            if name == "A":
                want.update((f, POOL[f][i]) for f, i in self.origins)
            sp = self.speaker(name)
            got = Counter(
                {(f, p): len(sp.rib.candidates(family, p)) for f, family in FAMILY.items() for p, _ in sp.rib.bests(family)}
            )
            assert got == want, f"{name}'s Loc-RIB candidates: {_diff(got, want)}"

    def a_views(self, to_ibgp: bool) -> dict[tuple[int, bytes], View]:
        """What A sends an internal (``to_ibgp``) or an external peer."""
        a = self.nodes["A"]
        out = {}
        views: dict[tuple[Spec, int], View | None] = {}
        for (f, i), spec in self.origins.items():
            v = views.get((spec, f), False)
            if v is False:
                if to_ibgp:
                    v = ibgp_view(spec, f, a.self_next_hop(f)) if spec.to_ibgp() else None
                else:
                    v = ebgp_view(spec, f, a.self_next_hop(f), originator=True) if spec.to_ebgp() else None
                views[(spec, f)] = v
            if v is not None:
                out[(f, POOL[f][i])] = v
        return out


def _diff(got: dict, want: dict) -> str:
    missing = [k for k in want if k not in got]
    extra = [k for k in got if k not in want]
    changed = [k for k in want if k in got and got[k] != want[k]]
    parts = []
    for label, keys in (("missing", missing), ("extra", extra), ("different", changed)):
        if keys:
            shown = ", ".join(_name(k) for k in keys[:4])
            parts.append(f"{len(keys)} {label} ({shown}{', ...' if len(keys) > 4 else ''})")
    if changed:
        k = changed[0]
        parts.append(f"e.g. {_name(k)}: got {got[k]}, want {want[k]}")
    return "; ".join(parts)


def _assert_same(got: dict, want: dict, what: str) -> None:
    if got != want:
        raise AssertionError(f"{what}: {_diff(got, want)}")


# --------------------------------------------------------------- operations

_fam = st.sampled_from([4, 6])
_origination_ops = st.one_of(
    # A handful of indices, so that sets replace and deletes hit.
    st.tuples(st.just("set"), _fam, st.integers(0, 7), _spec),
    st.tuples(st.just("del"), _fam, st.integers(0, 7)),
    st.tuples(st.just("scatter"), _fam, st.integers(0, 7), st.lists(_spec, min_size=2, max_size=6)),
    st.tuples(st.just("bulk"), _fam, st.integers(0, 40), st.sampled_from([1, 30, 470, 1100]), _spec),
    st.tuples(st.just("unbulk"), _fam, st.integers(0, 40), st.sampled_from([1, 30, 470, 1100])),
)


def _session_ops(names: list[str], links: list[tuple[str, str]], reflector: str | None):
    directed = [d for x, y in links for d in ((x, y), (y, x))]
    ops = [
        st.tuples(st.just("reset"), st.sampled_from(links)),
        st.tuples(st.just("toggle"), st.sampled_from(directed)),
        st.tuples(st.just("crash"), st.sampled_from(names), st.booleans(), st.booleans()),
        st.tuples(st.just("freeze"), st.sampled_from(names)),
        st.tuples(st.just("time"), st.sampled_from([0.5, 29.0, 200.0])),
        st.tuples(st.just("refresh"), st.sampled_from(directed), _fam),
    ]
    if reflector is not None:
        ops.append(st.tuples(st.just("client"), st.sampled_from([n for n in names if n != reflector])))
    return st.one_of(*ops)


def _steps(names, links, reflector=None):
    # Each operation is followed either by a check at the next quiet point (True) or, at once,
    # by the next operation (False): changes then land while sessions are down or coming up.
    op = st.one_of(_origination_ops, _session_ops(names, links, reflector))
    return st.lists(st.tuples(op, st.booleans()), max_size=10)


def _run(lab: Lab, steps, model) -> None:
    lab.settle()
    lab.check(*model(lab))
    for op, check in steps + [(("time", 0.5), True)]:
        lab.apply(op)
        if check:
            lab.settle()
            lab.check(*model(lab))
    assert lab.largest_update <= MAX_UPDATE


# --------------------------------------------------------------- iBGP + eBGP

MESH_NODES = {
    "A": Node("10.0.0.1", 65000, next_hop_v6=IPv6Address("fd00::a")),
    "B": Node("10.0.0.2", 65000),
    "C": Node("10.0.0.3", 65001),
}
MESH_LINKS = [("A", "B"), ("A", "C"), ("B", "C")]


def mesh_model(lab: Lab):
    b = lab.nodes["B"]
    ab = lab.a_views(True) if lab.up("A", "B") else {}
    ac = lab.a_views(False) if lab.up("A", "C") else {}
    # B's only path for these prefixes is A's (C's copies carry AS 65000: loops for B).
    bc = {}
    if lab.up("B", "C"):
        for (f, i), spec in lab.origins.items():
            key = (f, POOL[f][i])
            if key in ab and spec.to_ebgp():
                bc[key] = ebgp_view(spec, f, b.self_next_hop(f), originator=False)
    sent = {("B", "A"): ab, ("C", "A"): ac, ("C", "B"): bc}

    def no_loop(views):  # C drops paths with its own AS (RFC 4271 §9.1.2)
        return {k: v for k, v in views.items() if not any(65001 in asns for _, asns in v.as_path)}

    # A, B never hear their routes back: split horizon to A, AS-path loop at A and B.
    received = {("B", "A"): ab, ("C", "A"): no_loop(ac), ("C", "B"): no_loop(bc)}
    return sent, received


@settings(max_examples=100, deadline=None)
@given(_steps(list(MESH_NODES), MESH_LINKS))
def test_ibgp_and_ebgp_export_agrees_with_a_model(steps):
    _run(Lab(MESH_NODES, MESH_LINKS), steps, mesh_model)


# --------------------------------------------------------------- route reflection

RR_NODES = {
    "A": Node("10.0.0.1", 65000),
    "R": Node("10.0.0.2", 65000, cluster_id=CLUSTER_ID),
    "B": Node("10.0.0.3", 65000),
}
RR_LINKS = [("A", "R"), ("R", "B")]


def rr_model(lab: Lab):
    ar = lab.a_views(True) if lab.up("A", "R") else {}
    # RFC 4456 §6: from a client to everyone, from a non-client to clients only.
    reflect = lab.up("R", "B") and (lab.client["A"] or lab.client["B"])
    rb = {k: reflected_view(v, IPv4Address(lab.nodes["A"].address)) for k, v in ar.items()} if reflect else {}
    rb = lab.only_shared_families("R", "B", rb)
    sent = {("R", "A"): ar, ("B", "R"): rb}
    # Nothing goes back: R's best is A's own path toward A, B's is R's own toward R.
    received = {("R", "A"): ar, ("B", "R"): rb}
    return sent, received


@settings(max_examples=120, deadline=None)
@given(st.booleans(), st.booleans(), st.booleans(), _steps(list(RR_NODES), RR_LINKS, "R"))
def test_route_reflector_export_agrees_with_a_model(a_client, b_client, b_ipv4_only, steps):
    clients = [n for n, on in (("A", a_client), ("B", b_client)) if on]
    nodes = dict(RR_NODES)
    if b_ipv4_only:
        nodes["B"] = Node("10.0.0.3", 65000, families=(4,))
    _run(Lab(nodes, RR_LINKS, reflector="R", clients=clients), steps, rr_model)


# --------------------------------------------------------------- found by the model tests


def test_route_refresh_read_together_with_a_cease():
    """Found by the model tests: Speaker._on_peer_event (bgp/speaker.py) answered a
    PeerRouteRefresh with _send_full without checking that the session was still Established,
    so a ROUTE-REFRESH read together with the NOTIFICATION ending the session made
    Session.send_messages raise RuntimeError ("cannot send routes in state Idle") out of
    Speaker.data_received."""
    net, a, b = speaker_pair()
    net.run(duration=1)
    a.set_originated([Spec(0, (), None, None, (), (), False).origination((4, 0))], net.now)
    net.run(duration=1)
    # B asks A for its routes and deconfigures A before A has read the request: A reads the
    # ROUTE-REFRESH and the Cease in one go.
    b.peers["10.0.0.1"].established.send_messages([RouteRefresh(1, 1).encode()], net.now)
    b.remove_peer("10.0.0.1", net.now)
    net.run(duration=1)
    assert a.peers["10.0.0.2"].established is None
    assert a.adj_out_count("10.0.0.2") == 0


# --------------------------------------------------------------- reflection, by hand

RR_ADDRESS = "10.0.0.1"


def _reflector(*peers: tuple[str, bool, str | None]) -> tuple[RawHarness, dict[str, RawPeer]]:
    """Route reflector 10.0.0.1 (AS 65000, cluster CLUSTER_ID) with raw iBGP peers
    (address, client?, router ID or None for the address), IPv4 only, all connected."""
    settings_ = [PeerSettings(IPv4Address(a), 65000, passive=True, rr_client=c) for a, c, _ in peers]
    sp = make_speaker(RR_ADDRESS, 65000, settings_, cluster_id=CLUSTER_ID, families=((1, 1),))
    sp.start(0.0)
    h = RawHarness(sp, RR_ADDRESS)
    raw = {}
    for i, (a, _, rid) in enumerate(peers):
        raw[a] = RawPeer(a, 65000, conn=i + 1, router_id=rid, families=((1, 1),))
        assert h.connect(raw[a]), a
    return h, raw


def _announce(h: RawHarness, peer: RawPeer, prefix: str, *extra) -> None:
    attrs = PathAttributes((Origin(0), AsPath(()), NextHop(IPv4Address(peer.address)), *extra))
    h.send(peer, Update(attributes=attrs, nlri=(prefix_from_str(prefix)[1],)).encode(CodecContext(four_octet_as=True)))


def _held(peer: RawPeer) -> dict[str, PathAttributes]:
    out: dict[str, PathAttributes] = {}
    for u in peer.updates():
        assert not u.errors, u.errors
        for p in u.withdrawn:
            out.pop(prefix_to_str(1, p), None)
        for p in u.nlri:
            out[prefix_to_str(1, p)] = u.attributes
    return out


def test_a_reflected_route_without_local_pref_gets_the_default():
    """RFC 4271 §5.1.5: LOCAL_PREF SHALL be in every UPDATE sent to an internal peer -- a
    reflected one too, when the client sent its route without one."""
    h, raw = _reflector(("10.0.0.11", True, None), ("10.0.0.12", True, None), ("10.0.0.21", False, None))
    _announce(h, raw["10.0.0.11"], "10.1.0.0/16")
    for other in ("10.0.0.12", "10.0.0.21"):
        got = _held(raw[other])["10.1.0.0/16"]
        assert got.local_pref == DEFAULT_LOCAL_PREF, (other, got)
        assert got.originator_id == IPv4Address("10.0.0.11") and got.cluster_list == (CLUSTER_ID,)
    # One that carries a LOCAL_PREF keeps it.
    _announce(h, raw["10.0.0.11"], "10.2.0.0/16", LocalPref(250))
    assert _held(raw["10.0.0.21"])["10.2.0.0/16"].local_pref == 250


def test_a_route_reflected_a_second_time_keeps_its_originator_and_gets_our_cluster_id_first():
    """RFC 4456 §8: a route that already carries ORIGINATOR_ID keeps it; our cluster ID is
    prepended to its CLUSTER_LIST; and it is never sent to the router whose ID is the
    ORIGINATOR_ID -- here a non-client of ours (the client of another tier's reflector)."""
    x = IPv4Address("10.0.0.99")  # the router that first announced it, two tiers down
    c2 = IPv4Address("2.2.2.2")  # the lower tier's reflector's cluster
    h, raw = _reflector(
        ("10.0.0.11", True, None), ("10.0.0.12", True, None), ("10.0.0.21", False, None),
        ("10.0.0.22", False, str(x)),
    )  # fmt: skip
    _announce(h, raw["10.0.0.11"], "10.1.0.0/16", LocalPref(100), OriginatorId(x), ClusterList((c2,)))
    for other in ("10.0.0.12", "10.0.0.21"):
        got = _held(raw[other])["10.1.0.0/16"]
        assert got.originator_id == x, (other, got)
        assert got.cluster_list == (CLUSTER_ID, c2), (other, got)
    assert "10.1.0.0/16" not in _held(raw["10.0.0.22"]), "sent back to its originator"
    assert "10.1.0.0/16" not in _held(raw["10.0.0.11"])
