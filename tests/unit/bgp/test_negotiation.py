"""The OPEN exchange alone (bgp.negotiation): what we offer and what two OPENs agree on."""

from __future__ import annotations

from ipaddress import IPv4Address

import pytest

from bgp.negotiation import negotiate, our_open
from bgp.settings import LocalSettings, PeerSettings
from proto.capabilities import (
    FourOctetAs,
    GracefulRestart,
    GracefulRestartFamily,
    MultiProtocol,
    RouteRefresh,
)
from proto.errors import DecodeError, ErrorCode
from proto.messages import Open
from proto.nlri import IPV4_UNICAST, IPV6_UNICAST

LOCAL = LocalSettings(asn=65000, router_id=IPv4Address("10.0.0.1"), families=(IPV4_UNICAST, IPV6_UNICAST))
PEER = PeerSettings(IPv4Address("10.0.0.2"), 65001)


def peer_open(asn=65001, hold=90, router_id="10.0.0.2", caps=(MultiProtocol(*IPV4_UNICAST), RouteRefresh())):
    return Open.build(asn, hold, router_id, caps)


def test_our_open_offers_every_family_route_refresh_and_four_octet_as():
    sent = our_open(LOCAL, PEER)
    assert sent.hold_time == 90 and sent.asn == 65000 and str(sent.router_id) == "10.0.0.1"
    assert {(c.afi, c.safi) for c in sent.capabilities_of(MultiProtocol)} == {IPV4_UNICAST, IPV6_UNICAST}
    assert sent.capability(RouteRefresh) is not None and sent.capability(FourOctetAs).asn == 65000
    gr = sent.capability(GracefulRestart)  # on by default: not restarting, no forwarding state kept
    assert not gr.restart_state and not any(f.forwarding_state for f in gr.families)
    no_gr = LocalSettings(asn=65000, router_id=IPv4Address("10.0.0.1"), graceful_restart=False)
    assert our_open(no_gr, PEER).capability(GracefulRestart) is None


def test_our_open_takes_the_peers_own_hold_time_and_families():
    sent = our_open(LOCAL, PeerSettings(IPv4Address("10.0.0.2"), 65001, hold_time=30, families=(IPV4_UNICAST,)))
    assert sent.hold_time == 30
    assert [(c.afi, c.safi) for c in sent.capabilities_of(MultiProtocol)] == [IPV4_UNICAST]


def test_graceful_restart_carries_the_restart_and_forwarding_bits():
    local = LocalSettings(asn=65000, router_id=IPv4Address("10.0.0.1"), graceful_restart=True, restarting=True)
    gr = our_open(local, PEER).capability(GracefulRestart)
    assert gr.restart_state and all(f.forwarding_state for f in gr.families)


def test_the_smaller_hold_time_a_third_of_it_as_keepalive_and_the_common_families():
    neg = negotiate(our_open(LOCAL, PEER), peer_open(hold=30), LOCAL, PEER)
    assert (neg.hold_time, neg.keepalive_time) == (30, 10.0)
    assert neg.families == frozenset({IPV4_UNICAST}) and neg.route_refresh and not neg.ibgp
    assert neg.ctx.four_octet_as and neg.ctx.external
    assert neg.peer_asn == 65001 and str(neg.peer_router_id) == "10.0.0.2"


def test_no_multiprotocol_capability_means_ipv4_unicast_and_hold_zero_means_no_keepalive():
    neg = negotiate(our_open(LOCAL, PEER), peer_open(hold=0, caps=()), LOCAL, PEER)
    assert neg.families == frozenset({IPV4_UNICAST})
    assert (neg.hold_time, neg.keepalive_time, neg.route_refresh) == (0, 0.0, False)


def test_a_configured_keepalive_is_kept_below_a_third_of_the_hold_time():
    local = LocalSettings(asn=65000, router_id=IPv4Address("10.0.0.1"), keepalive_time=20.0)
    assert negotiate(our_open(local, PEER), peer_open(hold=90), local, PEER).keepalive_time == 20.0
    assert negotiate(our_open(local, PEER), peer_open(hold=30), local, PEER).keepalive_time == 10.0


def test_a_peer_without_four_octet_as_gets_a_two_octet_session():
    sent = our_open(LOCAL, PEER)
    received = Open(65001, 90, IPv4Address("10.0.0.2"), (MultiProtocol(*IPV4_UNICAST),))
    assert not negotiate(sent, received, LOCAL, PEER).ctx.four_octet_as


def test_the_wrong_peer_as_is_bad_peer_as():
    with pytest.raises(DecodeError) as err:
        negotiate(our_open(LOCAL, PEER), peer_open(asn=65002), LOCAL, PEER)
    assert (err.value.code, err.value.subcode) == (ErrorCode.OPEN_MESSAGE, 2)


def test_our_own_identifier_inside_one_as_is_bad_bgp_identifier():
    ibgp = PeerSettings(IPv4Address("10.0.0.2"), 65000)
    with pytest.raises(DecodeError) as err:
        negotiate(our_open(LOCAL, ibgp), peer_open(asn=65000, router_id="10.0.0.1"), LOCAL, ibgp)
    assert (err.value.code, err.value.subcode) == (ErrorCode.OPEN_MESSAGE, 3)
    # Across ASes the same identifier is allowed (RFC 6286 §2.2 is per AS).
    assert negotiate(our_open(LOCAL, PEER), peer_open(router_id="10.0.0.1"), LOCAL, PEER).peer_asn == 65001


def test_of_two_graceful_restart_capabilities_the_last_counts():
    # RFC 4724 §3: the receiver MUST ignore all but the last instance.
    first = GracefulRestart(False, 120, (GracefulRestartFamily(*IPV4_UNICAST, True),))
    last = GracefulRestart(False, 0, ())
    received = Open.decode(peer_open(caps=(MultiProtocol(*IPV4_UNICAST), first, last)).encode()[19:])
    neg = negotiate(our_open(LOCAL, PEER), received, LOCAL, PEER)
    assert neg.peer_graceful_restart == last
