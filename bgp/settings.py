"""What the speaker is told about itself and its neighbours.

Plain frozen dataclasses: the agent builds them from its configuration, tests
build them directly.  Times are seconds (floats are fine).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network

from proto.nlri import IPV4_UNICAST, IPV6_UNICAST

Family = tuple[int, int]


@dataclass(frozen=True)
class LocalSettings:
    asn: int
    router_id: IPv4Address
    hold_time: int = 90
    # Seconds between KEEPALIVEs; None means a third of the negotiated hold time (RFC 4271 §10).
    keepalive_time: float | None = None
    # ConnectRetryTime (RFC 4271 §10): how long one outbound TCP attempt may take.
    connect_retry_time: float = 5.0
    # After a session fails, wait backoff_initial, doubling up to backoff_max, before the next
    # attempt (RFC 4271 §8.1.1 IdleHoldTimer, "DampPeerOscillations").
    backoff_initial: float = 1.0
    backoff_max: float = 30.0
    # Set when this speaker is a route reflector (RFC 4456 §7); the cluster id.
    cluster_id: IPv4Address | None = None
    graceful_restart: bool = True
    restart_time: int = 120
    # We are coming back from a restart and kept forwarding state (RFC 4724 §3); set by the
    # agent when it adopted its kernel routes.  The speaker then defers route selection
    # (§4.1) and its OPENs carry "Restart State" (the R bit) until that is over -- not for
    # the life of the process (see RestartState).
    restarting: bool = False
    # Advertise the Forwarding State bit for every family (RFC 4724 §3): our forwarding state
    # survived the restart, so peers keep our routes until our End-of-RIB.  None: same as
    # ``restarting`` (what was preserved at start; it does not follow the R bit's clearing).
    # Without it a peer must flush our stale routes the moment we return.
    forwarding_preserved: bool | None = None
    # How long a GR peer's stale routes are kept after it comes back without sending End-of-RIB.
    stale_time: float = 360.0
    families: tuple[Family, ...] = (IPV4_UNICAST, IPV6_UNICAST)
    # Our next hop for IPv6 routes sent over IPv4 sessions (None: the IPv4-mapped address).
    next_hop_v6: IPv6Address | None = None
    # Our next hop for IPv4 routes sent over IPv6 sessions (the node's IPv4 address).  None:
    # such routes -- ours, and eBGP-learned ones toward iBGP peers -- are not sent over an
    # IPv6 session (an IPv6 address is no IPv4 next hop without RFC 8950), and a peer that
    # negotiates IPv4 unicast over one is told so in the log when it comes up.
    next_hop_v4: IPv4Address | None = None
    # A peer whose socket takes nothing for this long is reset with Cease/Out of Resources
    # (RFC 4486 §4): what we owe it is then not held for ever.
    send_timeout: float = 60.0
    # ROUTE-REFRESH (RFC 2918): a peer's requests for one family start a full re-send at most
    # this often; requests in between are folded into one that starts when the time is up.
    refresh_interval: float = 1.0
    # Seconds changes are collected before peers are sent them (0: at once).  Each peer then
    # gets one batch per window instead of one write per change: a reflector taking one
    # route from each of N clients writes N batches, not N x N single UPDATEs.
    update_delay: float = 0.0

    @property
    def is_route_reflector(self) -> bool:
        return self.cluster_id is not None


class RestartState:
    """Whether our OPENs carry Restart State, the R bit (RFC 4724 §3: "the BGP speaker has
    restarted", so a peer must not wait for our End-of-RIB before sending us its routes, and
    does not wait for ours in its own selection deferral).  One per speaker, shared by its
    peers' sessions (LocalSettings is frozen, and may be shared between speakers): set at
    start from ``LocalSettings.restarting``, cleared once the restart is complete -- route
    selection no longer deferred, End-of-RIB sent to every peer (§4.1) -- so a session that
    comes up later, or a peer that restarts hours later, is told we have not just restarted."""

    __slots__ = ("restarting",)

    def __init__(self, restarting: bool = False) -> None:
        self.restarting = restarting

    def __repr__(self) -> str:
        return f"<RestartState restarting={self.restarting}>"


@dataclass(frozen=True)
class PeerSettings:
    address: IPv4Address | IPv6Address
    asn: int
    port: int = 179
    passive: bool = False
    rr_client: bool = False
    password: str | None = None
    hold_time: int | None = None  # None: the local default
    local_address: IPv4Address | IPv6Address | None = None
    families: tuple[Family, ...] | None = None  # None: the local families
    description: str = field(default="", compare=False)  # shown only: a new one is taken over in place
    # RFC 4486 Cease/1: reset the session once the peer has sent more than this many prefixes
    # of one family (None: no limit); log a warning at ``max_prefixes_warning`` of it; come back
    # after ``max_prefixes_restart`` seconds (None: stay down until the peer is reconfigured).
    max_prefixes: int | None = None
    max_prefixes_warning: float = 0.75
    max_prefixes_restart: float | None = None
    # RFC 5082 GTSM for a directly connected peer: send with TTL 255, accept only TTL 255.
    ttl_security: bool = False
    # RFC 5880/5881 BFD to this peer; its failure ends the session with Cease/10 (RFC 9384).
    # (interval, multiplier): desired/required intervals in seconds and the detect multiplier.
    # Not compared: turning BFD on or off or re-tuning it is applied to the running peer
    # (Speaker.set_peers updates its settings, the transport its BFD session), as BIRD does,
    # instead of resetting the BGP session.
    bfd: tuple[float, int] | None = field(default=None, compare=False)
    # A change of any compared field restarts the peer when the agent re-applies its peer set
    # (Speaker.set_peers); description, bfd (above) and tags are not compared.
    tags: tuple[str, ...] = field(default=(), compare=False)

    # The peer's key everywhere (its address as text), made once.
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.address, str):
            object.__setattr__(self, "address", ip_address(self.address))
        if isinstance(self.local_address, str):
            object.__setattr__(self, "local_address", ip_address(self.local_address))
        object.__setattr__(self, "key", str(self.address))


@dataclass(frozen=True)
class ListenRange:
    """Dynamic neighbours (BIRD's ``neighbor range``, GoBGP's dynamic neighbours): any peer that
    connects from ``prefix`` is accepted as ``template`` describes, without an entry of its own.
    Such a peer is passive (it connects to us) and is forgotten once its session is over."""

    prefix: IPv4Network | IPv6Network
    template: PeerSettings

    def __post_init__(self) -> None:
        if isinstance(self.prefix, str):
            object.__setattr__(self, "prefix", ip_network(self.prefix))

    def settings_for(self, address: IPv4Address | IPv6Address) -> PeerSettings:
        return replace(self.template, address=address, passive=True)
