"""The etcd transactions behind subnet allocation (used by agentd.datastore.store).

Each function is one round trip.  ``claim`` is the only way a subnet key is ever
created: a transaction that puts it only if it is exactly as we last saw it (absent,
``version == 0``; or ours at the revision we read), so two nodes can never both win.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import IPv4Network

from aetcd import transactions as tx
from aetcd.utils import prefix_range_end

from agentd.datastore.etcd import EtcdClient, is_lease_not_found
from agentd.datastore.records import (
    RecordError,
    SubnetLease,
    node_key,
    parse_node,
    parse_subnet_key,
    subnet_key,
    subnets_prefix,
)

ReportBad = Callable[[bytes, int, Exception], None]


class Claim(enum.Enum):
    WON = "won"
    TAKEN = "taken"  # another node holds the candidate now
    RETRY = "retry"  # something else changed under us: read etcd again
    LEASE_GONE = "lease gone"  # our etcd lease no longer exists


@dataclass(frozen=True)
class Entry:
    """One subnet key as read from etcd; ``record`` is None if the value is malformed."""

    mod_revision: int
    lease: int
    record: SubnetLease | None


@dataclass(frozen=True)
class SubnetView:
    """Every subnet key, and the subnet named by the node's own record, at one revision."""

    entries: dict[IPv4Network, Entry]
    node_subnet: IPv4Network | None

    def held_by(self, node: str) -> dict[IPv4Network, Entry]:
        return {s: e for s, e in self.entries.items() if e.record is not None and e.record.node == node}


async def read_subnets(client: EtcdClient, prefix: str, node: str, report_bad: ReportBad) -> SubnetView:
    head = subnets_prefix(prefix)
    _, (subnets, node_kvs) = await client.transaction(
        compare=[],
        success=[tx.Get(head, prefix_range_end(head)), tx.Get(node_key(prefix, node))],
        failure=[],
    )
    entries: dict[IPv4Network, Entry] = {}
    for value, kv in subnets:
        try:
            subnet = parse_subnet_key(prefix, kv.key)
        except RecordError as e:
            report_bad(kv.key, kv.mod_revision, e)
            continue
        try:
            record = SubnetLease.from_json(value, subnet, kv.lease)
        except RecordError as e:
            report_bad(kv.key, kv.mod_revision, e)
            record = None  # unreadable, but the key exists: the subnet is taken
        entries[subnet] = Entry(kv.mod_revision, kv.lease, record)
    node_subnet = None
    for value, kv in node_kvs:
        try:
            node_subnet = parse_node(prefix, kv.key, value).subnet
        except RecordError as e:
            report_bad(kv.key, kv.mod_revision, e)
    return SubnetView(entries, node_subnet)


async def claim(
    client: EtcdClient,
    prefix: str,
    template: SubnetLease,
    candidate: IPv4Network,
    entry: Entry | None,
    stale: dict[IPv4Network, Entry],
    lease_id: int,
) -> Claim:
    """Take ``candidate`` if it is as we saw it (absent, or ours at the revision we
    read) and, in the same transaction, drop the other subnets recorded for us."""
    key = subnet_key(prefix, candidate)
    value = dataclasses.replace(template, subnet=candidate).to_json()
    compare = [tx.Version(key) == 0] if entry is None else [tx.Mod(key) == entry.mod_revision]
    compare += [tx.Mod(subnet_key(prefix, s)) == e.mod_revision for s, e in stale.items()]
    success = [tx.Put(key, value, lease=lease_id)] + [tx.Delete(subnet_key(prefix, s)) for s in stale]
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
    """Replace our subnet record ``old`` by ``new`` (same subnet, same lease) if it is unchanged."""
    key = subnet_key(prefix, old.subnet)
    ok, _ = await client.transaction(
        compare=[tx.Value(key) == old.to_json()],
        success=[tx.Put(key, new.to_json(), lease=new.lease_id)],
        failure=[],
    )
    return ok


async def release(client: EtcdClient, prefix: str, held: dict[IPv4Network, Entry]) -> bool:
    """Delete the given subnet keys if none changed since we read them."""
    keys = {subnet_key(prefix, s): e.mod_revision for s, e in held.items()}
    ok, _ = await client.transaction(
        compare=[tx.Mod(k) == rev for k, rev in keys.items()],
        success=[tx.Delete(k) for k in keys],
        failure=[],
    )
    return ok
