"""The pod fast path's pod map as set_pods writes it (review s56 r2 #1): one veth whose program
cannot go on holds back no other pod, and an address that moved to another veth never keeps
pointing at the old one (its connections would be carried into the pod that had it before)."""

from __future__ import annotations

import socket

import pytest

from agentd.dataplane.bpf import podpath, tc

OLD, BUSY, NEW, OTHER = 13, 11, 12, 10  # ifindexes of the veths
DEVICES = {"vethOTHER": OTHER, "vethBUSY": BUSY, "vethNEW": NEW, "vethOLD": OLD}


class Kernel:
    """The pod maps (fds 1 and 2) and the hooks; attaching to ``busy`` veths fails with EBUSY."""

    def __init__(self, monkeypatch, busy: set[int]) -> None:
        self.entries: dict[tuple[int, bytes], bytes] = {}
        self.busy = busy
        self.attached: list[int] = []
        monkeypatch.setattr(socket, "if_nametoindex", self.if_nametoindex)
        monkeypatch.setattr(tc, "attach", self.attach)
        monkeypatch.setattr(tc, "sweep", lambda _pins: None)
        monkeypatch.setattr(podpath.lb, "map_update", self.update)
        monkeypatch.setattr(podpath.lb, "map_delete", self.delete)

    @staticmethod
    def if_nametoindex(name: str) -> int:
        if name not in DEVICES:
            raise OSError(19, "No such device")
        return DEVICES[name]

    def attach(self, ifindex: int, *_args, **_kwargs) -> list:
        if ifindex in self.busy:
            raise tc.TcError(f"device {ifindex} ingress: cannot attach agentd_pod_fast: Device or resource busy")
        self.attached.append(ifindex)
        return []

    def update(self, fd: int, key: bytes, value: bytes, _flags: int = 0) -> None:
        self.entries[(fd, key)] = value

    def delete(self, fd: int, key: bytes) -> bool:
        return self.entries.pop((fd, key), None) is not None

    def veth_of(self, address: str) -> int | None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        raw = self.entries.get((2 if ":" in address else 1, socket.inet_pton(family, address)))
        return None if raw is None else podpath.POD_VALUE.unpack(raw)[0]


def _fast_path(tmp_path, kernel: Kernel, pods: dict[str, int]) -> podpath.PodFastPath:
    fp = podpath.PodFastPath(tmp_path)
    fp.maps = {podpath.IPS: 1, podpath.IPS6: 2}
    fp.prog_fd, fp.hook = 99, "tcx"
    for address, ifindex in pods.items():  # as an earlier set_pods left them
        kernel.update(1 if ":" not in address else 2, podpath._pod_key(address), podpath.POD_VALUE.pack(ifindex))
    fp.pods, fp.attached = dict(pods), set(pods.values())
    return fp


WANTED = {"10.0.0.5": "vethOTHER", "10.0.0.6": "vethBUSY", "10.0.0.7": "vethNEW", "fd00::7": "vethNEW"}


def test_a_veth_whose_program_cannot_go_on_holds_back_no_other_pod_and_a_moved_address_leaves_its_old_veth(
        tmp_path, monkeypatch):
    kernel = Kernel(monkeypatch, busy={BUSY})
    fp = _fast_path(tmp_path, kernel, {"10.0.0.7": OLD})  # 10.0.0.7 was the older pod's, on vethOLD
    with pytest.raises(podpath.BpfUnavailable) as failed:
        fp.set_pods(WANTED)  # one error for the policy agent, which retries at its next rescan
    assert kernel.veth_of("10.0.0.7") == NEW  # not OLD: its connections are not carried into the older pod
    assert kernel.veth_of("10.0.0.5") == OTHER and kernel.veth_of("fd00::7") == NEW  # after the busy one
    assert kernel.veth_of("10.0.0.6") is None
    assert fp.pods == {"10.0.0.5": OTHER, "10.0.0.7": NEW, "fd00::7": NEW}
    assert fp.attached == {OTHER, NEW}
    assert str(failed.value) == ("pod fast path not on 1 veths (their pods take the normal path): vethBUSY: "
                                 "device 11 ingress: cannot attach agentd_pod_fast: Device or resource busy")
    # the retry: the veth busy no more, its pod goes on; the others are not attached twice
    kernel.busy.clear()
    fp.set_pods(WANTED)
    assert kernel.veth_of("10.0.0.6") == BUSY
    assert sorted(kernel.attached) == [OTHER, BUSY, NEW]


def test_an_address_whose_new_veth_cannot_be_attached_is_on_no_veth_rather_than_the_old_one(tmp_path, monkeypatch):
    kernel = Kernel(monkeypatch, busy={NEW})
    fp = _fast_path(tmp_path, kernel, {"10.0.0.7": OLD, "fd00::7": OLD})
    with pytest.raises(podpath.BpfUnavailable) as failed:
        fp.set_pods(WANTED)
    assert kernel.veth_of("10.0.0.7") is None and kernel.veth_of("fd00::7") is None  # the normal path's
    assert "vethNEW: device 12 ingress" in str(failed.value)
    assert kernel.veth_of("10.0.0.5") == OTHER and kernel.veth_of("10.0.0.6") == BUSY
    assert OLD not in fp.attached and NEW not in fp.attached
    assert kernel.attached.count(NEW) == 0


def test_a_veth_gone_before_its_attach_is_left_out_without_an_error(tmp_path, monkeypatch):
    kernel = Kernel(monkeypatch, busy=set())
    fp = _fast_path(tmp_path, kernel, {"10.0.0.7": OLD})

    def gone(ifindex, *_args, **_kwargs):
        if ifindex == NEW:
            raise tc.TcError(f"device {ifindex} ingress: cannot attach agentd_pod_fast: No such device")
        return Kernel.attach(kernel, ifindex)

    monkeypatch.setattr(tc, "attach", gone)
    fp.set_pods(WANTED)
    assert kernel.veth_of("10.0.0.7") is None and kernel.veth_of("fd00::7") is None
    assert fp.pods == {"10.0.0.5": OTHER, "10.0.0.6": BUSY}


def test_an_address_the_pod_map_refuses_holds_back_no_other_pod(tmp_path, monkeypatch):
    """A pod map write that fails (the map full: E2BIG) stopped set_pods there: every later
    address was left out of the fast path, and the policy agent was told nothing of the rest."""
    kernel = Kernel(monkeypatch, busy=set())
    fp = _fast_path(tmp_path, kernel, {})
    write = kernel.update

    def full_for_one(fd: int, key: bytes, value: bytes, flags: int = 0) -> None:
        if key == podpath._pod_key("10.0.0.6"):
            raise podpath.lb.BpfError(7, "Argument list too long")
        write(fd, key, value, flags)

    monkeypatch.setattr(podpath.lb, "map_update", full_for_one)
    with pytest.raises(podpath.BpfUnavailable) as failed:
        fp.set_pods(WANTED)
    assert kernel.veth_of("10.0.0.5") == OTHER
    assert kernel.veth_of("10.0.0.7") == NEW and kernel.veth_of("fd00::7") == NEW  # after the refused one
    assert kernel.veth_of("10.0.0.6") is None and "10.0.0.6" not in fp.pods
    assert str(failed.value).startswith("pod fast path not on 1 addresses (their pods take the normal path): "
                                        "vethBUSY (10.0.0.6): pod map: ")
    monkeypatch.setattr(podpath.lb, "map_update", write)  # room again: the retry writes it
    fp.set_pods(WANTED)
    assert kernel.veth_of("10.0.0.6") == BUSY and fp.attached == {OTHER, BUSY, NEW}
