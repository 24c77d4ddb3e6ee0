"""nftables objects as values, and the plan that turns one ruleset into another in one transaction.

Pure (no kernel): a :class:`Ruleset` maps ``(family, table, kind, name)`` to a frozen object
- a set or map with its elements, a chain with its rules (each rule's JSON expression list,
kept as canonical JSON text so rules compare and hash), a named counter.  :func:`plan`
compares the ruleset the kernel has with the one wanted and returns the libnftables JSON
commands of ONE transaction that gets there incrementally:

* set elements are added and deleted one by one (a pod appearing is one ``add element``);
  interval sets (ipBlocks) are flushed and refilled, since the kernel merges intervals;
* a chain whose rules changed is flushed and refilled in the same transaction, so packets
  see the old rules or the new ones, never an empty chain;
* an object whose contents the agent does not know (found in the kernel at start:
  ``contents_known`` False) is refilled the same way: adopting a previous run's tables
  never leaves a moment with fewer rules than before;
* a set wanted with ``contents_known`` False (whoever wants it cannot say yet what it holds:
  masquerading's members before the node list is read) keeps what the kernel holds, and is
  refilled once it is wanted with its contents.

The order inside the transaction keeps every reference valid: first an object wanted in
another shape under its name (a set's type, a chain's hook changed: upgrades) is deleted,
the chains and verdict maps that may refer to it flushed before (and refilled below) -- the
kernel refuses to add a name it still holds; then tables, new sets, counters and (empty)
chains, then chain contents, then elements (verdict maps jump to chains that exist by
then), then what is no longer wanted, flushed before deleted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from ipaddress import IPv4Network
from typing import Any, Union

Element = Any  # str | int | tuple (a concatenation) | IPv4Network (an interval) | (key, value) for maps
ObjKey = tuple[str, str, str, str]  # (family, table, kind, name); kind: set | chain | counter
OBJECT_MAPS = ("counter", "quota", "limit")  # maps whose values are named objects


class Elements(AbstractSet[Element]):
    """A set's elements made only when first looked at (:meth:`_build`, once), standing for
    the frozenset they make: it compares, hashes, iterates and combines as that frozenset.
    A large map changed by a few elements and carried with its ``delta`` is planned without
    them (:func:`plan` takes the delta), so a change does not copy the whole map; they are
    made where the plan compares whole sets (the kernel's copy not the delta's base, its
    contents unknown, an interval set, a new set).  A subclass says how (:meth:`_build`)."""

    __slots__ = ("_frozen",)

    def __init__(self) -> None:
        self._frozen: frozenset[Element] | None = None

    def _build(self) -> Iterable[Element]:
        raise NotImplementedError

    def _forget(self) -> None:
        """Let go of what :meth:`_build` used (called once they are made)."""

    @property
    def made(self) -> bool:
        return self._frozen is not None

    def frozen(self) -> frozenset[Element]:
        if self._frozen is None:
            self._frozen = frozenset(self._build())
            self._forget()
        return self._frozen

    def __len__(self) -> int:
        return len(self.frozen())

    def __iter__(self) -> Iterator[Element]:
        return iter(self.frozen())

    def __contains__(self, e: object) -> bool:
        return e in self.frozen()

    def __eq__(self, other: object) -> bool:
        return self.frozen() == _plain(other)

    def __hash__(self) -> int:
        return hash(self.frozen())

    def __le__(self, other: Any) -> bool:
        return self.frozen() <= _plain(other)

    def __ge__(self, other: Any) -> bool:
        return self.frozen() >= _plain(other)

    def __lt__(self, other: Any) -> bool:
        return self.frozen() < _plain(other)

    def __gt__(self, other: Any) -> bool:
        return self.frozen() > _plain(other)

    def __sub__(self, other: Any) -> frozenset[Element]:  # type: ignore[override]
        return self.frozen() - _plain(other)

    def __rsub__(self, other: Any) -> frozenset[Element]:
        return _plain(other) - self.frozen()

    def __or__(self, other: Any) -> frozenset[Element]:  # type: ignore[override]
        return self.frozen() | _plain(other)

    __ror__ = __or__

    def __and__(self, other: Any) -> frozenset[Element]:  # type: ignore[override]
        return self.frozen() & _plain(other)

    __rand__ = __and__

    def __xor__(self, other: Any) -> frozenset[Element]:  # type: ignore[override]
        return self.frozen() ^ _plain(other)

    __rxor__ = __xor__

    def __repr__(self) -> str:
        return f"{type(self).__name__}({set(self.frozen())!r})" if self.made else f"{type(self).__name__}(not made)"


def _plain(x: Any) -> Any:
    return x.frozen() if isinstance(x, Elements) else x


@dataclass(frozen=True)
class NftSet:
    family: str
    table: str
    name: str
    type: tuple[str, ...]  # one type, or the parts of a concatenation
    map: str | None = None  # the data type of a map ("verdict", "ether_addr"); None: a set
    flags: tuple[str, ...] = ()
    elements: frozenset[Element] | Elements = frozenset()  # Elements: made when looked at
    contents_known: bool = True
    timeout: int | None = None  # seconds: elements expire (a dynamic set the kernel fills: Services' affinity)
    # How this set differs from an earlier version of it, when whoever made it knows exactly:
    # (that version, elements added, elements removed).  plan() then takes the difference as
    # given instead of comparing two large sets, if that version is what the kernel holds.
    delta: tuple[Any, frozenset[Element], frozenset[Element]] | None = field(default=None, compare=False, repr=False)

    kind = "set"

    @property
    def key(self) -> ObjKey:
        return (self.family, self.table, "set", self.name)

    @property
    def interval(self) -> bool:
        return "interval" in self.flags

    def same_shape(self, other: NftSet) -> bool:
        """Whether the two are one set but for their elements.  ``dynamic`` is not compared:
        nft gives it itself to a set that rules fill (``update @aff``), and may list it (a
        newer nft in JSON) for a set declared without it -- taken for another shape, the set
        would be deleted and made again while rules use it, a transaction the kernel refuses."""
        return (self.type, self.map, _declared(self.flags), self.timeout) == (
            other.type, other.map, _declared(other.flags), other.timeout)

    @property
    def dynamic(self) -> bool:
        return "dynamic" in self.flags or self.timeout is not None

    def declaration(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "family": self.family,
            "table": self.table,
            "name": self.name,
            "type": self.type[0] if len(self.type) == 1 else list(self.type),
        }
        if self.map is not None:
            body["map"] = self.map
        if self.flags:
            body["flags"] = list(self.flags)
        if self.timeout is not None:
            body["timeout"] = self.timeout
        return {"map" if self.map is not None else "set": body}


@dataclass(frozen=True)
class NftChain:
    family: str
    table: str
    name: str
    rules: tuple[str, ...] = ()  # JSON text of each rule's "expr" list
    hook: tuple[str, str, int, str] | None = None  # (type, hook, priority, policy) of a base chain
    contents_known: bool = True

    kind = "chain"

    @property
    def key(self) -> ObjKey:
        return (self.family, self.table, "chain", self.name)

    def declaration(self) -> dict[str, Any]:
        body: dict[str, Any] = {"family": self.family, "table": self.table, "name": self.name}
        if self.hook is not None:
            kind, hook, prio, policy = self.hook
            body.update(type=kind, hook=hook, prio=prio, policy=policy)
        return {"chain": body}


@dataclass(frozen=True)
class NftCounter:
    family: str
    table: str
    name: str
    contents_known: bool = True

    kind = "counter"

    @property
    def key(self) -> ObjKey:
        return (self.family, self.table, "counter", self.name)

    def declaration(self) -> dict[str, Any]:
        return {"counter": {"family": self.family, "table": self.table, "name": self.name}}


NftObject = Union[NftSet, NftChain, NftCounter]


@dataclass
class Ruleset:
    """The objects of the agent's tables; ``tables`` are the (family, name) pairs it owns."""

    tables: frozenset[tuple[str, str]] = frozenset()
    objects: dict[ObjKey, NftObject] = field(default_factory=dict)

    def add(self, obj: NftObject) -> None:
        self.objects[obj.key] = obj

    def chains(self) -> list[NftChain]:
        return [o for o in self.objects.values() if isinstance(o, NftChain)]

    def sets(self) -> list[NftSet]:
        return [o for o in self.objects.values() if isinstance(o, NftSet)]

    def counters(self) -> list[NftCounter]:
        return [o for o in self.objects.values() if isinstance(o, NftCounter)]

    def size(self) -> dict[str, int]:
        """How big the ruleset is: objects of each kind, rules, set elements."""
        return {
            "chains": len(self.chains()),
            "rules": sum(len(c.rules) for c in self.chains()),
            "sets": len(self.sets()),
            "elements": sum(len(s.elements) for s in self.sets()),
            "counters": len(self.counters()),
        }


