"""Dynamic neighbours: peers accepted from listen ranges (BIRD's ``neighbor range``, GoBGP's
dynamic neighbors) instead of being configured one by one.

A connection from an address inside a range (the most specific range wins) makes a peer with
that range's settings; the peer goes again with its last connection, or -- while graceful
restart keeps its routes as stale -- when that ends.  :class:`DynamicPeers` keeps the ranges
and which of the speaker's peers came from one; the speaker adds and removes the peers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from ipaddress import ip_address

from .fsm import State
from .peer import Peer
from .settings import ListenRange, PeerSettings


class DynamicPeers:
    def __init__(self) -> None:
        self._ranges: list[ListenRange] = []
        self._keys: set[str] = set()

    # -- the ranges

    @property
    def ranges(self) -> list[ListenRange]:
        return list(self._ranges)

    def set_ranges(self, ranges: Iterable[ListenRange], current: Callable[[str], Peer | None]) -> list[str]:
        """New ranges, most specific first; returns the dynamic peers whose range is gone or
        now gives other settings (the speaker resets them)."""
        self._ranges = sorted(ranges, key=lambda r: r.prefix.prefixlen, reverse=True)
        stale = []
        for key in list(self._keys):
            peer = current(key)
            rng = self.range_for(key)
            if peer is None or rng is None or rng.settings_for(peer.settings.address) != peer.settings:
                stale.append(key)
        return stale

    def range_for(self, key: str) -> ListenRange | None:
        if not self._ranges:
            return None
        addr = ip_address(key)
        for r in self._ranges:
            if addr.version == r.prefix.version and addr in r.prefix:
                return r
        return None

    def settings_for(self, key: str) -> PeerSettings | None:
        """The settings a peer at ``key`` (a normalized address) would get, if any range takes it."""
        rng = self.range_for(key)
        return rng.settings_for(ip_address(key)) if rng is not None else None

    # -- the peers that came from them

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: str) -> None:
        self._keys.add(key)

    def discard(self, key: str) -> None:
        self._keys.discard(key)

    @staticmethod
    def finished(peer: Peer, kept: bool) -> bool:
        """Whether a dynamic peer is done: no session past Active, no connection, none being
        made, (``kept``) no routes kept for it by graceful restart, and not held down (max-prefix:
        forgotten, its next connection would make a fresh peer with no hold-down)."""
        return (peer.state <= State.ACTIVE and not kept and peer.held_until is None
                and not any(s.has_connection or s.connecting for s in peer.sessions()))
