"""The OPEN exchange as pure functions: what we offer, and what both sides agree on.

:func:`our_open` builds the OPEN a session sends (RFC 4271 §4.2; capabilities, RFC 5492:
multiprotocol per family, RFC 4760; route refresh, RFC 2918; graceful restart, RFC 4724).
:func:`negotiate` checks the peer's OPEN against our configuration (RFC 4271 §6.2: its AS;
RFC 6286 §2.2: a BGP Identifier that is not ours inside one AS) and returns the
:class:`Negotiated` result: the smaller hold time, the keepalive, the common families, the
four-octet AS decision (RFC 6793) and so the codec context of the session.

Message-local checks (version, hold time 1-2, capability syntax) are the codec's (proto).
"""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import IPv4Address

from proto.capabilities import (
    FourOctetAs,
    GracefulRestart,
    GracefulRestartFamily,
    MultiProtocol,
)
from proto.capabilities import (
    RouteRefresh as RouteRefreshCapability,
)
from proto.errors import DecodeError, ErrorCode
from proto.messages import CodecContext, Open
from proto.nlri import IPV4_UNICAST

from .settings import Family, LocalSettings, PeerSettings


@dataclass(frozen=True)
class Negotiated:
    """What both OPENs agreed on (RFC 4271 §4.2, RFC 5492, RFC 6793, RFC 4760, RFC 4724)."""

    peer_asn: int
    peer_router_id: IPv4Address
    hold_time: int
    keepalive_time: float
    families: frozenset[Family]
    route_refresh: bool
    ctx: CodecContext
    peer_graceful_restart: GracefulRestart | None
    local_graceful_restart: bool
    ibgp: bool

    def peer_gr_families(self) -> dict[Family, bool]:
        """Families the peer keeps forwarding state for across its restart, with the F bit."""
        gr = self.peer_graceful_restart
        if gr is None:
            return {}
        return {(f.afi, f.safi): f.forwarding_state for f in gr.families}


def local_families(local: LocalSettings, peer: PeerSettings) -> tuple[Family, ...]:
    """The families we offer ``peer``: its own list, else the speaker's."""
    return peer.families if peer.families is not None else local.families


def our_open(local: LocalSettings, peer: PeerSettings, *, restarting: bool | None = None) -> Open:
    """The OPEN we send ``peer``.  ``restarting``: the R bit now (the speaker's RestartState);
    None: ``local.restarting``."""
    families = local_families(local, peer)
    caps: list = [MultiProtocol(afi, safi) for afi, safi in families]
    caps.append(RouteRefreshCapability())
    if local.graceful_restart:
        # RFC 4724 §3: R bit while we are back from a restart (until route selection is no
        # longer deferred); F bit where forwarding state survived it (a fact about the restart,
        # so it stays when R is cleared).
        forwarding = local.forwarding_preserved
        if forwarding is None:
            forwarding = local.restarting
        caps.append(
            GracefulRestart(
                restart_state=local.restarting if restarting is None else restarting,
                restart_time=local.restart_time,
                families=tuple(GracefulRestartFamily(afi, safi, forwarding_state=forwarding) for afi, safi in families),
            )
        )
    hold = peer.hold_time if peer.hold_time is not None else local.hold_time
    return Open.build(local.asn, hold, local.router_id, caps)


def negotiate(sent: Open, received: Open, local: LocalSettings, peer: PeerSettings) -> Negotiated:
    """What ``sent`` and ``received`` agree on; DecodeError (OPEN Message Error) when the peer's
    OPEN does not fit our configuration."""
    if received.asn != peer.asn:
        raise DecodeError(ErrorCode.OPEN_MESSAGE, 2, b"", f"peer AS {received.asn} is not the configured {peer.asn}")
    ibgp = received.asn == local.asn
    if ibgp and received.router_id == local.router_id:
        # RFC 6286 §2.2: the BGP Identifier must be unique within an AS.
        raise DecodeError(
            ErrorCode.OPEN_MESSAGE, 3, received.router_id.packed, f"peer uses our own BGP identifier {received.router_id}"
        )
    four_octet = sent.capability(FourOctetAs) is not None and received.capability(FourOctetAs) is not None
    peer_mp = {(c.afi, c.safi) for c in received.capabilities_of(MultiProtocol)}
    if not peer_mp:
        peer_mp = {IPV4_UNICAST}  # RFC 4760 §8: no MP capability means IPv4 unicast only
    # RFC 4724 §3: of several Graceful Restart capabilities the receiver uses the last.
    peer_gr = received.capabilities_of(GracefulRestart)
    hold = min(sent.hold_time, received.hold_time)  # RFC 4271 §4.2: the smaller of the two
    if hold:
        keepalive = local.keepalive_time or hold / 3.0
        keepalive = min(keepalive, hold / 3.0)
    else:
        keepalive = 0.0
    return Negotiated(
        peer_asn=received.asn,
        peer_router_id=received.router_id,
        hold_time=hold,
        keepalive_time=keepalive,
        families=frozenset(set(local_families(local, peer)) & peer_mp),
        route_refresh=received.capability(RouteRefreshCapability) is not None,
        ctx=CodecContext(four_octet_as=four_octet, external=not ibgp),
        peer_graceful_restart=peer_gr[-1] if peer_gr else None,
        local_graceful_restart=local.graceful_restart,
        ibgp=ibgp,
    )