def rule_text(expr: list[dict[str, Any]]) -> str:
    """A rule's expression list as canonical JSON (what :class:`NftChain` keeps)."""
    return json.dumps(expr, sort_keys=True, separators=(",", ":"))


# ------------------------------------------------------------------ elements as JSON


def element_json(e: Element, is_map: bool) -> Any:
    if is_map:
        key, value = e
        return [element_json(key, False), _value_json(value)]
    if isinstance(e, tuple):
        return {"concat": [element_json(x, False) for x in e]}
    if isinstance(e, IPv4Network):
        if e.prefixlen == 32:
            return str(e.network_address)
        return {"prefix": {"addr": str(e.network_address), "len": e.prefixlen}}
    return e


def _value_json(value: Any) -> Any:
    if isinstance(value, tuple) and value and value[0] in ("jump", "goto"):
        return {value[0]: {"target": value[1]}}
    return value


# ------------------------------------------------------------------ the plan


def _obj_ref(obj: NftObject) -> dict[str, Any]:
    kind = "map" if isinstance(obj, NftSet) and obj.map is not None else obj.kind
    return {kind: {"family": obj.family, "table": obj.table, "name": obj.name}}


def _elements(s: NftSet, elements: Iterable[Element], *, keys_only: bool = False) -> dict[str, Any]:
    if keys_only and s.map is not None:
        elem = [element_json(k, False) for k, _ in sorted(elements, key=_sort_key)]
    else:
        elem = [element_json(e, s.map is not None) for e in sorted(elements, key=_sort_key)]
    return {"element": {"family": s.family, "table": s.table, "name": s.name, "elem": elem}}


