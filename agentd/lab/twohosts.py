"""The two-host topology the data-plane tests and bench build (all inside ``ad-`` namespaces).

::

    p1 (10.244.1.2/24) ==veth== h1 (10.244.1.1)  u1 192.168.50.1/24 ==veth== u2 192.168.50.2/24  h2 (10.244.2.1) ==veth== p2 (10.244.2.2/24)
                                                                                              ux 192.168.60.2/24 ==veth== x (192.168.60.3)

``x`` is an outsider on the underlay side of h2 (not a member): it can reach h2's underlay
address through h2 and is used to send forged encapsulated packets.  With ``ipv6=True`` the
pods are dual-stack (p1 fd00:10:244:1::2/64 behind h1's fd00:10:244:1::1, p2 likewise in
fd00:10:244:2::/64); the underlay stays IPv4, and the hosts forward IPv6.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agentd.backend_table import BACKENDS, USERSPACE
from agentd.lab.netns import Netns, veth
from agentd.lab.wait import until

H1_UNDERLAY, H2_UNDERLAY, X_UNDERLAY = "192.168.50.1", "192.168.50.2", "192.168.60.3"
P1, P2 = "10.244.1.2", "10.244.2.2"
SUBNET1, SUBNET2 = "10.244.1.0/24", "10.244.2.0/24"
P1_6, P2_6 = "fd00:10:244:1::2", "fd00:10:244:2::2"
SUBNET1_6, SUBNET2_6 = "fd00:10:244:1::/64", "fd00:10:244:2::/64"
CLUSTER = "10.244.0.0/16"
OVERHEAD = {name: b.overhead for name, b in BACKENDS.items() if b.encapsulates}
DEVICE = {name: BACKENDS[name].device for name in USERSPACE}


@dataclass
class TwoHosts:
    h1: Netns
    h2: Netns
    p1: Netns
    p2: Netns
    x: Netns | None
    underlay_mtu: int

    def host(self, i: int) -> Netns:
        return self.h1 if i == 1 else self.h2

    def set_pod_mtu(self, mtu: int) -> None:
        for pod, host, dev in ((self.p1, self.h1, "vp1"), (self.p2, self.h2, "vp2")):
            pod.ip("link", "set", "eth0", "mtu", str(mtu))
            host.ip("link", "set", dev, "mtu", str(mtu))



def build_two_hosts(make: Callable[[str], Netns], *, underlay_mtu: int = 1500, outsider: bool = True,
                    ipv6: bool = False) -> TwoHosts:
    h1, h2, p1, p2 = make("h1"), make("h2"), make("p1"), make("p2")
    x = make("x") if outsider else None
    veth(h1, "u1", h2, "u2", mtu=underlay_mtu)
    h1.ip("addr", "add", f"{H1_UNDERLAY}/24", "dev", "u1")
    h2.ip("addr", "add", f"{H2_UNDERLAY}/24", "dev", "u2")
    for host, pod, dev, gw, addr in ((h1, p1, "vp1", "10.244.1.1", P1), (h2, p2, "vp2", "10.244.2.1", P2)):
        veth(host, dev, pod, "eth0")
        host.ip("addr", "add", f"{gw}/24", "dev", dev)
        pod.ip("addr", "add", f"{addr}/24", "dev", "eth0")
        pod.ip("route", "add", "default", "via", gw)
        host.sysctl("net.ipv4.ip_forward", 1)
        if ipv6:  # nodad: usable at once (no duplicate address detection on a link of two)
            net6 = addr.replace("10.244.", "fd00:10:244:").rsplit(".", 1)[0]
            host.ip("-6", "addr", "add", f"{net6}::1/64", "dev", dev, "nodad")
            pod.ip("-6", "addr", "add", f"{net6}::2/64", "dev", "eth0", "nodad")
            pod.ip("-6", "route", "add", "default", "via", f"{net6}::1")
            host.sysctl("net.ipv6.conf.all.forwarding", 1)
    if x is not None:
        veth(h2, "ux", x, "eth0")
        h2.ip("addr", "add", "192.168.60.2/24", "dev", "ux")
        x.ip("addr", "add", f"{X_UNDERLAY}/24", "dev", "eth0")
        x.ip("route", "add", "192.168.50.0/24", "via", "192.168.60.2")
    return TwoHosts(h1, h2, p1, p2, x, underlay_mtu)


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05) -> bool:
    """True once ``predicate()`` holds (its exceptions count as "not yet"), False after ``timeout``."""
    try:
        return bool(until(predicate, timeout, interval=interval, ignore=(Exception,)))
    except AssertionError:
        return False
