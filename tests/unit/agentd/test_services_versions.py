"""Services' Table hands out each changed shared map as a new version carrying its difference
(NftSet.delta), its elements made only when plan() looks at them: one endpoint change costs
the same at 1,000 Services as at 10,000 (review s57/r2: every changed map was copied whole at
each read, 0.44 ms per change at 1,000 Services, 12.5 ms at 20,000)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from agentd.nft.ruleset import NftSet, Ruleset, applied, plan
from agentd.services import compiler
from agentd.services.model import Endpoint, ServicePort


def port(i: int, shift: int = 0, n: int = 4) -> ServicePort:
    eps = tuple(Endpoint(f"10.{(i >> 8) & 255}.{i & 255}.{j + shift}", 80, "n1" if j % 2 else "n2") for j in range(n))
    return ServicePort("ns", f"s{i}", "", "TCP", 80, f"10.96.{i >> 8}.{i & 255}", None, None, False, False, eps)


def table(services: int) -> compiler.Table:
    t = compiler.Table("n1")
    for i in range(services):
        t.update(("ns", f"s{i}"), [port(i)])
    return t


def made_since(rs: Ruleset, before: dict[int, Any]) -> int:
    """The elements of the sets of ``rs`` made (copied whole) since ``before`` (id -> the sets'
    element objects then); a version not made yet counts none."""
    out = 0
    for s in rs.sets():
        e = s.elements
        if id(e) in before or not getattr(e, "made", True):  # an Elements not made yet
            continue
        out += len(e)
    return out


def one_change(services: int) -> tuple[int, list[dict[str, Any]]]:
    """Elements copied by one endpoint change (update, rs, plan, applied) at ``services``; its plan."""
    t = table(services)
    kernel = applied(t.rs)
    plan(Ruleset(), kernel)  # the first sync's plan: every element (made once)
    before = {id(s.elements): s.elements for s in kernel.sets()}
    keys = t.update(("ns", "s7"), [port(7, shift=1)])
    rs = t.rs
    commands = plan(kernel, rs, keys)
    kernel = applied(rs)
    return made_since(kernel, before), commands


def test_one_endpoint_change_copies_no_more_elements_at_10000_services_than_at_1000():
    small, small_plan = one_change(1_000)
    large, large_plan = one_change(10_000)
    assert len(small_plan) == len(large_plan) and small_plan  # the same transaction, elements only
    assert all(next(iter(c)) in ("add", "delete") and "element" in next(iter(c.values())) for c in large_plan)
    # Before: the maps one Service changes (service-ips, addr/I, port/I, ...) copied whole,
    # ~N elements each: 10x the copies at 10x the Services.
    assert large <= small + 10, (small, large)


def _elements(rs: Ruleset, name: str) -> frozenset:
    s = rs.objects[(compiler.FAMILY, compiler.TABLE, "set", name)]
    assert isinstance(s, NftSet)
    return frozenset(s.elements)


def test_a_version_made_later_holds_the_elements_it_was_handed_out_with():
    """Versions not synced in between (a failed pass, a read without a sync): the kernel's,
    made only when plan() compares it with a later one, still has its own elements, and
    the plan from it is the whole difference."""
    t = table(20)
    kernel = applied(t.rs)
    plan(Ruleset(), kernel)  # the first sync makes every set; the next takes the deltas
    keys = t.update(("ns", "s2"), [port(2, shift=1)])
    rs = t.rs
    plan(kernel, rs, keys)
    kernel = applied(rs)
    had = frozenset(t.elements[(compiler.FAMILY, "addr/0")])  # (not made: plan() has taken the deltas)
    expected = []
    for shift in (1, 2, 3):  # read three times, never synced
        t.update(("ns", "s3"), [port(3, shift=shift)])
        expected.append(frozenset(t.elements[(compiler.FAMILY, "addr/0")]))
        rs = t.rs
    t.update(("ns", "s5"), [])  # a change after the last read, before the plan
    old = kernel.objects[(compiler.FAMILY, compiler.TABLE, "set", "addr/0")]
    assert not getattr(old.elements, "made", True)
    commands = plan(kernel, rs)  # the kernel's copy is not the delta's base: whole sets compared
    assert _elements(kernel, "addr/0") == had and _elements(rs, "addr/0") == expected[-1]
    dels = [c["delete"]["element"]["elem"] for c in commands if "delete" in c and c["delete"].get("element", {}).get("name") == "addr/0"]
    adds = [c["add"]["element"]["elem"] for c in commands if "add" in c and c["add"].get("element", {}).get("name") == "addr/0"]
    assert dels == [[{"concat": ["10.96.0.3", "tcp", 80]}]] and adds == [[[{"concat": ["10.96.0.3", "tcp", 80]}, "10.0.3.3"]]]
    # The next read carries s5's removal; every version agrees with the Table's own set.
    rs = t.rs
    assert _elements(rs, "addr/0") == frozenset(t.elements[(compiler.FAMILY, "addr/0")])
    assert all(e[0][0] != "10.96.0.5" for e in _elements(rs, "addr/0"))


def test_a_removed_slot_map_makes_its_last_version_first():
    """A slot map going with its last Service (above SLOTS_MIN): the version the kernel holds
    is made before the Table lets go of its elements."""
    t = compiler.Table("n1")
    big = replace(port(1), endpoints=port(1, n=compiler.SLOTS_MIN + 1).endpoints)
    t.update(("ns", "s1"), [big])
    kernel = applied(t.rs)
    name = f"addr/{compiler.SLOTS_MIN}"
    held = kernel.objects[(compiler.FAMILY, compiler.TABLE, "set", name)]
    assert isinstance(held, NftSet) and not getattr(held.elements, "made", True)
    had = frozenset(t.elements[(compiler.FAMILY, name)])
    assert len(had) == 1
    t.update(("ns", "s1"), [])
    assert getattr(held.elements, "made", False) and held.elements == had
    assert (compiler.FAMILY, compiler.TABLE, "set", name) not in t.rs.objects
