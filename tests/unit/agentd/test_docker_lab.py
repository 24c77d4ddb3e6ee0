"""The Docker engines of the lab (agentd.lab.dockerd, docker_hosts, compose) torn down when
something is wrong -- a dockerd stuck past SIGKILL, one already dead with its containers'
processes still running, an engine that does not answer --, and the names and paths they are
made from.  Pure: fake cgroup trees and mountinfo files in tmp_path, os.kill and the waits
stubbed (no process is started or signalled)."""

from __future__ import annotations

import argparse
import types

import pytest

from agentd.lab import compose, docker_hosts, dockerd
from agentd.lab.cli import _lab_name
from agentd.lab.docker_hosts import DockerHosts, stop_leftover_engines
from agentd.lab.errors import LabError
from agentd.lab.netns import Netns


def _fake_until(pred, timeout, *, what="", interval=0.1, error=AssertionError, **_):
    """lab.wait.until without the waiting: one try, then the deadline has passed."""
    if result := pred():
        return result
    raise error(f"timed out waiting for {what}")


@pytest.fixture
def no_host(tmp_path, monkeypatch):
    """dockerd's paths, cgroups and mounts in tmp_path; signals recorded, never sent."""
    signals = []
    for module in (dockerd, docker_hosts):
        monkeypatch.setattr(module, "RUN_ROOT", tmp_path / "run")
        monkeypatch.setattr(module, "DATA_ROOT", tmp_path / "data")
    monkeypatch.setattr(dockerd, "CGROUP_ROOT", tmp_path / "cg")
    monkeypatch.setattr(dockerd, "MOUNTINFO", tmp_path / "mountinfo")
    monkeypatch.setattr(dockerd, "until", _fake_until)
    monkeypatch.setattr(dockerd.os, "kill", lambda pid, sig: signals.append((pid, sig)))
    monkeypatch.setattr(dockerd.DockerEngine, "_kill_leftovers", lambda self: None)
    monkeypatch.setattr(dockerd.DockerEngine, "remove_containers", lambda self, label=None: None)
    (tmp_path / "cg").mkdir()
    (tmp_path / "mountinfo").write_text("")
    return signals


def _lab(name="x", nodes=2):
    node = lambda i: types.SimpleNamespace(name=f"node{i}", ns=Netns(f"ad-{name}-node{i}"))
    return types.SimpleNamespace(spec=types.SimpleNamespace(name=name), nodes=[node(i) for i in range(1, nodes + 1)])


def test_a_dockerd_that_outlives_sigkill_does_not_stop_the_other_engines_or_the_teardown(no_host, monkeypatch, capsys):
    """until(..., 10, ...) after SIGKILL raised AssertionError, which DockerHosts.stop did not
    suppress: the second engine was never stopped and Lab.down ended there (etcd, namespaces,
    bpffs and files left) with a traceback."""
    import signal

    monkeypatch.setattr(dockerd, "_alive", lambda pid: True)  # stuck in the kernel
    monkeypatch.setattr(dockerd.DockerEngine, "running_pid", lambda self: 424242)
    hosts = DockerHosts(_lab())
    failed = hosts.stop()
    assert no_host.count((424242, signal.SIGTERM)) == 2 and no_host.count((424242, signal.SIGKILL)) == 2
    assert [f.split(":")[0] for f in failed] == ["lab-x-node1", "lab-x-node2"]
    assert "dockerd 424242 to exit after SIGKILL" in failed[0]
    assert capsys.readouterr().err.count("not stopped cleanly") == 2
    # A stuck engine's files stay, and the leftover sweep (no state file) tries every one too.
    for n in (1, 2):
        (dockerd.RUN_ROOT / f"lab-x-node{n}").mkdir(parents=True)
    assert DockerHosts(_lab()).stop() and len(list(dockerd.RUN_ROOT.iterdir())) == 2
    capsys.readouterr()
    assert stop_leftover_engines("x") == []
    assert no_host.count((424242, signal.SIGTERM)) == 6 and capsys.readouterr().err.count("not stopped cleanly") == 2
    monkeypatch.setattr(dockerd, "_alive", lambda pid: False)  # it did die after all
    assert stop_leftover_engines("x") == ["lab-x-node1", "lab-x-node2"]
    assert not list(dockerd.RUN_ROOT.iterdir())


