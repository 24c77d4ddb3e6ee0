"""From a received UPDATE to the Adj-RIB-In: RFC 7606 outcomes, import policy (bgp.policy),
the semantic checks a session alone cannot make, and the max-prefix limit (RFC 4486).

One :class:`Importer` per speaker; peers are attached when Established and detached when
down.  Problems a peer can cause once per message are logged through the speaker's
:class:`~bgp.loglimit.LogLimiter` and counted."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address

from proto.attributes import PathAttributes
from proto.messages import Update
from proto.nlri import IPV4_UNICAST

from .loglimit import LogLimiter
from .policy import Rejected, import_attributes
from .rib import Rib, Source
from .settings import Family, LocalSettings, PeerSettings

log = logging.getLogger("bgp.speaker")

Address = IPv4Address | IPv6Address
_MISSING = object()
IMPORT_CACHE_SIZE = 8192  # attribute sets remembered per peer with their imported form


@dataclass(frozen=True)
class MaxPrefixBreach:
    """The peer sent more prefixes of ``family`` than ``limit``: RFC 4486 Cease/1 is due."""

    family: Family
    limit: int

    def notification_data(self) -> bytes:
        # RFC 4486 §4: AFI, SAFI and the upper bound.
        return self.family[0].to_bytes(2, "big") + bytes((self.family[1],)) + self.limit.to_bytes(4, "big")

    def reason(self) -> str:
        return f"maximum prefixes reached: more than {self.limit} for AFI {self.family[0]} SAFI {self.family[1]}"


@dataclass
class _Attached:
    source: Source
    settings: PeerSettings
    families: frozenset[Family]
    local_address: Address | None  # our end of the session: a NEXT_HOP equal to it is ignored
    cache: dict


class Importer:
    def __init__(self, rib: Rib, local: LocalSettings, limiter: LogLimiter, counters: Counter[str]) -> None:
        self.rib = rib
        self.local = local
        self.limiter = limiter
        self.counters = counters
        self._peers: dict[str, _Attached] = {}
        self._warned: set[tuple[str, Family]] = set()

    def attach(
        self, source: Source, settings: PeerSettings, families: frozenset[Family], local_address: Address | None
    ) -> None:
        self._peers[source.key] = _Attached(source, settings, families, local_address, {})

    def detach(self, key: str) -> None:
        self._peers.pop(key, None)
        self._warned = {k for k in self._warned if k[0] != key}

    def update(self, key: str, update: Update, now: float) -> MaxPrefixBreach | None:
        """Apply one UPDATE (not an End-of-RIB) from ``key`` to the RIB."""
        p = self._peers.get(key)
        if p is None:
            return None
        nlri = update.nlri
        if nlri and not update.errors and not update.withdrawn and update.mp_reach is None and update.mp_unreach is None:
            # The common UPDATE: routes in the NLRI field, nothing else (what follows, shortened).
            attrs = self._imported(p, update.attributes, now)
            return self._announce(p, IPV4_UNICAST, nlri, attrs, None if attrs is None else attrs.next_hop, now, own=True)
        rib = self.rib
        families = p.families
        if update.errors:
            for err in update.errors:
                self.counters[f"update errors {err.action.value}"] += 1
                self.limiter.log(
                    logging.WARNING, f"update-error {err.action.value} {err.code}/{err.subcode}", key, now,
                    "peer %s: UPDATE error (%s): %s", key, err.action.value, err.message,
                )  # fmt: skip
        if update.withdrawn:
            rib.withdraw(key, IPV4_UNICAST, update.withdrawn)
        mp_un = update.mp_unreach
        if mp_un is not None and (mp_un.afi, mp_un.safi) in families:
            rib.withdraw(key, (mp_un.afi, mp_un.safi), mp_un.withdrawn)
        mp = update.mp_reach
        if not update.nlri and (mp is None or not mp.nlri):
            return None
        attrs = None if update.treat_as_withdraw else self._imported(p, update.attributes, now)
        breach = None
        if update.nlri:
            breach = self._announce(
                p, IPV4_UNICAST, update.nlri, attrs, None if attrs is None else attrs.next_hop, now, own=True
            )
        if mp is not None and mp.nlri and (mp.afi, mp.safi) in families:
            nh = mp.usable_next_hop if mp.next_hop else None
            breach = self._announce(p, (mp.afi, mp.safi), mp.nlri, attrs, nh, now) or breach
        return breach

    def _announce(
        self, p: _Attached, family: Family, prefixes: tuple[bytes, ...], attrs: PathAttributes | None,
        next_hop: Address | None, now: float, own: bool = False,
    ) -> MaxPrefixBreach | None:  # fmt: skip
        """``own``: ``next_hop`` is the attributes' own NEXT_HOP."""
        key = p.source.key
        rib = self.rib
        if family not in p.families:
            rib.withdraw(key, family, prefixes)
            return None
        if attrs is not None and next_hop is not None and next_hop == p.local_address:
            # RFC 4271 §6.3: a NEXT_HOP that is the receiving speaker's own address is
            # semantically incorrect; the route is ignored.
            self.counters["routes ignored"] += len(prefixes)
            self.limiter.log(
                logging.WARNING, "own-next-hop", key, now,
                "peer %s: route(s) with our own address %s as next hop ignored (RFC 4271 §6.3)", key, next_hop,
            )  # fmt: skip
            attrs = None
        if attrs is None:
            rib.withdraw(key, family, prefixes)
            return None
        adj = rib.adj_in[key]
        rib.announce(key, family, prefixes, adj.own_path(attrs, next_hop) if own else adj.path(attrs, next_hop))
        return self._check_max_prefixes(p, family)

    def _imported(self, p: _Attached, attributes: PathAttributes, now: float) -> PathAttributes | None:
        cache = p.cache
        got = cache.get(attributes, _MISSING)
        if got is _MISSING:
            if len(cache) > IMPORT_CACHE_SIZE:
                cache.clear()
            got = cache[attributes] = import_attributes(attributes, p.source, self.local)
        if isinstance(got, Rejected):
            self.counters["routes ignored"] += 1
            key = p.source.key
            self.limiter.log(logging.INFO, "import-rejected", key, now, "peer %s: route(s) ignored: %s", key, got.reason)
            return None
        return got  # type: ignore[return-value]

    def _check_max_prefixes(self, p: _Attached, family: Family) -> MaxPrefixBreach | None:
        limit = p.settings.max_prefixes
        if limit is None:
            return None
        key = p.source.key
        n = self.rib.adj_in[key].count(family)
        k = (key, family)
        if n > limit:
            return MaxPrefixBreach(family, limit)
        if n >= limit * p.settings.max_prefixes_warning:
            if k not in self._warned:
                self._warned.add(k)
                log.warning("peer %s: %d prefixes of AFI %s SAFI %s, limit %d", key, n, family[0], family[1], limit)
        else:
            self._warned.discard(k)
        return None
