"""Import and export transforms: pure functions of a path, where it came from and where it goes.

``import_attributes`` runs once per received attribute set (RFC 4271 §9.1 loop checks,
RFC 4456 §8 reflection loops, what an external peer may not tell us).

``export_route`` is the Adj-RIB-Out rule for one path and one neighbour (GoBGP's
``UpdatePathAttrs``): iBGP split horizon (RFC 4271 §9.2), route reflection (RFC 4456 §6/§8),
eBGP rewriting (AS_PATH prepend, next-hop-self, no LOCAL_PREF / MED / reflection attributes),
and the well-known communities of RFC 1997.  It returns the attributes and next hop to send,
or None when the neighbour must not have the route.
"""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address

from proto.attributes import ClusterList, LocalPref, OriginatorId, PathAttributes
from proto.nlri import Afi

from .bestpath import DEFAULT_LOCAL_PREF
from .rib import Path, Source
from .settings import LocalSettings

# RFC 1997 well-known communities.
NO_EXPORT = 0xFFFFFF01
NO_ADVERTISE = 0xFFFFFF02
NO_EXPORT_SUBCONFED = 0xFFFFFF03

ORIGIN_CODE, AS_PATH_CODE, NEXT_HOP_CODE, MED_CODE, LOCAL_PREF_CODE = 1, 2, 3, 4, 5
ORIGINATOR_ID_CODE, CLUSTER_LIST_CODE = 9, 10

Address = IPv4Address | IPv6Address


def import_attributes(attributes: PathAttributes, source: Source, local: LocalSettings) -> PathAttributes | None:
    """Attributes as the Loc-RIB should see them, or None to treat the route as withdrawn."""
    if source.ibgp:
        # RFC 4456 §8: a reflector ignores routes it originated or that already passed its cluster.
        if attributes.originator_id == local.router_id:
            return None
        if local.cluster_id is not None and local.cluster_id in attributes.cluster_list:
            return None
        return attributes
    # RFC 4271 §9.1.2: a route whose AS_PATH holds our own AS is a loop.
    if attributes.as_path.contains(local.asn):
        return None
    # RFC 4271 §5.1.5: LOCAL_PREF from an external peer is ignored; RFC 4456 §8: ORIGINATOR_ID
    # and CLUSTER_LIST only make sense inside the AS.
    if LOCAL_PREF_CODE in attributes or ORIGINATOR_ID_CODE in attributes or CLUSTER_LIST_CODE in attributes:
        attributes = attributes.without(LOCAL_PREF_CODE, ORIGINATOR_ID_CODE, CLUSTER_LIST_CODE)
    return attributes


@dataclass(frozen=True)
class ExportTarget:
    """The neighbour a route is being exported to, as far as the export rules care."""

    key: str
    asn: int
    ibgp: bool
    rr_client: bool
    router_id: IPv4Address | None  # from its OPEN
    local_address: Address | None  # our end of the TCP session: the next hop when we are "self"
    next_hop_v6: IPv6Address | None = None  # our IPv6 next hop for IPv6 routes over an IPv4 session


def export_route(
    path: Path, family_afi: int, to: ExportTarget, local: LocalSettings
) -> tuple[PathAttributes, Address] | None:
    src = path.source
    attrs = path.attributes
    if src.key == to.key:
        return None  # never back to the peer it came from
    communities = attrs.communities
    if communities:
        if NO_ADVERTISE in communities:
            return None
        if not to.ibgp and (NO_EXPORT in communities or NO_EXPORT_SUBCONFED in communities):
            return None

    if to.ibgp:
        if src.ibgp and not src.local:
            if not local.is_route_reflector:
                return None  # RFC 4271 §9.2: iBGP routes are not passed on to iBGP peers
            # RFC 4456 §6: from a client -> everyone; from a non-client -> clients only.
            if not src.rr_client and not to.rr_client:
                return None
            # RFC 4456 §8: never send a route back to its originator.
            originator = attrs.originator_id or src.router_id
            if to.router_id is not None and originator == to.router_id:
                return None
            assert local.cluster_id is not None
            attrs = attrs.replace(
                OriginatorId(originator),
                ClusterList((local.cluster_id, *attrs.cluster_list)),
            )
            next_hop = path.next_hop  # reflection leaves the next hop alone
        else:
            # Our own routes and eBGP-learned routes entering the AS carry a LOCAL_PREF (§5.1.5).
            if attrs.local_pref is None:
                attrs = attrs.replace(LocalPref(DEFAULT_LOCAL_PREF))
            next_hop = path.next_hop if path.next_hop is not None else _self(family_afi, to)
        if next_hop is None:
            return None
        return attrs.without(NEXT_HOP_CODE), next_hop

    # External neighbour (RFC 4271 §5.1.2-§5.1.5).
    drop = [NEXT_HOP_CODE, LOCAL_PREF_CODE, ORIGINATOR_ID_CODE, CLUSTER_LIST_CODE]
    if not src.local:
        drop.append(MED_CODE)  # §5.1.4: a MED learned from a neighbouring AS stays in our AS
    attrs = attrs.without(*drop).replace(attrs.as_path.prepend(local.asn))
    next_hop = _self(family_afi, to)
    if next_hop is None:
        return None
    return attrs, next_hop


def _self(afi: int, to: ExportTarget) -> Address | None:
    """Our own address as next hop toward ``to`` for this address family."""
    la = to.local_address
    if afi == Afi.IPV4:
        return la if isinstance(la, IPv4Address) else None
    if isinstance(la, IPv6Address):
        return la
    if to.next_hop_v6 is not None:
        return to.next_hop_v6
    if isinstance(la, IPv4Address):
        # IPv6 routes over an IPv4 session with no IPv6 address configured: the IPv4-mapped
        # form (RFC 4291 §2.5.5.2), which is what BIRD and GoBGP fall back to as well.
        return IPv6Address("::ffff:" + str(la))
    return None

