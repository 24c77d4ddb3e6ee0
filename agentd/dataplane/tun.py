"""TUN device setup for the user-space fast paths (Documentation/networking/tuntap.rst).

The device is opened with IFF_TUN | IFF_NO_PI | IFF_VNET_HDR, so every read and write carries
a ``struct virtio_net_hdr`` (10 bytes) in front of the IP packet.  With TUNSETOFFLOAD
(TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6) the kernel hands us TCP super-packets of up to 64 KB
with a partial checksum instead of MTU-sized packets: one read per 64 KB instead of ~45.
The device is made persistent (TUNSETPERSIST) so that the kernel routes through it survive a
worker restart; a new worker re-attaches to it by name.  MTU, queue length and the up flag
are set with the classic SIOCSIF* ioctls (no extra dependency, works in any namespace).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
from dataclasses import dataclass, field

from proto.packet import VIRTIO_NET_HDR_LEN

TUNSETIFF = 0x400454CA
TUNSETPERSIST = 0x400454CB
TUNSETOFFLOAD = 0x400454D0
TUNSETVNETHDRSZ = 0x400454D8
TUNGETIFF = 0x800454D2

IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000

TUN_F_CSUM = 0x01
TUN_F_TSO4 = 0x02
TUN_F_TSO6 = 0x04
TUN_F_TSO_ECN = 0x08

SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
SIOCSIFMTU = 0x8922
SIOCGIFINDEX = 0x8933
SIOCSIFTXQLEN = 0x8943
IFF_UP = 0x1

IFNAMSIZ = 16


class TunError(RuntimeError):
    """The TUN device could not be created or configured; the message says why."""


@dataclass
class TunDevice:
    name: str
    fd: int
    vnet_hdr_len: int
    created: bool
    offloads: dict[str, bool] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def set_persist(self, persist: bool) -> None:
        fcntl.ioctl(self.fd, TUNSETPERSIST, 1 if persist else 0)


def check_name(name: str) -> str:
    if not name or len(name) >= IFNAMSIZ or "/" in name or name.strip() != name or name in (".", ".."):
        raise ValueError(f"bad interface name {name!r} (1-15 characters, no '/' or spaces)")
    return name


def _ifreq(name: str, fmt: str = "", *values) -> bytes:
    raw = struct.pack(f"{IFNAMSIZ}s" + fmt, name.encode(), *values)
    return raw + b"\0" * (40 - len(raw))


def link_exists(name: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            fcntl.ioctl(s, SIOCGIFINDEX, _ifreq(name))
        except OSError as exc:
            if exc.errno == errno.ENODEV:
                return False
            raise
    return True


def configure_link(name: str, *, mtu: int, txqueuelen: int | None = None, up: bool = True) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, SIOCSIFMTU, _ifreq(name, "i", mtu))
        if txqueuelen:
            fcntl.ioctl(s, SIOCSIFTXQLEN, _ifreq(name, "i", txqueuelen))
        if up:
            flags = struct.unpack_from("H", fcntl.ioctl(s, SIOCGIFFLAGS, _ifreq(name)), IFNAMSIZ)[0]
            fcntl.ioctl(s, SIOCSIFFLAGS, _ifreq(name, "H", flags | IFF_UP))


def set_ipv4_conf(name: str, key: str, value: int) -> None:
    """Write ``net.ipv4.conf.<name>.<key>`` of the current namespace (our own device only)."""
    with open(f"/proc/sys/net/ipv4/conf/{name}/{key}", "w") as f:
        f.write(f"{value}\n")


def local_source_accepted(name: str) -> bool:
    """Whether a packet written into ``name`` with one of our own addresses as source is
    accepted (accept_local on, effective rp_filter 0)."""
    try:
        def get(dev: str, key: str) -> int:
            with open(f"/proc/sys/net/ipv4/conf/{dev}/{key}") as f:
                return int(f.read())
        return get(name, "accept_local") == 1 and max(get("all", "rp_filter"), get(name, "rp_filter")) == 0
    except (OSError, ValueError):
        return False


def open_tun(name: str, *, mtu: int, offload: bool = True, txqueuelen: int = 1000,
             vnet_hdr_len: int = VIRTIO_NET_HDR_LEN, persist: bool = True,
             no_offload_reason: str = "disabled by --no-offload") -> TunDevice:
    """Create (or re-attach to an existing persistent) TUN device ``name`` and configure it.

    With ``offload`` the kernel may hand us TSO super-packets and partial checksums; where
    TUNSETOFFLOAD is refused we fall back to plain packets and say why in ``fallbacks``.
    """
    check_name(name)
    existed = link_exists(name)
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise TunError(f"cannot open /dev/net/tun: {exc.strerror}") from None
    try:
        try:
            fcntl.ioctl(fd, TUNSETIFF, _ifreq(name, "H", IFF_TUN | IFF_NO_PI | IFF_VNET_HDR))
        except OSError as exc:
            if existed and exc.errno in (errno.EINVAL, errno.EPERM):
                raise TunError(f"device {name} exists and is not a TUN device we can attach to "
                               f"({exc.strerror})") from None
            if exc.errno == errno.EBUSY:
                raise TunError(f"TUN device {name} is already attached to another process "
                               "(is a worker already running?)") from None
            raise TunError(f"TUNSETIFF {name}: {exc.strerror}") from None
        dev = TunDevice(name=name, fd=fd, vnet_hdr_len=vnet_hdr_len, created=not existed)
        fcntl.ioctl(fd, TUNSETVNETHDRSZ, struct.pack("i", vnet_hdr_len))
        flags = TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 if offload else 0
        try:
            fcntl.ioctl(fd, TUNSETOFFLOAD, flags)
            dev.offloads["tun_tso"] = offload
            dev.offloads["tun_csum"] = offload
        except OSError as exc:
            fcntl.ioctl(fd, TUNSETOFFLOAD, 0)
            dev.offloads["tun_tso"] = dev.offloads["tun_csum"] = False
            dev.fallbacks["tun_tso"] = f"TUNSETOFFLOAD refused: {exc.strerror}"
        if not offload:
            dev.fallbacks["tun_tso"] = no_offload_reason
        if persist:
            dev.set_persist(True)
        configure_link(name, mtu=mtu, txqueuelen=txqueuelen)
        # ICMP errors we write into the TUN carry the node's own underlay address as source
        # (RFC 1812 §4.3.2.4: a router's address).  Linux calls a packet arriving with a local
        # source martian unless accept_local is set AND reverse-path filtering is off for the
        # device (effective rp_filter = max(conf.all, conf.dev); with rp_filter on, a device
        # without addresses fails the check in __fib_validate_source).  See
        # local_source_accepted() for what the worker does when conf.all forbids it.
        try:
            set_ipv4_conf(name, "accept_local", 1)
            set_ipv4_conf(name, "rp_filter", 0)
        except OSError as exc:
            dev.fallbacks["icmp_source"] = f"cannot set accept_local/rp_filter on {name}: {exc.strerror}"
        return dev
    except BaseException:
        os.close(fd)
        raise
