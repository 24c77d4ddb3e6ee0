"""Who holds a TCP listening port here: the owner uid of a LISTEN socket, from
/proc/net/tcp and /proc/net/tcp6 (their ``uid`` column: the uid of the process that made the
socket; readable by anyone, for this network namespace).

The API's port is an unprivileged one (127.0.0.1:9099): while no agent runs, any local user
can bind it.  The agent names such a squatter when it cannot bind (EADDRINUSE), and the CLI
does not send the API token to a listener owned by someone other than root or the agent's
user (:func:`untrusted_owner`)."""

from __future__ import annotations

import ipaddress
import os
import pwd
import socket
import sys
from collections.abc import Iterable
from pathlib import Path

LISTEN = "0A"  # TCP_LISTEN, as the st column gives it
PROC_NET = Path("/proc/net")  # (tests give fixtures)


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6}'s address: 32-bit words in host byte order, in hex."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(int.from_bytes(raw[i : i + 4], "big").to_bytes(4, sys.byteorder) for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def parse_listeners(text: str) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int, int]]:
    """(local address, port, owner uid) of each LISTEN socket in a /proc/net/tcp{,6} text."""
    out = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 8 or f[3] != LISTEN or ":" not in f[1]:
            continue
        addr, _, port = f[1].rpartition(":")
        try:
            out.append((_address(addr), int(port, 16), int(f[7])))
        except ValueError:
            continue
    return out


def owners(listeners: Iterable[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int, int]], host: str,
           port: int, *, wildcards: bool = True) -> set[int]:  # fmt: skip
    """The uids of the listeners a connection to ``host:port`` may reach: those bound to that
    address (the kernel prefers them), else (``wildcards``: ``host`` is known to be this
    host's) the wildcard ones of its family (an IPv6 wildcard takes IPv4 too, unless v6only)."""
    ip = target(host)
    if ip is None:
        return set()
    exact, wild = set(), set()
    for addr, p, uid in listeners:
        if p != port:
            continue
        if addr == ip or (isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped == ip):
            exact.add(uid)
        elif wildcards and addr.is_unspecified and (addr.version == ip.version or addr.version == 6):
            wild.add(uid)
    return exact or wild


def target(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address ``host`` (an address) is as /proc/net/tcp{,6} give them: without its scope
    (fe80::1%eth0: the listener bound to fe80::1 is what a connection to it reaches) and an
    IPv4-mapped one as IPv4 (an AF_INET6 connect to ::ffff:127.0.0.1 reaches 127.0.0.1's
    listeners).  None when it is no address."""
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def reached(address: str) -> str:
    """The address a connection to ``address`` reaches: Linux takes the unspecified address
    (0.0.0.0, ::, ::ffff:0.0.0.0) as its family's loopback (127.0.0.1, ::1), whose listeners
    take it -- not only a wildcard one.  Others as they are."""
    ip = target(address)
    if ip is None or not ip.is_unspecified:
        return address
    return "127.0.0.1" if ip.version == 4 else "::1"


def listener_owners(host: str, port: int, proc: Path | None = None, *, wildcards: bool = True) -> set[int] | None:
    """The owner uids of what listens on ``host:port`` in this network namespace; None when
    that cannot be told (no /proc, nothing found there: an agent in another namespace)."""
    found: list = []
    proc = PROC_NET if proc is None else proc
    for name in ("tcp", "tcp6"):
        try:
            found += parse_listeners((proc / name).read_text(errors="replace"))
        except OSError:
            continue
    return owners(found, host, port, wildcards=wildcards) or None


def user_name(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def untrusted_owner(host: str, port: int, agent_uid: int | None, proc: Path | None = None, *,
                    wildcards: bool = True) -> int | None:  # fmt: skip
    """A uid other than root's and ``agent_uid`` that listens on ``host:port``; None when every
    listener there is root's or the agent's, or the owners cannot be told."""
    uids = listener_owners(host, port, proc, wildcards=wildcards)
    if not uids:
        return None
    others = sorted(uids - {0, agent_uid})
    return others[0] if others else None


def squatter(host: str, port: int, token_file: Path, proc: Path | None = None, *,
             local: bool | None = None) -> str | None:  # fmt: skip
    """Why the CLI must not send the API token to ``host:port``: one line naming the listener's
    owner when it is neither root nor the agent's user (the token file's owner: the agent
    writes it); None when it may (or when that cannot be told: as before).  ``local``:
    ``host`` is one of this host's addresses (``agentd leave``'s, the configured listen
    address, is), else :func:`is_local_address` tells.  A connection to a local address
    reaches a wildcard listener (0.0.0.0, ::) on the port as well when nothing is bound to the
    address itself: any local user's, [api] listen on the node's address or on loopback; one
    to the unspecified address reaches loopback's (:func:`reached`).  A name is checked at
    each of its addresses: the client falls back to the next when one refuses."""
    agent_uid = file_owner(token_file)
    for address in addresses(host):  # the client tries each in turn (urllib: the next on a refusal)
        if target(address) is None:
            continue
        mine = is_local_address(address) if local is None else local
        uid = untrusted_owner(reached(address), port, agent_uid, proc, wildcards=mine)
        if uid is not None:
            break
    else:
        return None
    return (f"{host}:{port} is served by a process of {user_name(uid)}, neither root nor the agent's user "
            f"(the owner of {token_file}): not sending it the API token (another user took the agent's port "
            "while no agent ran?)")


def file_owner(path: Path) -> int | None:
    try:
        return os.stat(path).st_uid
    except OSError:
        return None


def is_local_address(address: str) -> bool:
    """Whether ``address`` is one of this host's (this network namespace's): loopback, the
    unspecified address (a connection to it stays here), or one a connected UDP socket takes
    as its own source (the kernel picks the destination itself for a local one: its local
    route, RFC 6724 rule 1; no packet is sent).  Not a bind test: ip_nonlocal_bind, which
    nodes with floating VIPs set, lets a socket bind any address.  False when it cannot be
    told (no route there, not an address)."""
    try:
        ip = ipaddress.ip_address(address.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    if ip.is_loopback or ip.is_unspecified:
        return True
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address.strip("[]"), 9, type=socket.SOCK_DGRAM,
                                                       flags=socket.AI_NUMERICHOST)[0]  # fmt: skip
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            source = ipaddress.ip_address(str(s.getsockname()[0]).split("%", 1)[0])
    except (OSError, IndexError, ValueError):
        return False
    return source == ip


def is_local_host(host: str) -> bool:
    """Whether every address ``host`` names is this host's (:func:`is_local_address`): a
    connection to it, whichever address it tries, stays on this host."""
    try:
        ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
        return is_local_address(host)
    except ValueError:
        pass
    try:
        addresses = {str(a[4][0]) for a in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return False
    return bool(addresses) and all(is_local_address(a) for a in addresses)


def addresses(host: str) -> list[str]:
    """Every address of ``host`` (an address: itself), in getaddrinfo's order: those a
    client's connection may go to, one after the other.  [] when it resolves to none."""
    bare = host.strip("[]")
    if target(bare) is not None:
        return [bare]
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return list(dict.fromkeys(str(a[4][0]) for a in found))
