"""The table that keeps conntrack quiet about the connections the pod programs record.

While the pod fast path's programs record pods' IPv4 TCP connections themselves
(agentd/dataplane/bpf/podpath.c, ``POD_CFG_RECORD``), they mark each such connection's SYN
(``POD_RECORD_MARK``), and one rule in the node's namespace masks conntrack's events for it::

    table ip agentd-flows {
        chain record {
            type nat hook postrouting priority srcnat + 1; policy accept;
            meta mark & 0x00800000 == 0x00800000 ct state new ct status & (snat|dnat) == 0 ct event set 0x0 ct mark set ct mark | 0x00800000
        }
    }

and marks the entry it masks (conntrack mark bit ``POD_RECORD_CTMARK``): the program that sees
the connection's answer reads that bit in the conntrack look-up it makes there (podconn_plain)
and records the connection only if it is set -- one whose entry conntrack held before the
marked SYN (a SYN sent again whose first was not recorded) kept its events and stays
conntrack's.  The bit is agentd's while its programs record: another user setting the same
conntrack mark bit would have connections recorded twice, and one clearing it (overwriting the
whole conntrack mark after this rule) recorded by nobody.  The rule runs on the connection's first packet before conntrack confirms its entry (confirm
is the last thing postrouting does), after source NAT: a translated connection keeps its events
(the programs then leave it to conntrack too: podconn_plain in podpath.c).  The chain is of
type nat, so that the kernel runs it only for a connection's first packet (nat chains are asked
until a connection's source translation is settled, then never again; one that a chain before
it translated -- the Services' masquerade at srcnat -- never reaches it), where a filter chain
would evaluate the rule for every packet the node forwards.  Conntrack then builds no NEW
and no DESTROY event for it, which is what recording cost the data path (docs/observability.md).
Every other connection keeps its events.

The table is made before the programs are told to record and removed after they are told to
stop (and when flow records or connections are switched off, and by ``agentd leave``), so
that no connection is masked that no program records.  An agent that stops leaves both as they
are (the programs go on recording); the next one remakes a table it finds before it loads its
programs (:func:`renew`), so that programs that read the conntrack mark never run beside an
older agent's rule that does not set it.  Blocking calls.
"""

from __future__ import annotations

import contextlib
from typing import Any

from .libnftables import Nft, NftError

FAMILY, TABLE, CHAIN = "ip", "agentd-flows", "record"
MARK = 0x00800000  # podpath.h POD_RECORD_MARK
CTMARK = 0x00800000  # podpath.h POD_RECORD_CTMARK
NAT = 0x10 | 0x20  # IPS_SRC_NAT | IPS_DST_NAT
PRIORITY = 101  # srcnat + 1


def _table() -> dict[str, Any]:
    return {"table": {"family": FAMILY, "name": TABLE}}


def commands() -> list[dict[str, Any]]:
    """The table as one transaction's commands (a previous run's replaced in it)."""
    rule = [
        {"match": {"op": "==", "left": {"&": [{"meta": {"key": "mark"}}, MARK]}, "right": MARK}},
        {"match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": "new"}},
        {"match": {"op": "==", "left": {"&": [{"ct": {"key": "status"}}, NAT]}, "right": 0}},
        {"mangle": {"key": {"ct": {"key": "event"}}, "value": 0}},
        {"mangle": {"key": {"ct": {"key": "mark"}}, "value": {"|": [{"ct": {"key": "mark"}}, CTMARK]}}},
    ]
    return [
        {"add": _table()}, {"delete": _table()}, {"add": _table()},
        {"add": {"chain": {"family": FAMILY, "table": TABLE, "name": CHAIN, "type": "nat",
                           "hook": "postrouting", "prio": PRIORITY, "policy": "accept"}}},
        {"add": {"rule": {"family": FAMILY, "table": TABLE, "chain": CHAIN, "expr": rule}}},
    ]


def install(netns: str | None = None) -> None:
    """Make (or remake) the table in this namespace (or ``netns``, a path).  Raises NftError (one line)."""
    nft = Nft(netns=netns)
    try:
        nft.run(commands())
    finally:
        nft.close()


def renew(netns: str | None = None) -> bool:
    """Remake the table as this version writes it if an earlier run left it (an upgrade: the old
    rule may not mark the entries it masks, which this version's programs require before they
    record a connection -- with the old rule beside them, a connection would be masked and
    recorded by nobody).  Called before the programs are loaded.  Returns whether it was there.
    Raises NftError (one line)."""
    nft = Nft(netns=netns)
    try:
        try:
            nft.run([{"list": _table()}])
        except NftError as err:
            if "No such file or directory" in str(err):
                return False
            raise
        nft.run(commands())
        return True
    finally:
        nft.close()


def remove() -> None:
    """Delete the table if it is there.  Raises NftError (one line)."""
    nft = Nft()
    try:
        nft.run([{"add": _table()}, {"delete": _table()}])  # nothing to delete is no error this way
    finally:
        nft.close()


def remove_quietly() -> None:
    """:func:`remove`, and quietly nothing where libnftables cannot be had."""
    with contextlib.suppress(OSError, NftError):
        remove()


class FlowMask:
    """What the flow recorder is handed (it imports nothing of agentd.nft): install and
    remove the table."""

    install = staticmethod(install)
    remove = staticmethod(remove_quietly)