def _cgroup(path, pids=()):
    path.mkdir(parents=True)
    (path / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))


@pytest.mark.parametrize("layout", ["v1", "v2"])
def test_containers_of_a_dead_dockerd_are_killed_by_their_cgroups(no_host, monkeypatch, tmp_path, layout):
    """With dockerd dead already, no container was removed through the API, the shims were
    killed, and the containers' processes, in namespaces of their own, ran on; the cgroup
    parent was not removed either (rmdir of a cgroup with processes fails, silently)."""
    import signal

    monkeypatch.setattr(dockerd.DockerEngine, "running_pid", lambda self: None)  # dockerd is gone
    cg = tmp_path / "cg"
    tops = [cg / "ad-docker-e1"] if layout == "v2" else [cg / "cpu,cpuacct" / "ad-docker-e1",
                                                         cg / "memory" / "ad-docker-e1"]
    for top in tops:
        _cgroup(top)
        _cgroup(top / "c0ffee", [4242, 4243])
        _cgroup(top / "beef", [4244])
    if layout == "v1":
        (cg / "cpu").symlink_to("cpu,cpuacct")  # an alias: the same hierarchy
    killed = []

    def kill(pid, sig):  # the kernel empties the cgroups of what was killed
        killed.append((pid, sig))
        for procs in cg.rglob("cgroup.procs"):
            procs.write_text("".join(f"{p}\n" for p in map(int, procs.read_text().split()) if p != pid))

    monkeypatch.setattr(dockerd.os, "kill", kill)
    # (rmdir of a real cgroup takes its control files with it, a fake one's cannot: the removal
    # is seen being asked for, with the cgroups empty by then.)
    removing = []
    monkeypatch.setattr(dockerd, "_remove_cgroups",
                        lambda parent: removing.append((parent, dockerd.cgroup_pids(dockerd.engine_cgroups(parent)))))
    assert sorted(dockerd.engine_cgroups("/ad-docker-e1")) == sorted(tops)
    assert dockerd.cgroup_pids(dockerd.engine_cgroups("/ad-docker-e1")) == [4242, 4243, 4244]
    dockerd.DockerEngine("e1", netns=None).stop()
    assert sorted(killed) == [(4242, signal.SIGKILL), (4243, signal.SIGKILL), (4244, signal.SIGKILL)]
    assert removing == [("/ad-docker-e1", [])]


def test_container_processes_that_outlive_sigkill_are_said(no_host, monkeypatch, tmp_path):
    monkeypatch.setattr(dockerd.DockerEngine, "running_pid", lambda self: None)
    _cgroup(tmp_path / "cg" / "ad-docker-e1" / "c0ffee", [4242])
    with pytest.raises(LabError, match="processes 4242 of its containers outlived SIGKILL"):
        dockerd.DockerEngine("e1", netns=None).stop()
    assert no_host == [(4242, 9)]


def test_compose_leftovers_finds_the_engines_cgroup_on_cgroup_v2(no_host, tmp_path):
    """leftovers() globbed /sys/fs/cgroup/*/ad-docker-compose-<name> (v1's layout): on cgroup
    v2 the cgroup is /sys/fs/cgroup/ad-docker-compose-<name> and the check never fired."""
    engine = dockerd.DockerEngine("compose-t1", netns=None, run_root=tmp_path / "r", data_root=tmp_path / "d")
    assert compose.leftovers(engine) == []
    _cgroup(tmp_path / "cg" / "ad-docker-compose-t1" / "c0ffee", [4242])
    assert compose.leftovers(engine) == [f"cgroup {tmp_path / 'cg' / 'ad-docker-compose-t1'} (processes 4242)"]
    _cgroup(tmp_path / "cg" / "memory" / "ad-docker-compose-t1")  # and v1's
    assert compose.leftovers(engine)[1] == f"cgroup {tmp_path / 'cg' / 'memory' / 'ad-docker-compose-t1'}"


