"""The lab's namespace primitives keep their promises."""

import json
import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import time

from agentd.lab import bpffs, netns
from agentd.lab.wait import until


def test_veth_between_namespaces_carries_traffic(netns_factory):
    a, b = netns_factory("a"), netns_factory("b")
    netns.veth(a, "va", b, "vb")
    a.ip("addr", "add", "192.0.2.1/24", "dev", "va")
    b.ip("addr", "add", "192.0.2.2/24", "dev", "vb")
    a.exec("ping", "-c", "1", "-W", "2", "192.0.2.2")
    # Neither end ever exists in the root namespace.
    root_links = netns.run(["ip", "-o", "link", "show"]).stdout.decode()
    assert " va" not in root_links and " vb" not in root_links


def test_socket_opened_inside_namespace_stays_there(netns_factory):
    a, b = netns_factory("a"), netns_factory("b")
    netns.veth(a, "va", b, "vb")
    a.ip("addr", "add", "192.0.2.1/24", "dev", "va")
    b.ip("addr", "add", "192.0.2.2/24", "dev", "vb")
    with b.entered():
        srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with srv:
        srv.bind(("192.0.2.2", 0))  # the address exists only inside b
        port = srv.getsockname()[1]
        a.exec("python3", "-c", f"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'hi', ('192.0.2.2', {port}))")
        srv.settimeout(5)
        assert srv.recv(16) == b"hi"


def test_delete_kills_processes_and_is_idempotent(netns_factory):
    a = netns_factory("a")
    proc = a.popen(["sleep", "60"])
    try:
        # `ip netns exec` enters the namespace, then execs sleep: until then it is not listed.
        until(lambda: proc.pid in a.pids(), 10, what="the child inside the namespace")
        a.delete()
        assert proc.wait(timeout=10) is not None
        assert not a.exists()
        a.delete()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_http_get_inside_namespace(netns_factory):
    a = netns_factory("a")
    srv = a.popen(["python3", "-m", "http.server", "--bind", "127.0.0.1", "18080"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        status, body = until(lambda: a.http_get("http://127.0.0.1:18080/"), 30, what="the HTTP server", ignore=(OSError,))
        assert status == 200 and b"Directory listing" in body
    finally:
        srv.kill()
        srv.wait()


def test_sweep_pings_from_each_namespace_and_names_who_did_not_answer(netns_factory):
    from agentd.lab.sweep import Source, sweep

    a, b, c = netns_factory("a"), netns_factory("b"), netns_factory("c")
    netns.veth(a, "va", b, "vb")
    netns.veth(a, "va2", c, "vc")
    a.ip("addr", "add", "192.0.2.1/24", "dev", "va")
    b.ip("addr", "add", "192.0.2.2/24", "dev", "vb")
    a.ip("addr", "add", "198.51.100.1/24", "dev", "va2")
    c.ip("addr", "add", "198.51.100.2/24", "dev", "vc")
    # b reaches a; c reaches a; .3 on b's link does not exist; b has no route to c's network.
    # The sockets are b's and c's: a 192.0.2.1 reply to c would prove nothing about b.
    got = sweep(
        [Source("b", b.path, ("192.0.2.1", "192.0.2.3", "198.51.100.2")), Source("c", c.path, ("198.51.100.1",))],
        deadline=1.5,
    )
    assert got == {
        ("b", "192.0.2.1"): True, ("b", "192.0.2.3"): False, ("b", "198.51.100.2"): False,
        ("c", "198.51.100.1"): True,
    }
    # A link taken down stops the replies: the answer comes from the namespaces, not a cache.
    c.ip("link", "set", "vc", "down")
    assert sweep([Source("c", c.path, ("198.51.100.1",))], deadline=1.0) == {("c", "198.51.100.1"): False}
    # A source whose namespace is gone (a pod not attached yet) reaches nobody; the others still do.
    gone = Source("gone", c.path + "-no-such-namespace", ("192.0.2.2",))
    assert sweep([gone, Source("b", b.path, ("192.0.2.1",))], deadline=1.0) == {
        ("gone", "192.0.2.2"): False, ("b", "192.0.2.1"): True,
    }


def test_sweep_dead_unmounts_only_the_bpf_file_systems_of_labs_that_are_gone(netns_factory):
    """A lab killed before its `down` leaves its bpffs mounted (and every program and map pinned
    in it alive): the next run's sweep takes it away, and leaves a lab that still has its
    namespaces, or was made a moment ago, alone."""
    # Not under pytest's base temp: another session starting meanwhile sweeps there.
    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="agentd-sweep-"))
    live = netns_factory("node1")  # ad-<tag>-node1: a lab named <tag> is still there
    live_name = live.name.removeprefix("ad-").removesuffix("-node1")
    old = time.time() - 3600
    made: dict[str, pathlib.Path] = {}
    try:
        for kind, name in (("dead", netns.unique_tag("sw")), ("live", live_name), ("young", netns.unique_tag("sw"))):
            d = tmp_path / kind
            d.mkdir()
            (d / "lab.json").write_text(json.dumps({"spec": {"name": name}}))
            if kind != "young":
                os.utime(d / "lab.json", (old, old))
            made[kind] = bpffs.mount(d / "bpffs")
        fd = _pinned_map(made["dead"] / "m")
        os.close(fd)

        assert bpffs.sweep_dead(tmp_path / "elsewhere") == []
        assert bpffs.sweep_dead(tmp_path) == [str(made["dead"])]

        assert not os.path.ismount(made["dead"]) and not made["dead"].exists()
        assert os.path.ismount(made["live"]) and os.path.ismount(made["young"])
        assert bpffs.sweep_dead(tmp_path) == []  # nothing more to do

        # A test's own (no lab): its owner noted beside it; it goes once that process is gone.
        gone = subprocess.Popen(["true"])
        gone.wait()
        made["orphan"] = bpffs.mount(tmp_path / "t1" / "bpffs", owner=gone.pid)
        made["owned"] = bpffs.mount(tmp_path / "t2" / "bpffs", owner=os.getpid())
        assert bpffs.sweep_dead(tmp_path) == [str(made["orphan"])]
        assert not os.path.ismount(made["orphan"]) and not (tmp_path / "t1" / "bpffs.owner").exists()
        assert os.path.ismount(made["owned"])
        bpffs.umount(made["owned"])
        assert not (tmp_path / "t2" / "bpffs.owner").exists()
    finally:
        for p in made.values():
            bpffs.umount(p)
        shutil.rmtree(tmp_path, ignore_errors=True)


