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
    kernel_metric,
    same_route,
    stray_of,
    stray_of_own,
    takes,
)


def file_route(route: Route, kernel: dict[str, Route], strays: set[Stray], desired: dict[str, Route]) -> None:
    """File one of our kernel routes: the route for its dst, or a stray."""
    dst = route.dst
    have = kernel.get(dst)
    if have is None:
        kernel[dst] = route
        return
    want = desired.get(dst)
    if kernel_metric(have) == kernel_metric(route):
        if ":" not in dst or (have.gateway is None) == (route.gateway is None):
            kernel[dst] = route
            return
        # One IPv6 key holds a gateway route of ours and one without (fib6 keeps both): the
        # desired one, else the one a replace by the desired route takes (as ECMP-able as it),
        # is its route; the other a stray, deleted by exactly its gateway or ``::``.
        if want is not None and not same_route(want, have) and (
                same_route(want, route) or (want.gateway is None) == (route.gateway is None)):
            kernel[dst], route = route, have
        strays.add(stray_of_own(route))
        return
    # Two routes of ours for one dst (different metrics): the one holding the desired
    # route's key is its route (replaced in place if it differs); the other is a stray.
    if want is not None and kernel_metric(want) == kernel_metric(route):
        kernel[dst], route = route, have
    strays.add(stray_of_own(route))


def file_group(group: Group, kernel: dict[str, Route], strays: set[Stray], desired: dict[str, Route],
               foreign: Container[Stray] = frozenset()) -> None:
    """File an IPv6 multipath route of ours, next hop by next hop: one becomes the route for
    its dst (the desired one if it is there, else the one already filed, else the first, the
    one the message's protocol is certainly of); every other one is a stray deleted by its
    gateway and device, which the kernel does only if that next hop is ours: another
    daemon's appended to our route stays (Felix/BIRD coexistence).  Next hops in ``foreign``
    (their delete met ESRCH: another daemon's) are not filed at all."""
    routes = [route for route, _hop in group.hops if route is not None]
    chosen = None
    if routes:
        dst = routes[0].dst
        want, have = desired.get(dst), kernel.get(dst)
        if want is not None:
            chosen = next((r for r in routes if same_route(want, r)), None)
        if chosen is None and have is not None:
            chosen = next((r for r in routes if kernel_metric(r) == kernel_metric(have) and takes(have, r)), None)
        if chosen is None:
            chosen = group.hops[0][0]
    for route, hop in group.hops:
        if route is not None and route is chosen:
            strays.discard(hop)  # filed as a stray by an earlier report of the group
            file_route(route, kernel, strays, desired)
        elif hop not in foreign:
            strays.add(hop)


def adopt(found: Iterable[Route | Stray | Group | Unreadable], desired: dict[str, Route],
          foreign: set[Stray] | None = None) -> tuple[dict[str, Route], set[Stray]]:
    """Our routes as a dump of the kernel found them -> (route per dst, strays).  An
    Unreadable is filed as nothing: never deleted, and a desired route for its key is added
    (EEXIST then says whose route holds the key).  ``foreign``: other daemons' next hops in
    our multipath routes, not filed as strays; the ones the dump no longer holds are dropped
    from it (in place)."""
    kernel: dict[str, Route] = {}
    strays: set[Stray] = set()
    seen: set[Stray] = set()
    for item in found:
        if type(item) is Route:
            file_route(item, kernel, strays, desired)
        elif type(item) is Group:
            if foreign:
                file_group(item, kernel, strays, desired, foreign)
                seen.update(hop for _route, hop in item.hops)
            else:
                file_group(item, kernel, strays, desired)
        elif type(item) is not Unreadable:
            strays.add(item)
    if foreign:
        foreign &= seen
    return kernel, strays


def route_key(route: Route) -> tuple[int, bytes, int, int]:
    """The key the kernel files a route under in its table: (family, dst, dst_len, metric)."""
    stray = stray_of(route)
    return (stray.family, stray.dst, stray.dst_len, kernel_metric(route))


