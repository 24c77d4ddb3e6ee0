"""The etcd transactions behind subnet allocation (used by agentd.datastore.store).

Each function is one round trip.  ``claim`` is the only way a subnet key is ever
created: a transaction that puts it only if it is exactly as we last saw it (absent,
``version == 0``; or ours at the revision we read), so two nodes can never both win.

A readable subnet record under no etcd lease is a reservation (flannel's
Documentation/reservations.md: "removing the TTL from a lease will convert it to a
reservation"): the node it names holds the subnet for good, and claims it without a lease
(``Entry.reserved``) -- it never expires with the node's lease.  Only an operator deletes it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network

from aetcd import transactions as tx
from aetcd.utils import prefix_range_end

from agentd.datastore.etcd import EtcdClient, is_lease_not_found
from agentd.datastore.records import (
    NonCanonicalSubnetKey,
    RecordError,
    SubnetLease,
    node_key,
    parse_node,
    parse_subnet_key,
    subnet_key,
    subnets_prefix,
)

ReportBad = Callable[[bytes, int, Exception], None]
Network = IPv4Network | IPv6Network

# A claim also checks, in its transaction, that none of the subnets around the candidate up
# to this many bits shorter was leased meanwhile (by a node whose cluster record still had a
# shorter subnet_len); each is one compare, and etcd takes at most 128 (--max-txn-ops).
WIDER_CHECKED = 16


def wider_subnets(candidate: Network) -> list[Network]:
    """The subnets around ``candidate`` a claim of it checks are not leased (WIDER_CHECKED)."""
    return [candidate.supernet(new_prefix=n) for n in range(max(0, candidate.prefixlen - WIDER_CHECKED),
                                                             candidate.prefixlen)]


class Claim(enum.Enum):
    WON = "won"
    TAKEN = "taken"  # another node holds the candidate now
    RETRY = "retry"  # something else changed under us: read etcd again
    LEASE_GONE = "lease gone"  # our etcd lease no longer exists


@dataclass(frozen=True)
class Entry:
    """One subnet key as read from etcd; ``record`` is None if the value is malformed (or the key
    is not the subnet's ``subnet_key``: records.NonCanonicalSubnetKey)."""

    mod_revision: int
    lease: int
    record: SubnetLease | None
    create_revision: int = 0  # when the key was made (kept across rewrites): the earliest of overlapping leases holds

    @property
    def reserved(self) -> bool:
        """A reservation for the node it names: a readable record under no etcd lease (module doc)."""
        return self.lease == 0 and self.record is not None


@dataclass(frozen=True)
class SubnetView:
    """Every subnet key, and the subnets named by the node's own record (by IP version), at one
    revision."""

    entries: dict[Network, Entry]
    node_subnets: dict[int, Network]

    @property
    def node_subnet(self) -> Network | None:
        return self.node_subnets.get(4)

    def held_by(self, node: str, version: int | None = None) -> dict[Network, Entry]:
        """The subnets recorded for ``node`` (of IP ``version``; None: of both)."""
        return {s: e for s, e in self.entries.items()
                if e.record is not None and e.record.node == node and version in (None, s.version)}


async def read_subnets(client: EtcdClient, prefix: str, node: str, report_bad: ReportBad) -> SubnetView:
    head = subnets_prefix(prefix)
    _, (subnets, node_kvs) = await client.transaction(
        compare=[],
        success=[tx.Get(head, prefix_range_end(head)), tx.Get(node_key(prefix, node))],
        failure=[],
    )
    entries: dict[Network, Entry] = {}
    for value, kv in subnets:
        try:
            subnet = parse_subnet_key(prefix, kv.key)
        except NonCanonicalSubnetKey as e:
            # Not skipped (its subnet would look free while this key holds it), and never ours
            # or anyone's (every compare and delete is on subnet_key): the subnet is taken, by
            # an unreadable record, unless its own key is there too (that one holds it).
            report_bad(kv.key, kv.mod_revision, e)
            entries.setdefault(e.subnet, Entry(kv.mod_revision, kv.lease, None, kv.create_revision))
            continue
        except RecordError as e:
            report_bad(kv.key, kv.mod_revision, e)
            continue
        try:
            record = SubnetLease.from_json(value, subnet, kv.lease)
        except RecordError as e:
            report_bad(kv.key, kv.mod_revision, e)
            record = None  # unreadable, but the key exists: the subnet is taken
        entries[subnet] = Entry(kv.mod_revision, kv.lease, record, kv.create_revision)
    node_subnets: dict[int, Network] = {}
    for value, kv in node_kvs:
        try:
            record = parse_node(prefix, kv.key, value)
        except RecordError as e:
            report_bad(kv.key, kv.mod_revision, e)
            continue
        node_subnets = {s.version: s for s in (record.subnet, record.subnet_v6) if s is not None}
    return SubnetView(entries, node_subnets)


def earlier_overlaps(view: SubnetView, candidate: Network, node: str) -> list[Network]:
    """The subnets of other nodes' leases overlapping ``candidate`` whose keys were made before
    ours (``candidate``'s, as ``view`` read it after our claim won): a claim checks that no
    wider subnet is leased, not every narrower one (there may be thousands), so a node that
    claimed a wide subnet while another leased a narrower one inside it (their clusters'
    subnet lengths differ for a while) both win; then the earlier key holds, and the later
    claimant gives its subnet up.  Empty if ``candidate``'s key is gone (the caller reads again)."""
    mine = view.entries.get(candidate)
    if mine is None:
        return []
    return sorted((s for s, e in view.entries.items()
                   if s != candidate and s.version == candidate.version and s.overlaps(candidate)  # type: ignore[arg-type]
                   and (e.record is None or e.record.node != node) and e.create_revision < mine.create_revision),
                  key=str)


def other_overlaps(view: SubnetView, candidate: Network, node: str) -> list[Network]:
    """The subnets of other nodes' leases (or unreadable ones) overlapping ``candidate``."""
    return sorted((s for s, e in view.entries.items()
                   if s != candidate and s.version == candidate.version and s.overlaps(candidate)  # type: ignore[arg-type]
                   and (e.record is None or e.record.node != node)), key=str)


async def claim(
    client: EtcdClient,
    prefix: str,
    template: SubnetLease,
    candidate: Network,
    entry: Entry | None,
    stale: dict[Network, Entry],
    lease_id: int,
    wider: Iterable[Network] = (),
) -> Claim:
    """Take ``candidate`` if it is as we saw it (absent, or ours at the revision we
    read) under ``lease_id`` (0: under none, a reservation of ours) and, in the same
    transaction, drop the other subnets recorded for us.  ``wider``: the subnets around
    ``candidate`` that must not be leased either (a node that leased one meanwhile, its
    cluster's subnet_len shorter, holds ``candidate``'s addresses)."""
    key = subnet_key(prefix, candidate)
    value = dataclasses.replace(template, subnet=candidate).to_json()
    compare = [tx.Version(key) == 0] if entry is None else [tx.Mod(key) == entry.mod_revision]
    compare += [tx.Version(subnet_key(prefix, s)) == 0 for s in wider if s not in stale]
    compare += [tx.Mod(subnet_key(prefix, s)) == e.mod_revision for s, e in stale.items()]
    success = [tx.Put(key, value, lease=lease_id or None)] + [tx.Delete(subnet_key(prefix, s)) for s in stale]
    try:
        ok, responses = await client.transaction(compare=compare, success=success, failure=[tx.Get(key)])
    except Exception as exc:
        if is_lease_not_found(exc):
            return Claim.LEASE_GONE
        raise
    if ok:
        return Claim.WON
    current = responses[0]
    if not current:
        return Claim.RETRY  # deleted meanwhile, or one of our stale keys changed
    held_value, held = current[0]
    if held.lease == lease_id and held_value == value:
        return Claim.WON  # an earlier attempt whose reply was lost did succeed
    return Claim.TAKEN if entry is None else Claim.RETRY


async def rewrite(client: EtcdClient, prefix: str, old: SubnetLease, new: SubnetLease) -> bool:
    """Replace our subnet record ``old`` by ``new`` (same subnet, same lease; None: a reservation,
    under no lease) if it is unchanged -- its value and the lease it is stored under, as flannel's
    TTL follows what is stored.  aetcd cannot compare a key's lease: the key is read first, and
    the put compares the revision read.  Under another lease (an operator turned our lease into
    a reservation, or ended one): not written; the keepalive takes the change on."""
    key = subnet_key(prefix, old.subnet)
    value = new.to_json()
    kv = await client.get(key)
    if kv is None or kv.lease != (old.lease_id or 0):
        return False
    ok, responses = await client.transaction(
        compare=[tx.Value(key) == old.to_json(), tx.Mod(key) == kv.mod_revision],
        success=[tx.Put(key, value, lease=new.lease_id)],
        failure=[tx.Get(key)],
    )
    if ok:
        return True
    current = responses[0]
    # An earlier attempt whose reply was lost (the request is retried) did write it.
    return bool(current) and current[0][0] == value and current[0][1].lease == (new.lease_id or 0)


async def put_unchanged(client: EtcdClient, prefix: str, lease: SubnetLease, mod_revision: int) -> bool:
    """Put our record ``lease`` (under ``lease.lease_id``; None: under no lease, a reservation)
    if its key is unchanged since ``mod_revision``; True if written."""
    key = subnet_key(prefix, lease.subnet)
    ok, _ = await client.transaction(
        compare=[tx.Mod(key) == mod_revision],
        success=[tx.Put(key, lease.to_json(), lease=lease.lease_id)],
        failure=[],
    )
    return bool(ok)


async def release(client: EtcdClient, prefix: str, held: dict[Network, Entry]) -> bool:
    """Delete the given subnet keys if none changed since we read them."""
    keys = {subnet_key(prefix, s): e.mod_revision for s, e in held.items()}
    ok, responses = await client.transaction(
        compare=[tx.Mod(k) == rev for k, rev in keys.items()],
        success=[tx.Delete(k) for k in keys],
        failure=[tx.Get(k) for k in keys],
    )
    # All gone: an earlier attempt whose reply was lost (the request is retried) deleted them.
    return ok or not any(responses)