def _pinned_map(path: pathlib.Path) -> int:
    """A small array map pinned at ``path``: what an agent leaves in its lab's bpffs."""
    from agentd.dataplane.bpf import libbpf as lb

    fd = lb.library().bpf_map_create(2, None, 4, 4, 1, None)  # BPF_MAP_TYPE_ARRAY
    assert fd >= 0, f"bpf_map_create: {fd}"
    lb.obj_pin(fd, str(path))
    return fd


def test_a_killed_run_leaves_no_daemon_and_the_next_run_deletes_its_namespace(tmp_path):
    """A test run SIGKILLed (no finalizer runs): the daemon it started in a namespace dies with
    it (PR_SET_PDEATHSIG), and the next run's session start deletes the namespace it left
    (recorded with its process in netns.OWNERS_DIR), the one it named with ``ip netns attach``
    too (Netns.attach: a Docker-host pod's); a live run's namespaces stay."""
    import sys
    import textwrap

    name = f"ad-{netns.unique_tag()}-k"
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        def pytest_configure(config):
            from agentd.lab.netns import tie_children_to_this_process
            tie_children_to_this_process()
    """))
    (tmp_path / "test_killed.py").write_text(textwrap.dedent("""
        import os, pathlib, signal, subprocess, time
        from agentd.lab.netns import Netns

        def test_killed():
            ns = Netns.create(os.environ["NS_NAME"])
            proc = ns.popen(["sleep", "600"], stdout=subprocess.DEVNULL, start_new_session=True)
            pathlib.Path(os.environ["PID_FILE"]).write_text(str(proc.pid))
            # A namespace named as a Docker-host pod's is (ip netns attach): the name keeps it
            # alive after its process is gone.
            holder = subprocess.Popen(["unshare", "--net", "sleep", "600"], stdout=subprocess.DEVNULL)
            for _ in range(100):
                if os.readlink(f"/proc/{holder.pid}/ns/net") != os.readlink("/proc/self/ns/net"):
                    break
                time.sleep(0.05)
            Netns.attach(os.environ["NS_NAME"] + "a", holder.pid)
            holder.kill()
            os.kill(os.getpid(), signal.SIGKILL)
    """))
    pid_file = tmp_path / "pid"
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                              str(tmp_path / "test_killed.py")], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120, check=False,
                             env={**os.environ, "NS_NAME": name, "PID_FILE": str(pid_file)})  # fmt: skip
        assert run.returncode == -9, run.stdout + run.stderr
        pid = int(pid_file.read_text())

        def gone() -> bool:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().rpartition(")")[2].split()[0] == "Z"  # dead, not yet reaped by init
            except FileNotFoundError:
                return True

        until(gone, 10, what=f"sleep (pid {pid}) to die with the killed run")
        assert netns.Netns(name).exists() and netns.Netns(name + "a").exists()
        swept = netns.sweep_dead_owners()
        assert name in swept and name + "a" in swept, swept
        for n in (name, name + "a"):
            assert not netns.Netns(n).exists() and not os.path.exists(os.path.join(netns.OWNERS_DIR, n))
    finally:
        netns.Netns(name).delete()
        netns.Netns(name + "a").delete()