def message_key(msg: nl.RouteMessage) -> tuple[int, bytes, int, int]:
    """The key the kernel files a dumped route under: ``route_key``'s, of a message (of a
    family in ZERO_ADDRESS)."""
    return (msg.family, msg.dst or ZERO_ADDRESS[msg.family], msg.dst_len, msg.priority or 0)


class Existing(NamedTuple):
    """``classify_existing``'s verdict on the adds that met EEXIST."""

    own: list[Route]  # ours, but not the desired route: replace it
    adopted: dict[str, Route]  # ours as the kernel has it, per dst
    conflicts: list[tuple[str, str]]  # another protocol's route holds the key
    unexplained: list[tuple[str, str]]  # nothing holds it (gone meanwhile?)


def classify_existing(
    routes: list[Route],
    messages: Iterable[nl.RouteMessage],
    *,
    table: int,
    protocol: int,
    route_of: Callable[[nl.RouteMessage], Route | None],
) -> Existing:
    """Whose route holds the key of each of ``routes``, from the table's ``messages``.
    Ours wins over another protocol's route with the same key (IPv4 has one route per key,
    but a dump may hold both for a moment; an IPv6 key a list of them), and of ours at an
    IPv6 key one as ECMP-able as the route (a gateway route, or one without), the one a
    replace by it takes."""
    wanted = {route_key(route): route for route in routes}
    holders: dict[Route, nl.RouteMessage] = {}
    for msg in messages:
        if (msg.table != table or msg.tos or msg.src_len or msg.flags & RTM_F_CLONED
                or msg.family not in ZERO_ADDRESS):  # (a source prefix: another key)
            continue
        route = wanted.get(message_key(msg))
        if route is None or msg.protocol != protocol and route in holders:
            continue
        held = holders.get(route)
        if held is None or held.protocol != protocol or gateway_route(held) != (route.gateway is not None):
            holders[route] = msg
    result = Existing([], {}, [], [])
    for route in routes:
        msg = holders.get(route)
        if msg is None:
            result.unexplained.append((route.dst, "EEXIST, but no route with this destination and metric was found"))
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


def gateway_route(msg: nl.RouteMessage) -> bool:
    """Does the kernel route have a next hop through a gateway (next hops, RTA_VIA, a nexthop
    object: Linux's rt6_qualify_for_ecmp, roughly)?"""
    return msg.gateway is not None or msg.multipath is not None or msg.via is not None or msg.nh_id is not None


def others_at_keys(routes: list[Route], messages: Iterable[nl.RouteMessage], *, table: int,
                   protocol: int) -> list[tuple[str, str]]:
    """IPv6 routes of ours to be added beside our route at their key
    (agentd.kernel.route_plan.needs_beside) whose key holds another protocol's route, from
    the table's ``messages``: conflicts, one per destination, left alone as an add meeting
    another daemon's route is.  Beside their gateway route, a gateway route of ours would be
    its ECMP sibling, one multipath route (fib6_add_rt2node), our next hop carrying their
    traffic; beside one without a gateway, ours would come after theirs in the key's list,
    and a later replace of ours (it takes the first route as ECMP-able as the new one) take
    theirs.  Their key, as an IPv4 key another protocol's route holds.  (Where theirs has
    our next hop, the add would meet EEXIST.)"""
    wanted = {route_key(route): route for route in routes}
    conflicts: dict[str, str] = {}
    for msg in messages:
        if (msg.protocol == protocol or msg.table != table or msg.tos or msg.src_len or msg.flags & RTM_F_CLONED
                or msg.family not in ZERO_ADDRESS):
            continue
        route = wanted.get(message_key(msg))
        if route is None:
            continue
        name = PROTOCOL_NAMES.get(msg.protocol, str(msg.protocol))
        if route.gateway is not None and gateway_route(msg):
            conflicts[route.dst] = (f"{route.dst}: table {table} already has a proto {name} gateway route with this "
                                    "destination and metric, which ours would join as an ECMP next hop; left alone")
        elif route.dst not in conflicts:
            conflicts[route.dst] = (f"{route.dst}: table {table} already has a proto {name} route with this "
                                    "destination and metric; left alone")
    return list(conflicts.items())
