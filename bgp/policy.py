"""Import and export transforms: pure functions of a path, where it came from and where it goes.

``import_attributes`` runs once per received attribute set (RFC 4271 §9.1 loop checks,
RFC 4456 §8 reflection loops, what an external peer may not tell us).

``export_route`` is the Adj-RIB-Out rule for one path and one kind of neighbour (GoBGP's
``UpdatePathAttrs``): iBGP split horizon (RFC 4271 §9.2), route reflection (RFC 4456 §6/§8),
eBGP rewriting (AS_PATH prepend, next-hop-self, no LOCAL_PREF / MED / reflection attributes),
and the well-known communities of RFC 1997.  It works for an *update group* (bgp.export):
everything that depends only on the kind of neighbour is decided here, and the two rules
that depend on the neighbour itself — never back to the peer the route came from, never a
reflected route back to its originator — are carried on the result as data
(:meth:`OutRoute.excludes`), so one computed route serves every member of the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address

from proto.attributes import (
    NO_ADVERTISE,
    NO_EXPORT,
    NO_EXPORT_SUBCONFED,
    ClusterList,
    LocalPref,
    MultiExitDisc,
    NextHop,
    OriginatorId,
    PathAttributes,
)
from proto.nlri import Afi

from .bestpath import DEFAULT_LOCAL_PREF
from .rib import Path, Source
from .settings import LocalSettings

Address = IPv4Address | IPv6Address

# What an external peer may not tell us, and what never leaves the AS (RFC 4271 §5.1.5,
# RFC 4456 §8).
_INTERNAL_ONLY = (LocalPref.code, OriginatorId.code, ClusterList.code)


@dataclass(frozen=True, slots=True)
class Rejected:
    """An imported attribute set the Loc-RIB must not see; the route counts as withdrawn."""

    reason: str


def import_attributes(attributes: PathAttributes, source: Source, local: LocalSettings) -> PathAttributes | Rejected:
    """Attributes as the Loc-RIB should see them, or why the route is treated as withdrawn."""
    # RFC 4271 §9.1.2: a route whose AS_PATH holds our own AS is a loop, whatever kind of peer
    # it came from (BIRD's bgp_decode_attrs and GoBGP's hasOwnASLoop check every peer's routes).
    # Over iBGP it only arrives when another router of the AS let it in; dropping it here keeps
    # this speaker, and the clients it reflects to, from using the looping path.
    if attributes.as_path.contains(local.asn):
        return Rejected(f"AS_PATH holds our AS {local.asn} (RFC 4271 §9.1.2)")
    if source.ibgp:
        # RFC 4456 §8: a reflector ignores routes it originated or that already passed its cluster.
        if attributes.originator_id == local.router_id:
            return Rejected("ORIGINATOR_ID is our own router id (RFC 4456 §8)")
        if local.cluster_id is not None and local.cluster_id in attributes.cluster_list:
            return Rejected("CLUSTER_LIST holds our cluster id (RFC 4456 §8)")
        return attributes
    # RFC 4271 §5.1.5: LOCAL_PREF from an external peer is ignored; RFC 4456 §8: ORIGINATOR_ID
    # and CLUSTER_LIST only make sense inside the AS.
    return attributes.without(*_INTERNAL_ONLY)  # (itself when it holds none of them)


@dataclass(frozen=True)
class ExportTarget:
    """The kind of neighbour a route is exported to, as far as the export rules care.

    Everything here is shared by every member of an update group; ``key`` and
    ``router_id`` identify one neighbour and are only set by :func:`export_to_peer`."""

    ibgp: bool
    rr_client: bool
    local_address: Address | None  # our end of the TCP session: the next hop when we are "self"
    next_hop_v6: IPv6Address | None = None  # our IPv6 next hop for IPv6 routes over an IPv4 session
    next_hop_v4: IPv4Address | None = None  # our IPv4 next hop for IPv4 routes over an IPv6 session
    key: str | None = None
    router_id: IPv4Address | None = None


class OutRoute:
    """What a neighbour is sent for one prefix: attributes and next hop, plus who must not get
    it (the peer it came from; for a reflected route, its originator).  Shared by every prefix
    exported from the same path; equal when everything the wire and the exclusions depend on
    is equal."""

    __slots__ = ("attributes", "next_hop", "source", "originator", "_hash", "wire")

    def __init__(
        self, attributes: PathAttributes, next_hop: Address, source: str, originator: IPv4Address | None
    ) -> None:
        self.attributes = attributes
        self.next_hop = next_hop
        self.source = source
        self.originator = originator
        self._hash = hash((attributes, next_hop, source, originator))
        #: (prefix, encoded UPDATE) when this route was last encoded for a single prefix,
        #: so that each new member of a group reuses the bytes (bgp.export).
        self.wire: tuple[bytes, list[bytes]] | None = None

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, OutRoute):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.attributes == other.attributes
            and self.next_hop == other.next_hop
            and self.source == other.source
            and self.originator == other.originator
        )

    def __repr__(self) -> str:
        return f"<OutRoute nh={self.next_hop} from {self.source}>"

    def excludes(self, key: str, router_id: IPv4Address | None) -> bool:
        """Whether the neighbour ``key`` (BGP identifier ``router_id``) must not have this route:
        never back to the peer it came from; a reflected route never to its originator
        (RFC 4456 §8)."""
        return key == self.source or (self.originator is not None and router_id == self.originator)


def export_route(path: Path, family_afi: int, to: ExportTarget, local: LocalSettings) -> OutRoute | None:
    """The route a neighbour of kind ``to`` gets for ``path``, or None when none may have it."""
    src = path.source
    attrs = path.attributes
    communities = attrs.communities
    if communities:
        if NO_ADVERTISE in communities:
            return None
        if not to.ibgp and (NO_EXPORT in communities or NO_EXPORT_SUBCONFED in communities):
            return None

    originator = None
    if to.ibgp:
        if src.ibgp and not src.local:
            if not local.is_route_reflector:
                return None  # RFC 4271 §9.2: iBGP routes are not passed on to iBGP peers
            # RFC 4456 §6: from a client -> everyone; from a non-client -> clients only.
            if not src.rr_client and not to.rr_client:
                return None
            # RFC 4456 §8: never back to its originator (OutRoute.excludes checks it per member).
            originator = attrs.originator_id or src.router_id
            assert local.cluster_id is not None
            attrs = attrs.replace(
                OriginatorId(originator),
                ClusterList((local.cluster_id, *attrs.cluster_list)),
            )
            # RFC 4271 §5.1.5: LOCAL_PREF SHALL be in every UPDATE to an internal peer, a
            # reflected one too (a client may send its route without one).
            if attrs.local_pref is None:
                attrs = attrs.replace(LocalPref(DEFAULT_LOCAL_PREF))
            next_hop = path.next_hop  # reflection leaves the next hop alone
        else:
            # Our own routes and eBGP-learned routes entering the AS carry a LOCAL_PREF (§5.1.5).
            if attrs.local_pref is None:
                attrs = attrs.replace(LocalPref(DEFAULT_LOCAL_PREF))
            next_hop = path.next_hop if path.next_hop is not None else _self(family_afi, to)
        if isinstance(next_hop, IPv6Address) and next_hop.is_link_local:
            # RFC 2545 §3: a link-local next hop means something only on the link it was learned
            # on; the other nodes cannot reach it, so we stand in as the next hop.
            next_hop = _self(family_afi, to)
        if next_hop is None:
            return None
        return OutRoute(attrs.without(NextHop.code), next_hop, src.key, originator)

    # External neighbour (RFC 4271 §5.1.2-§5.1.5).
    drop = [NextHop.code, *_INTERNAL_ONLY]
    if not src.local:
        drop.append(MultiExitDisc.code)  # §5.1.4: a MED learned from a neighbouring AS stays in our AS
    attrs = attrs.without(*drop).replace(attrs.as_path.prepend(local.asn))
    next_hop = _self(family_afi, to)
    if next_hop is None:
        return None
    return OutRoute(attrs, next_hop, src.key, None)


def export_to_peer(path: Path, family_afi: int, to: ExportTarget, local: LocalSettings) -> OutRoute | None:
    """:func:`export_route` for one neighbour (``to.key`` and ``to.router_id`` set)."""
    out = export_route(path, family_afi, to, local)
    if out is None or out.excludes(to.key or "", to.router_id):
        return None
    return out


def _self(afi: int, to: ExportTarget) -> Address | None:
    """Our own address as next hop toward ``to`` for this address family."""
    la = to.local_address
    if afi == Afi.IPV4:
        if isinstance(la, IPv4Address):
            return la
        # Over an IPv6 session: our IPv4 address if we have one (None: not sent; bgp.channels
        # logs it when such a peer comes up).
        return to.next_hop_v4
    if isinstance(la, IPv6Address):
        return la
    if to.next_hop_v6 is not None:
        return to.next_hop_v6
    if isinstance(la, IPv4Address):
        # IPv6 routes over an IPv4 session with no IPv6 address configured: the IPv4-mapped
        # form (RFC 4291 §2.5.5.2), which is what BIRD and GoBGP fall back to as well.
        return IPv6Address("::ffff:" + str(la))
    return None
