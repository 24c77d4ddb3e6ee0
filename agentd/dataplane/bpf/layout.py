"""The maps of the in-kernel data path, as Python sees them: datapath.h, one struct per line.

:func:`check` holds these against the map definitions in the object file (key and value
sizes, map types) when it is loaded, so a change on one side without the other is refused
at load time instead of being misread at run time.  Byte order as in datapath.h: addresses
and ports in network order (``socket.inet_aton``), counters and flags in host order.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network

from . import libbpf as lb

# Map names (the C symbols; the kernel's map names).
ROUTES, PEERS, DROPS, CONFIG = "agentd_routes", "agentd_peers", "agentd_drops", "agentd_config"
PORTS = "agentd_ports"
ROUTES6 = "agentd_routes6"  # IPv6 pod subnets: a map of their own, so the IPv4 maps keep their shapes
PEERS6, CONFIG6 = "agentd_peers6", "agentd_config6"  # the member filter on an IPv6 underlay
MAPS = (ROUTES, PEERS, DROPS, PORTS, CONFIG, ROUTES6, PEERS6, CONFIG6)
# The programs (function names in datapath.c, the kernel's program names).
EGRESS, INGRESS = "agentd_egress", "agentd_ingress"

ROUTE_KEY = struct.Struct("<I4s")  # struct route_key: prefixlen (host order), addr
ROUTE_VALUE = struct.Struct("<4sB3x")  # struct route_value: peer, kind
ROUTE6_KEY = struct.Struct("<I16s")  # struct route6_key: prefixlen (host order), addr; value: struct route_value
PEER_KEY = struct.Struct("<4s")
PEER_STATS = struct.Struct("<QQQQQ")  # flags, tx_packets, tx_bytes, rx_packets, rx_bytes
PEER_F_UDP_TO_WORKER, PEER_F_IPIP_TO_WORKER = 1, 2  # enum peer_flag
TO_WORKER = {"udp": PEER_F_UDP_TO_WORKER, "ipip": PEER_F_IPIP_TO_WORKER}
DROP_KEY = struct.Struct("<I")
DROP_STATS = struct.Struct("<QQ")  # packets, bytes
PORT_KEY = struct.Struct("<I6s2x")  # struct port_key: bridge ifindex, MAC
PORT_VALUE = struct.Struct("<I")  # the port's ifindex
CONFIG_KEY = struct.Struct("<I")
CONFIG_VALUE = struct.Struct("<4s2s2sII")  # local, udp_port, vxlan_port, flags, mtu
ADDR6 = struct.Struct("<16s")  # struct addr6: peers6's key, config6's value
PEER6_VALUE = struct.Struct("<I")

# enum route_kind
KIND_UDP, KIND_IPIP = 1, 2
KINDS = {"udp": KIND_UDP, "ipip": KIND_IPIP}
KINDS6 = ("udp",)  # the kinds that carry IPv6 pods: flannel UDP's payload is either family; IPIP is IPv4 only
# enum drop_reason, in order
DROP_REASONS = ("non_member_udp", "non_member_ipip", "non_member_vxlan", "malformed", "too_big",
                "encap_error", "decap_error", "ecn")
# enum config_flag
CFG_DECAP_UDP, CFG_DECAP_IPIP, CFG_FILTER_VXLAN, CFG_DECAP_L3_FLAG, CFG_DECAP_L4_FLAGS = 1, 2, 4, 8, 16
CFG_POD_REDIRECT = 32
CFG_POD_GATE = 64  # decapsulated packets not redirected go on to the pod fast path's wire program

# What each map must be in the object file: (type, key, value, flags).
EXPECTED = {
    ROUTES: (lb.MAP_TYPE_LPM_TRIE, ROUTE_KEY.size, ROUTE_VALUE.size, lb.BPF_F_NO_PREALLOC),
    ROUTES6: (lb.MAP_TYPE_LPM_TRIE, ROUTE6_KEY.size, ROUTE_VALUE.size, lb.BPF_F_NO_PREALLOC),
    PEERS6: (lb.MAP_TYPE_HASH, ADDR6.size, PEER6_VALUE.size, lb.BPF_F_NO_PREALLOC),
    CONFIG6: (lb.MAP_TYPE_ARRAY, CONFIG_KEY.size, ADDR6.size, 0),
    PEERS: (lb.MAP_TYPE_PERCPU_HASH, PEER_KEY.size, PEER_STATS.size, lb.BPF_F_NO_PREALLOC),
    DROPS: (lb.MAP_TYPE_PERCPU_ARRAY, DROP_KEY.size, DROP_STATS.size, 0),
    PORTS: (lb.MAP_TYPE_HASH, PORT_KEY.size, PORT_VALUE.size, 0),
    CONFIG: (lb.MAP_TYPE_ARRAY, CONFIG_KEY.size, CONFIG_VALUE.size, 0),
}
PROGRAMS = (EGRESS, INGRESS)
# Members each member map holds at most (datapath.c MEMBERS_MAX): every node of the largest
# cluster the docs plan for, 65,536 (an IPv6 /48 of /64 node subnets, docs/networking.md).
MEMBERS_MAX = 65536


def check(maps: dict, programs: dict) -> None:
    """Raise ValueError naming the first difference between datapath.h and this module."""
    for name, (mtype, key, value, flags) in EXPECTED.items():
        m = maps.get(name)
        if m is None:
            raise ValueError(f"the object file has no map {name}")
        got = (m.type, m.key_size, m.value_size, m.flags)
        if got != (mtype, key, value, flags):
            raise ValueError(f"map {name} is (type, key, value, flags) {got} in the object file, "
                             f"{(mtype, key, value, flags)} in layout.py")
    if maps[DROPS].max_entries != len(DROP_REASONS):
        raise ValueError(f"the object file has {maps[DROPS].max_entries} drop reasons, layout.py {len(DROP_REASONS)}")
    for name in (PEERS, PEERS6):
        if maps[name].max_entries != MEMBERS_MAX:
            raise ValueError(f"map {name} holds {maps[name].max_entries} members in the object file, "
                             f"{MEMBERS_MAX} in layout.py")
    check_programs(programs, PROGRAMS)
    for name, mdef in maps.items():
        if name in EXPECTED and not mdef.pinned:
            raise ValueError(f"map {name} is not pinned by name in the object file: a restart would lose it")


def check_programs(programs: dict, names: tuple[str, ...]) -> None:
    """Every program of ``names`` is in the object file, as a tc program (``SEC("tc")``)."""
    for name in names:
        prog = programs.get(name)
        if prog is None:
            raise ValueError(f"the object file has no program {name}")
        if prog.type != lb.PROG_TYPE_SCHED_CLS:
            raise ValueError(f"program {name} is in section {prog.section!r}, which libbpf does not load "
                             'as a tc program (SEC("tc"))')


def routes_map(subnet: IPv4Network | IPv6Network) -> str:
    """The map that holds routes to ``subnet``: ROUTES or ROUTES6."""
    return ROUTES6 if subnet.version == 6 else ROUTES


def route_key(subnet: IPv4Network | IPv6Network) -> bytes:
    st = ROUTE6_KEY if subnet.version == 6 else ROUTE_KEY
    return st.pack(subnet.prefixlen, subnet.network_address.packed)


def route_value(peer: str, kind: str) -> bytes:
    return ROUTE_VALUE.pack(socket.inet_aton(peer), KINDS[kind])


def check_route(subnet: IPv4Network | IPv6Network, peer: str, kind: str) -> None:
    """ValueError unless the programs can carry pods of ``subnet`` as ``kind`` to ``peer``:
    the outer header is IPv4, and only udp carries IPv6 pods."""
    if kind not in KINDS:
        raise ValueError(f"route to {subnet}: unknown kind {kind!r}")
    if subnet.version == 6 and kind not in KINDS6:
        raise ValueError(f"route to {subnet}: {kind} carries IPv4 pods only ({', '.join(KINDS6)} carries IPv6)")
    try:
        socket.inet_aton(peer)
    except OSError:
        raise ValueError(f"route to {subnet}: peer {peer!r} is not an IPv4 underlay address") from None


def decode_route(key: bytes, value: bytes) -> tuple[str, str, str]:
    """(subnet, peer, kind) of an entry of either routes map (the key's size says which)."""
    if len(key) == ROUTE6_KEY.size:
        plen, addr = ROUTE6_KEY.unpack(key)
        dst = f"{socket.inet_ntop(socket.AF_INET6, addr)}/{plen}"
    else:
        plen, addr = ROUTE_KEY.unpack(key)
        dst = f"{socket.inet_ntoa(addr)}/{plen}"
    peer, kind = ROUTE_VALUE.unpack(value)
    names = {v: k for k, v in KINDS.items()}
    return dst, socket.inet_ntoa(peer), names.get(kind, str(kind))


def peer_key(address: str) -> bytes:
    return PEER_KEY.pack(socket.inet_aton(address))


@dataclass(frozen=True)
class Config:
    local: str  # the underlay IPv4 address ("0.0.0.0" on an IPv6 underlay)
    udp_port: int
    vxlan_port: int
    flags: int
    mtu: int
    local6: str | None = None  # the underlay IPv6 address, on an IPv6 underlay (the config6 map)

    def pack(self) -> bytes:
        return CONFIG_VALUE.pack(socket.inet_aton(self.local), struct.pack("!H", self.udp_port),
                                 struct.pack("!H", self.vxlan_port), self.flags, self.mtu)

    @classmethod
    def unpack(cls, raw: bytes, raw6: bytes | None = None) -> Config:
        local, udp, vxlan, flags, mtu = CONFIG_VALUE.unpack(raw[: CONFIG_VALUE.size])
        local6 = socket.inet_ntop(socket.AF_INET6, raw6[:16]) if raw6 and any(raw6[:16]) else None
        return cls(socket.inet_ntoa(local), struct.unpack("!H", udp)[0], struct.unpack("!H", vxlan)[0], flags, mtu,
                   local6)

    def pack6(self) -> bytes:
        return ADDR6.pack(socket.inet_pton(socket.AF_INET6, self.local6) if self.local6 else bytes(16))


def sum_percpu(raw: bytes, st: struct.Struct) -> tuple[int, ...]:
    """Add up a per-CPU value: the kernel returns one value per possible CPU, each padded to 8."""
    step = (st.size + 7) & ~7
    totals = [0] * len(st.unpack_from(raw, 0))
    for off in range(0, len(raw) - st.size + 1, step):
        for i, v in enumerate(st.unpack_from(raw, off)):
            totals[i] += v
    return tuple(totals)