def _sort_key(e: Element) -> str:
    return repr(e)


class RuleExpr(str):
    """A rule's expression list as the canonical JSON text its :class:`NftChain` keeps, in a
    command as it is: :func:`command_json` writes it into the transaction unchanged, where
    parsing it into objects to serialise them again cost time and, for a table's first sync
    (Services' prepared slots: ~700 commands), MBs of objects held while libnftables parses."""

    __slots__ = ()

    def value(self) -> list[dict[str, Any]]:
        return json.loads(self)


def _rules(chain: NftChain) -> list[dict[str, Any]]:
    return [
        {"add": {"rule": {"family": chain.family, "table": chain.table, "chain": chain.name, "expr": RuleExpr(r)}}}
        for r in chain.rules
    ]


def command_json(command: dict[str, Any]) -> str:
    """One command of a transaction as libnftables' JSON (``json.dumps``'s text), a
    :class:`RuleExpr` spliced in as the JSON it is."""
    (verb, body), = command.items()
    rule = body.get("rule") if isinstance(body, dict) else None
    if isinstance(rule, dict) and isinstance(rule.get("expr"), RuleExpr):
        rest = json.dumps({k: v for k, v in rule.items() if k != "expr"})
        return f'{{{json.dumps(verb)}: {{"rule": {rest[:-1]}, "expr": {rule["expr"]}}}}}}}'
    return json.dumps(command)


def _declared(flags: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f for f in flags if f != "dynamic")


