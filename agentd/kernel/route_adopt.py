"""Route adoption: taking over the routes of ours the kernel already holds.  Pure.

A restarted agent finds the routes its previous run left (our protocol, our table).  They
become the programmer's view of the kernel as they are, so nothing is torn down and put
back: a desired route that is already there is never touched (``adopt``).  The same
filing runs after every full re-read of the kernel.

An add that meets EEXIST means a route holds the key (dst, metric) in our table that we
had not heard of: ``classify_existing`` looks at the table's routes with that key and
says whose it is: ours (adopt it, then replace it if it differs) or another protocol's
(a conflict: left alone and reported).  agentd.kernel.routing does the reading.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from typing import NamedTuple

from agentd.kernel import netlink as nl
from agentd.kernel.route_model import (
    PROTOCOL_NAMES,
    RTM_F_CLONED,
    ZERO_ADDRESS,
    Group,
    Route,
    Stray,
    Unreadable,
    ecmp,
    kernel_metric,
    kernel_route,
    same_hop,
    same_route,
    stray_of,
    stray_of_own,
    takes,
)


def file_route(route: Route, kernel: dict[str, Route], strays: set[Stray], desired: dict[str, Route]) -> None:
    """File one of our kernel routes: the route for its dst, or a stray."""
    dst = route.dst
    have = kernel.get(dst)
    if have is None or kernel_metric(have) == kernel_metric(route):
        kernel[dst] = route
        return
    # Two routes of ours for one dst (different metrics): the one holding the desired
    # route's key is its route (replaced in place if it differs); the other is a stray.
    want = desired.get(dst)
    if want is not None and kernel_metric(want) == kernel_metric(route):
        kernel[dst], route = route, have
    strays.add(stray_of_own(route))


def file_group(group: Group, kernel: dict[str, Route], strays: set[Stray], desired: dict[str, Route],
               foreign: Container[Stray] = frozenset(), everything: bool = False,
               known: Container[str] = frozenset()) -> None:
    """File an IPv6 multipath route of ours, next hop by next hop: one becomes the route for
    its dst (the desired one if it is there, else the one already filed, else the first, the
    one the message's protocol is certainly of); every other one is a stray deleted by its
    gateway and device, which the kernel does only if that next hop is ours: another
    daemon's appended to our route stays (Felix/BIRD coexistence).  Next hops in ``foreign``
    (their delete met ESRCH: another daemon's) are not filed at all.

    A group whose first next hop is another daemon's (``group.foreign``: ours appended to
    theirs, or theirs left first when our old next hop went): that one is never filed; of
    the others, the one that is our desired route (or the one already filed) is the route
    for its dst; they are strays only for a dst we route (desired, or ``known``: ours in the
    kernel as last seen) or with ``everything``
    (``agentd leave``): otherwise every other daemon's multipath route would be tried, next
    hop by next hop."""
    hops = group.hops[1:] if group.foreign else group.hops
    chosen: Route | None = None
    chosen_hop: Stray | None = None
    if any(route is not None for route, _hop in hops):
        dst = hops[0][1].text
        want, have = desired.get(dst), kernel.get(dst)
        if want is not None:
            chosen, chosen_hop = next(((r, h) for r, h in hops if r is not None and same_route(want, r)), (None, None))
            if chosen is None and group.foreign and ecmp(want):
                # The message's attributes (MTU, source) are its first next hop's, another
                # daemon's: ours with the desired next hop is taken as the desired route.
                r, chosen_hop = next(((r, h) for r, h in hops if r is not None and same_hop(want, r)
                                      and kernel_metric(want) == kernel_metric(r)), (None, None))
                if r is not None:
                    chosen = kernel_route(r.dst, r.gateway, r.dev, r.onlink, r.kind, r.metric, want.mtu, want.src)
        if chosen is None and have is not None:
            chosen, chosen_hop = next(((r, h) for r, h in hops if r is not None and kernel_metric(r) == kernel_metric(have)
                                       and takes(have, r)), (None, None))
        if chosen is None and not group.foreign and group.hops[0][0] is not None:
            chosen, chosen_hop = group.hops[0]
    if chosen is not None:
        strays.discard(chosen_hop)  # filed as a stray by an earlier report of the group
        file_route(chosen, kernel, strays, desired)
    if group.foreign and not everything and (not hops or (hops[0][1].text not in desired
                                                           and hops[0][1].text not in known)):
        return
    for _route, hop in hops:
        if hop != chosen_hop and hop not in foreign:
            strays.add(hop)


def adopt(found: Iterable[Route | Stray | Group | Unreadable], desired: dict[str, Route],
          foreign: set[Stray] | None = None, everything: bool = False,
          known: Container[str] = frozenset()) -> tuple[dict[str, Route], set[Stray]]:
    """Our routes as a dump of the kernel found them -> (route per dst, strays).  An
    Unreadable is filed as nothing: never deleted, and a desired route for its key is added
    (EEXIST then says whose route holds the key); with ``everything`` (``agentd leave``) the
    next hops of it that did decode are strays.  ``foreign``: other daemons' next hops in
    our multipath routes, not filed as strays; the ones the dump no longer holds are dropped
    from it (in place).  ``everything``: every next hop that may be ours is filed, ``known``:
    the dsts of our routes as last seen (see file_group)."""
    kernel: dict[str, Route] = {}
    strays: set[Stray] = set()
    seen: set[Stray] = set()
    for item in found:
        if type(item) is Route:
            file_route(item, kernel, strays, desired)
        elif type(item) is Group:
            if foreign:
                file_group(item, kernel, strays, desired, foreign, everything, known)
                seen.update(hop for _route, hop in item.hops)
            else:
                file_group(item, kernel, strays, desired, everything=everything, known=known)
        elif type(item) is Unreadable:
            if everything:
                strays.update(item.hops)
        else:
            strays.add(item)
    if foreign:
        foreign &= seen
    return kernel, strays


def route_key(route: Route) -> tuple[int, bytes, int, int]:
    """The key the kernel files a route under in its table: (family, dst, dst_len, metric)."""
    stray = stray_of(route)
    return (stray.family, stray.dst, stray.dst_len, kernel_metric(route))


class Existing(NamedTuple):
    """``classify_existing``'s verdict on the adds that met EEXIST."""

    own: list[Route]  # ours, but not the desired route: replace it
    adopted: dict[str, Route]  # ours as the kernel has it, per dst
    conflicts: list[tuple[str, str]]  # another protocol's route holds the key
    unexplained: list[tuple[str, str]]  # nothing holds it (gone meanwhile?)
    # IPv6: ours (adopted) is a next hop among others, maybe other daemons': the desired
    # route is appended and the adopted next hop deleted by its gateway (a replace would take
    # every next hop of the key)
    swaps: list[Route]


def classify_existing(
    routes: list[Route],
    messages: Iterable[nl.RouteMessage],
    *,
    table: int,
    protocol: int,
    route_of: Callable[[nl.RouteMessage], Route | None],
    found_of: Callable[[nl.RouteMessage], object] | None = None,
) -> Existing:
    """Whose route holds the key of each of ``routes``, from the table's ``messages``.
    Ours wins over another protocol's route with the same key (only one can be there, but
    a dump may hold both for a moment).

    An IPv6 gateway route (``found_of`` given) is looked for among the next hops at its key:
    the kernel reports a multipath route once, with its first next hop's protocol, and ours
    may be any of them.  Ours with the desired next hop is adopted; the first next hop of a
    route of ours is ours (then ours is changed next hop by next hop); a next hop with the
    desired gateway behind another daemon's first one is taken as ours (whoever's, the
    kernel refuses a second one with that gateway and device); another daemon's first next
    hop with it, or only other daemons' routes, are a conflict."""
    wanted = {route_key(route): route for route in routes}
    holders: dict[Route, nl.RouteMessage] = {}
    every: dict[Route, list[nl.RouteMessage]] = {}
    for msg in messages:
        if msg.table != table or msg.tos or msg.flags & RTM_F_CLONED or msg.family not in ZERO_ADDRESS:
            continue
        key = (msg.family, msg.dst or ZERO_ADDRESS[msg.family], msg.dst_len, msg.priority or 0)
        route = wanted.get(key)
        if route is not None:
            every.setdefault(route, []).append(msg)
            if route not in holders or msg.protocol == protocol:
                holders[route] = msg
    result = Existing([], {}, [], [], [])
    for route in routes:
        msg = holders.get(route)
        if msg is None:
            result.unexplained.append((route.dst, "EEXIST, but no route with this destination and metric was found"))
        elif found_of is not None and ecmp(route) and _next_hop_holder(route, every[route], protocol, found_of,
                                                                        result):
            pass
        elif msg.protocol == protocol:
            adopted = route_of(msg)
            if adopted is not None:
                result.adopted[route.dst] = adopted
            if adopted is None or not same_route(route, adopted):
                result.own.append(route)
        else:
            name = PROTOCOL_NAMES.get(msg.protocol, str(msg.protocol))
            result.conflicts.append((route.dst, f"{route.dst}: table {table} already has a proto {name} route "
                                                "with this destination and metric; left alone"))
    return result


def _next_hop_holder(want: Route, messages: list[nl.RouteMessage], protocol: int,
                     found_of: Callable[[nl.RouteMessage], object], result: Existing) -> bool:
    """File the verdict on an IPv6 gateway route whose key holds these messages, if one of
    them is a multipath route or holds its next hop (else the plain verdict applies)."""
    grouped = False
    own_first: Route | None = None
    for msg in messages:
        found = found_of(msg) if msg.multipath is not None else None
        if type(found) is Group:
            grouped = True
            hops = [(route, i == 0) for i, (route, _hop) in enumerate(found.hops)]
        elif msg.multipath is None:
            hops = [(found_of(msg), True)]
        else:
            continue  # undecodable: nobody can say
        for hop, first in hops:
            if type(hop) is not Route:
                continue
            if first and msg.protocol == protocol and own_first is None:
                own_first = hop
            if not same_hop(want, hop) or kernel_metric(want) != kernel_metric(hop):
                continue
            if first and msg.protocol != protocol:
                name = PROTOCOL_NAMES.get(msg.protocol, str(msg.protocol))
                reason = (f"{want.dst}: table {msg.table} already has a proto {name} next hop via {want.gateway} "
                          "with this destination and metric; left alone")
                result.conflicts.append((want.dst, reason))
            elif first:  # ours
                result.adopted[want.dst] = hop
                if not same_route(want, hop):
                    result.own.append(want)
            else:  # behind another next hop: its attributes are the first one's
                result.adopted[want.dst] = want if want.dev is not None else kernel_route(
                    hop.dst, hop.gateway, hop.dev, hop.onlink, hop.kind, hop.metric, want.mtu, want.src)
            return True
    if own_first is not None and grouped:
        result.adopted[want.dst] = own_first
        result.swaps.append(want)
        return True
    return False