def test_compose_down_keeps_the_record_when_the_users_engine_does_not_answer(tmp_path, monkeypatch, capsys):
    """The engine down or restarting: docker-compose down and rmi were skipped, yet the record
    went and "removed (images too)" was printed, exit 0 -- the containers, networks and images
    stayed, with nothing left to find them by."""
    monkeypatch.setattr(compose, "STATE_ROOT", tmp_path / "state")
    ran = []
    monkeypatch.setattr(compose.DockerEngine, "answers", lambda self: False)
    monkeypatch.setattr(compose, "compose", lambda *a, **k: ran.append(a))
    monkeypatch.setattr(compose.DockerEngine, "docker", lambda self, *a, **k: ran.append(a))
    compose.ComposeState(name="lab", project="agentdlab", host="unix:///var/run/docker.sock", private=False,
                         netns=None, backend="host-gw", images=["agentd:latest"], env={}).save()
    assert compose.main(["down", "--images"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "unix:///var/run/docker.sock does not answer: nothing removed" in err
    assert ran == [] and compose.ComposeState.load("lab") is not None
    monkeypatch.setattr(compose.ComposeLab, "down", lambda self: ran.append("down"))
    monkeypatch.setattr(compose.DockerEngine, "answers", lambda self: True)  # back
    assert compose.main(["down", "--images"]) == 0
    assert ran == ["down", ("rmi", "agentd:latest")] and compose.ComposeState.load("lab") is None
    assert "removed (images too)" in capsys.readouterr().out


def test_a_lab_name_with_a_final_newline_is_refused():
    """NAME_RE.match with "$" let "dk\\n" through (compose's fullmatch did not): a newline in
    namespace names, paths and cgroups."""
    assert _lab_name("dk") == "dk"
    for bad in ("dk\n", "dk\n\n", "DK", "", "a" * 13, "d-k"):
        with pytest.raises(argparse.ArgumentTypeError):
            _lab_name(bad)


def test_unmount_under_decodes_every_octal_escape_of_mountinfo(tmp_path, monkeypatch):
    """The kernel writes a newline in a mount point as \\012 (tab \\011, backslash \\134): only
    \\040 was decoded, so such a mount under the engine's root was never unmounted."""
    root = tmp_path / "data"
    info = tmp_path / "mountinfo"
    lines = [f"36 35 0:1 / {root}/a\\012b rw - tmpfs t rw", f"37 35 0:1 / {root}/c\\040d\\011e\\134 rw - tmpfs t rw",
             f"38 35 0:1 / {root} rw - tmpfs t rw", "39 35 0:1 / /elsewhere rw - tmpfs t rw",
             # a sibling engine's (lab-dk-node10 beside lab-dk-node1, compose-lab2 beside compose-lab)
             f"40 35 0:1 / {root}2 rw - tmpfs t rw", f"41 35 0:1 / {root}2/x rw - tmpfs t rw"]
    info.write_text("\n".join(lines) + "\n")
    assert dockerd.mount_point("/x\\012y\\040z\\134") == "/x\ny z\\"
    umounted = []
    monkeypatch.setattr(dockerd.subprocess, "run", lambda argv, **kw: umounted.append(argv[-1]))
    dockerd.unmount_under(root, info)
    assert umounted == [f"{root}/c d\te\\", f"{root}/a\nb", str(root)]


def _start_argv(tmp_path, monkeypatch, **kw) -> tuple[list[str], dockerd.DockerEngine]:
    """The command line DockerEngine.start runs dockerd with (Popen captured: nothing is run)."""

    class Started(Exception):
        pass

    argvs = []

    def popen(argv, **_):
        argvs.append(argv)
        raise Started

    monkeypatch.setattr(dockerd.subprocess, "Popen", popen)
    engine = dockerd.DockerEngine("compose-t1", netns=Netns("ad-compose_t1-docker"), run_root=tmp_path / "run",
                                  data_root=tmp_path / "data", **kw)  # fmt: skip
    with pytest.raises(Started):
        engine.start()
    return argvs[0], engine


def _flag(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv) if word == name]


def test_a_private_engine_pins_the_cgroupfs_driver_for_its_path_cgroup_parent(tmp_path, monkeypatch):
    """A path --cgroup-parent and no cgroup driver: on a cgroup-v2 host booted with systemd
    (Debian 12), dockerd 20.10 takes the systemd driver by itself and refuses to start
    ("cgroup-parent for systemd cgroup should be a valid slice named as "xxx.slice"")."""
    argv, engine = _start_argv(tmp_path, monkeypatch)
    assert _flag(argv, "--cgroup-parent") == ["/ad-docker-compose-t1"] == [engine.cgroup_parent]
    assert _flag(argv, "--exec-opt") == ["native.cgroupdriver=cgroupfs"]


def test_a_private_engine_has_a_config_file_of_its_own_not_the_hosts_daemon_json(tmp_path, monkeypatch):
    """No --config-file: every private engine read the host's /etc/docker/daemon.json, and the
    docs' own recipe (bip, mtu, ip-masq there) made each Docker-host lab node's dockerd, given
    those as flags, refuse to start ("specified both as a flag and in the configuration file")."""
    argv, _ = _start_argv(tmp_path, monkeypatch, daemon_args=["--bip", "10.244.1.1/24", "--mtu", "1450"])
    assert _flag(argv, "--config-file") == [str(tmp_path / "run" / "daemon.json")]
    assert (tmp_path / "run" / "daemon.json").read_text().strip() == "{}"
    assert argv[-4:] == ["--bip", "10.244.1.1/24", "--mtu", "1450"]


def test_a_missing_docker_client_is_one_line_from_compose_not_a_traceback(tmp_path, monkeypatch, capsys):
    """DockerEngine.docker let FileNotFoundError through: `scripts/dev compose up --user-engine`
    with no /usr/bin/docker ended in a Python traceback."""
    monkeypatch.setattr(compose, "STATE_ROOT", tmp_path / "state")
    monkeypatch.setattr(dockerd, "DOCKER", str(tmp_path / "nonexistent" / "docker"))
    monkeypatch.setattr(dockerd.subprocess, "run", _no_such_file)
    assert compose.main(["--name", "zz", "up", "--user-engine"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot run {tmp_path}/nonexistent/docker: No such file" in err, err


def _no_such_file(argv, **_):
    raise FileNotFoundError(2, "No such file or directory", argv[0])


def _times_out(argv, *, timeout, **_):
    import subprocess

    raise subprocess.TimeoutExpired(argv, timeout)


def test_a_docker_or_compose_command_that_times_out_is_a_lab_error(monkeypatch):
    """subprocess.TimeoutExpired is neither an OSError nor a RuntimeError: it went through the
    lab's stages and compose's main as a traceback."""
    monkeypatch.setattr(dockerd.subprocess, "run", _times_out)
    engine = dockerd.DockerEngine("e1", netns=None)
    with pytest.raises(LabError, match=r"^docker run -d x \(e1\): timed out after 60s$"):
        engine.docker("run", "-d", "x", timeout=60)
    assert engine.answers() is False  # a timed-out `docker version`: the engine does not answer
    with pytest.raises(LabError, match=r"^docker-compose up -d: timed out after 600s$"):
        dockerd.compose(engine, "up", "-d", project="p", file=dockerd.Path("/nonexistent/compose.yaml"))
    monkeypatch.setattr(dockerd.subprocess, "run", _no_such_file)
    monkeypatch.setattr(dockerd, "COMPOSE", "/nonexistent/docker-compose")
    with pytest.raises(LabError, match="^docker-compose ps: cannot run /nonexistent/docker-compose: No such file"):
        dockerd.compose(engine, "ps", project="p", file=dockerd.Path("/nonexistent/compose.yaml"))


def test_a_failed_compose_up_that_times_out_keeps_the_down_hint(tmp_path, monkeypatch, capsys):
    """A timeout after up had recorded its state: a traceback, and no word that `down` removes
    what was made."""
    monkeypatch.setattr(compose, "STATE_ROOT", tmp_path / "state")
    monkeypatch.setattr(compose.DockerEngine, "answers", lambda self: True)
    monkeypatch.setattr(dockerd.subprocess, "run", _times_out)  # `docker image inspect`, the first image check
    assert compose.main(["--name", "zz", "up", "--user-engine"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("scripts/dev compose: docker image inspect ") and err[0].endswith("timed out after 60s")
    assert err[1:] == ["(left as it is for a look; `scripts/dev compose down` removes what was made)"]
    assert compose.ComposeState.load("zz") is not None


def test_a_failing_busybox_list_is_a_lab_error(tmp_path, monkeypatch):
    """busybox --list ran with check=True: its CalledProcessError went through `agentd lab up
    --docker`'s stage as a traceback."""
    import subprocess

    from agentd.lab import images

    fake = tmp_path / "busybox"
    fake.write_bytes(b"\x7fELF")
    monkeypatch.setattr(images, "BUSYBOX", fake)
    monkeypatch.setattr(images, "IMAGE_CACHE", tmp_path / "cache")
    (tmp_path / "cache").mkdir()
    monkeypatch.setattr(dockerd.subprocess, "run",
                        lambda argv, **_: subprocess.CompletedProcess(argv, 1, "", "busybox: applet not found"))
    with pytest.raises(LabError, match="busybox --list exited 1 listing 0 applets: busybox: applet not found"):
        images.busybox_tarball()
    assert not list((tmp_path / "cache").glob("*.tar"))


def test_a_subprocess_error_in_a_lab_stage_is_a_lab_error(tmp_path, monkeypatch):
    """Lab.up turned NetnsError, OSError and RuntimeError into "stage ... failed", not a
    command's timeout or check=True failure (subprocess.SubprocessError)."""
    import asyncio
    import subprocess

    from agentd.lab import lab as lab_module

    monkeypatch.setattr(lab_module, "list_names", lambda prefix: [])
    monkeypatch.setattr(lab_module.bpffs, "sweep_dead", lambda root: None)
    monkeypatch.setattr(lab_module.bpffs, "umount", lambda path: None)
    monkeypatch.setattr(lab_module.bpffs, "mount", lambda path: None)
    lab = lab_module.Lab(lab_module.LabSpec(name="zz", nodes=1), root=tmp_path)

    def build(*_, **__):
        raise subprocess.CalledProcessError(2, ["ip", "link", "add"])

    monkeypatch.setattr(lab.network, "build", build)
    with pytest.raises(LabError, match=r"^stage 'network namespaces' failed: Command .*ip.* returned non-zero"):
        asyncio.run(lab.up(1))


def test_compose_commands_say_what_could_not_run_in_one_line(tmp_path, monkeypatch, capsys):
    """A pass-through command without docker-compose exited 127 without a word (spawnvp's
    child); a timeout of another command of up's (nsenter ... ip addr) was a traceback."""
    import subprocess

    monkeypatch.setattr(compose, "STATE_ROOT", tmp_path / "state")
    monkeypatch.setattr(compose, "COMPOSE", str(tmp_path / "docker-compose"))
    compose.ComposeState(name="zz", project="agentdzz", host="unix:///x.sock", private=False, netns=None,
                         backend="host-gw", images=[], env={}).save()  # fmt: skip
    assert compose.main(["--name", "zz", "ps"]) == 1
    assert capsys.readouterr().err == (f"scripts/dev compose: cannot run {tmp_path}/docker-compose: not an executable "
                                       "file (apt-get install docker-compose)\n")  # fmt: skip

    def up(args):
        raise subprocess.TimeoutExpired(["nsenter", "ip"], 30)

    monkeypatch.setattr(compose, "cmd_up", up)
    assert compose.main(["--name", "zz", "up"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "scripts/dev compose: Command '['nsenter', 'ip']' timed out after 30 seconds" and len(err) == 2


def test_leftovers_of_an_engine_are_not_another_engines_whose_path_it_begins(no_host, tmp_path, monkeypatch):
    """leftovers() matched the data root as a plain substring of every command line:
    compose-lab2's dockerd (--data-root .../compose-lab2) was reported as compose-lab's."""
    proc = tmp_path / "proc"
    cmdlines = {"100": b"dockerd\0--data-root\0/var/lib/ad-docker/compose-lab2\0--exec-root\0/run/ad-docker/x\0",
                "101": b"containerd-shim\0-namespace\0moby\0--data-root=/var/lib/ad-docker/compose-lab\0",
                "102": b"containerd\0--root\0/var/lib/ad-docker/compose-lab/containerd/daemon\0",
                "103": b"dockerd\0--data-root\0/var/lib/ad-docker/compose-lab",
                "self": b"python\0/var/lib/ad-docker/compose-lab\0"}  # not a pid
    for pid, cmdline in cmdlines.items():
        (proc / pid).mkdir(parents=True)
        (proc / pid / "cmdline").write_bytes(cmdline)
    monkeypatch.setattr(compose, "PROC", proc)
    engine = dockerd.DockerEngine("compose-lab", netns=None, run_root=tmp_path / "no-run",
                                  data_root=dockerd.Path("/var/lib/ad-docker/compose-lab"))  # fmt: skip
    assert sorted(line.split(":")[0] for line in compose.leftovers(engine)) == ["process 101", "process 102", "process 103"]
    # _kill_leftovers' test of a command line, the same boundary
    data = dockerd.Path("/var/lib/ad-docker/compose-lab")
    assert not dockerd.mentions(cmdlines["100"], [data])
    assert all(dockerd.mentions(cmdlines[p], [data]) for p in ("101", "102", "103"))
    assert dockerd.mentions(b"x\0/var/lib/ad-docker/compose-lab/\0", [dockerd.Path("/var/lib/ad-docker/compose-lab/")])


class _Engine:
    """A DockerEngine's docker(): each call recorded, the return code of each subcommand given."""

    def __init__(self, codes):
        self.codes, self.calls = codes, []

    def docker(self, *args, check=True, timeout=300, input=None):
        import subprocess

        self.calls.append(args)
        return subprocess.CompletedProcess(args, self.codes.get(args[0], 0), "", "")


def test_a_cached_base_image_does_not_make_an_unreachable_registry_reachable(monkeypatch):
    """registry_reachable returned True as soon as the engine had python:3.11-slim-bookworm:
    offline, the build then took the registry path (apt-get, pip from PyPI, etcd from quay.io)."""
    from agentd.lab import images

    monkeypatch.delenv("AGENTD_LOCAL_BASE", raising=False)
    offline = _Engine({"image": 0, "pull": 1})  # has the image, cannot pull
    assert images.registry_reachable(offline) is False
    assert ("pull", "--quiet", images.REGISTRY_BASE) in offline.calls
    assert images.registry_reachable(_Engine({"image": 0, "pull": 0})) is True


def test_wheels_are_fetched_for_the_images_python_and_platform_not_the_hosts(tmp_path, monkeypatch):
    """pip download ran for the host's interpreter (a 3.12 venv, a newer glibc): the image's
    --no-index install then found "No matching distribution"."""
    import subprocess

    from agentd.lab import images

    argvs = []
    monkeypatch.setattr(dockerd.subprocess, "run", lambda argv, **_: argvs.append(argv) or
                        subprocess.CompletedProcess(argv, 0, "", ""))  # fmt: skip
    monkeypatch.setattr(images.platform, "machine", lambda: "aarch64")
    images.fetch_wheels(tmp_path)
    argv = argvs[0]
    flag = lambda name: [argv[i + 1] for i, w in enumerate(argv) if w == name]
    assert flag("--python-version") == ["3.11"] and flag("--implementation") == ["cp"] and flag("--abi") == ["cp311"]
    assert "manylinux_2_36_aarch64" in flag("--platform") and "manylinux2014_aarch64" in flag("--platform")
    assert "manylinux_2_37_aarch64" not in flag("--platform")  # newer than bookworm's glibc