def plan(current: Ruleset, desired: Ruleset, keys: Iterable[ObjKey] | None = None) -> list[dict[str, Any]]:
    """The commands of one transaction taking the kernel from ``current`` to ``desired``.

    ``keys``: the only objects that may differ (the engine knows what it recompiled); None
    compares everything."""
    if keys is not None:
        keys = sorted(keys)
        want_items = [(k, desired.objects[k]) for k in keys if k in desired.objects]
        have_items = [(k, current.objects[k]) for k in keys if k in current.objects]
    else:
        want_items = list(desired.objects.items())
        have_items = list(current.objects.items())
    adds: list[dict[str, Any]] = []
    contents: list[dict[str, Any]] = []
    element_adds: list[dict[str, Any]] = []
    element_dels: list[dict[str, Any]] = []
    flushes: list[dict[str, Any]] = []
    deletes: list[dict[str, Any]] = []
    verdict_maps: list[dict[str, Any]] = []

    for table in sorted(desired.tables - current.tables):
        adds.append({"add": {"table": {"family": table[0], "name": table[1]}}})

    # Objects of another shape under the same name (a set's type, a chain's hook changed:
    # upgrades only) go FIRST, the new one is declared after: the kernel refuses to add a name
    # it still holds (EEXIST), and refuses to delete a set a rule uses or a chain something
    # jumps to (EBUSY).  So the chains and verdict maps that may refer to one (their contents
    # unknown, or naming it) are flushed before it goes, and refilled below from ``desired``,
    # all in this one transaction.
    replaced = _replaced(want_items, current)
    refill = _referring(current, replaced)
    early = [{"flush": _obj_ref(current.objects[k])} for k in sorted(refill)]
    early += [{"flush": _obj_ref(current.objects[k])} for k in sorted(replaced) if k[2] == "chain"]
    early += [{"delete": _obj_ref(current.objects[k])} for k in sorted(replaced) if k[2] == "set"]
    early += [{"delete": _obj_ref(current.objects[k])} for k in sorted(replaced) if k[2] == "chain"]
    for key in sorted(refill):
        again = desired.objects.get(key)
        if isinstance(again, NftChain):
            contents += _rules(again)
        elif isinstance(again, NftSet) and again.elements:
            element_adds.append({"add": _elements(again, again.elements)})

    for key, want in want_items:
        have = current.objects.get(key)
        if key in refill:
            continue  # flushed above, refilled above
        if key in replaced:
            have = None  # deleted above: declared again like a new one
        if isinstance(want, NftSet):
            if have is None:
                adds.append({"add": want.declaration()})
                if want.elements:
                    element_adds.append({"add": _elements(want, want.elements)})
                continue
            assert isinstance(have, NftSet)
            if want.dynamic:
                continue  # its elements are the kernel's (rules add them); adopting keeps them
            if not want.contents_known:
                continue  # not known yet: what the kernel holds stays (applied() keeps it unknown)
            if want.delta is not None and want.delta[0] is have and have.contents_known and not want.interval:
                _base, new, gone = want.delta
                if gone:
                    element_dels.append({"delete": _elements(want, gone, keys_only=True)})
                if new:
                    element_adds.append({"add": _elements(want, new)})
            elif not have.contents_known or (want.interval and have.elements != want.elements):
                contents.append({"flush": _obj_ref(want)})
                if want.elements:
                    element_adds.append({"add": _elements(want, want.elements)})
            elif have.elements != want.elements:
                gone = have.elements - want.elements
                new = want.elements - have.elements
                if gone:
                    # Maps are deleted from by key; a key whose value changed is deleted here
                    # and added again below, in the same transaction.
                    element_dels.append({"delete": _elements(want, gone, keys_only=True)})
                if new:
                    element_adds.append({"add": _elements(want, new)})
        elif isinstance(want, NftChain):
            if have is None:
                adds.append({"add": want.declaration()})
                contents += _rules(want)
            elif not have.contents_known or have.rules != want.rules:
                contents.append({"flush": {"chain": _obj_ref(want)["chain"]}})
                contents += _rules(want)
        elif have is None:
            adds.append({"add": want.declaration()})

    for key, have in have_items:
        if key in desired.objects:
            continue
        if isinstance(have, NftChain):
            flushes.append({"flush": {"chain": _obj_ref(have)["chain"]}})
            deletes.append({"delete": {"chain": _obj_ref(have)["chain"]}})
        elif isinstance(have, NftSet) and have.map == "verdict":
            verdict_maps.append({"delete": _obj_ref(have)})  # its elements may jump to chains going too
        elif isinstance(have, NftSet) and have.map in OBJECT_MAPS:
            # Its elements hold the counters they name (the kernel refuses to delete one still
            # named: EBUSY), and an adopted table lists counters before maps: emptied and
            # deleted before any counter goes (a flush releases them on every kernel).
            verdict_maps += [{"flush": _obj_ref(have)}, {"delete": _obj_ref(have)}]
        else:
            deletes.append({"delete": _obj_ref(have)})
    # Deleting a chain needs its jumps gone first (rules flushed above, vmap elements
    # deleted above, verdict maps that go with the chains deleted before them: the rules
    # that used them are flushed above); object maps go before the counters they name;
    # sets, maps and counters go after every chain that used them.
    deletes.sort(key=lambda c: 0 if "chain" in c["delete"] else 1)
    deletes = verdict_maps + deletes

    gone_tables = sorted(current.tables - desired.tables)
    if gone_tables:
        # A table no longer wanted goes with everything in it (its objects were listed above
        # only to be deleted, which the table's deletion does at once).
        flushes = [c for c in flushes if _table_of(c) not in gone_tables]
        deletes = [c for c in deletes if _table_of(c) not in gone_tables]
        element_dels = [c for c in element_dels if _table_of(c) not in gone_tables]
        deletes += [{"delete": {"table": {"family": f, "name": n}}} for f, n in gone_tables]

    return early + adds + contents + element_dels + element_adds + flushes + deletes


def _replaced(want_items: Iterable[tuple[ObjKey, NftObject]], current: Ruleset) -> set[ObjKey]:
    """The objects wanted under a name the kernel holds an object of another shape under."""
    out = set()
    for key, want in want_items:
        have = current.objects.get(key)
        if isinstance(want, NftSet) and isinstance(have, NftSet):
            other = not want.same_shape(have)
        else:
            other = isinstance(want, NftChain) and isinstance(have, NftChain) and have.hook != want.hook
        if other:
            out.add(key)
    return out


def _referring(current: Ruleset, replaced: set[ObjKey]) -> set[ObjKey]:
    """The chains and verdict maps of ``current`` that may refer to a replaced object: a rule
    using a set (``@name``) or jumping to a chain, a verdict map's element jumping to it.
    Contents the agent does not know may refer to anything.  Erring towards more costs a
    chain flushed and refilled in the same transaction; a base chain is never a jump's
    target (the kernel refuses that), so only a regular chain being replaced has any.

    One pass over ``current``, each rule read once, whatever the number replaced: an upgrade
    changing the shape of thousands of sets planned in time linear in the ruleset (searching
    every rule for each replaced object cost seconds of the event loop at 2,000)."""
    out: set[ObjKey] = set()
    # Per table, what a rule naming a replaced object holds (as JSON strings: a set's
    # reference "@name", a chain's name, a jump's target), and the chains a vmap may jump to.
    needles: dict[tuple[str, str], set[str]] = {}
    targets: dict[tuple[str, str], set[str]] = {}
    for gone in replaced:
        family, table, kind, name = gone
        if kind == "chain" and current.objects[gone].hook is not None:  # type: ignore[union-attr]
            continue
        needles.setdefault((family, table), set()).add(json.dumps("@" + name if kind == "set" else name)[1:-1])
        if kind == "chain":
            targets.setdefault((family, table), set()).add(name)
    if not needles:  # nothing replaced (almost every sync): no walk of the whole ruleset
        return out
    for key, obj in current.objects.items():
        owner = key[:2]
        if key in replaced or owner not in needles:
            continue
        if isinstance(obj, NftChain):
            # Unknown contents are taken as referring without a search.
            refers = not obj.contents_known or any(needles[owner].intersection(_names_in(r)) for r in obj.rules)
        elif isinstance(obj, NftSet) and obj.map == "verdict" and owner in targets:
            refers = not obj.contents_known or any(
                isinstance(v, tuple) and len(v) == 2 and v[1] in targets[owner] for _k, v in obj.elements)
        else:
            continue
        if refers:
            out.add(key)
    return out


_JSON_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _names_in(rule: str) -> set[str]:
    """The strings of a rule's canonical JSON (set references, jump targets among them), as
    ``json.dumps`` wrote them, escapes and all (compared with names written the same way)."""
    return set(_JSON_STRING.findall(rule))


def _table_of(cmd: dict[str, Any]) -> tuple[str, str]:
    body = next(iter(cmd.values()))
    inner = next(iter(body.values()))
    return inner["family"], inner["table"]


def applied(desired: Ruleset) -> Ruleset:
    """What the kernel holds after a successful transaction to ``desired``."""
    return Ruleset(desired.tables, dict(desired.objects))


def unknown_contents(objects: Mapping[ObjKey, NftObject]) -> dict[ObjKey, NftObject]:
    """Objects found in the kernel whose contents are to be rewritten on the first sync."""
    return {k: replace(o, contents_known=False) for k, o in objects.items()}
