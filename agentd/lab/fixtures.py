"""pytest fixtures for system tests (loaded as a plugin by tests/conftest.py).

``netns_factory(role)`` makes a uniquely named namespace ``ad-<tag>-<role>``;
every namespace it made is deleted (processes killed first) when the test ends,
pass or fail.  ``routers`` is one interop test's routers and daemons (BIRD, agentd
speaker, GoBGP, BFD; agentd.lab.interop.Routers), all stopped when it ends.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from agentd.lab.netns import Netns, delete_matching, unique_tag

_terminating = False


def on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM (a CI timeout, ``kill``): end the run as Ctrl-C does -- a KeyboardInterrupt, so
    pytest runs every fixture's finalizer (labs down, namespaces deleted, daemons stopped)
    instead of dying at once.  Only the first: a second SIGTERM must not cut the teardown
    short (SIGKILL still ends it; the daemons then die with the run, agentd.lab.netns.tied)."""
    global _terminating
    if _terminating:
        print("agentd: SIGTERM again: still tearing down", flush=True)
        return
    _terminating = True
    raise KeyboardInterrupt("SIGTERM")


def engine_of_namespace(name: str):
    """The private Docker engine that runs in the lab namespace ``name``, if one does: the
    compose lab's (``ad-compose_<name>-docker``) or a Docker-host node's (``ad-<lab>-nodeK``,
    whose run directory is there); else None."""
    from agentd.lab.dockerd import DATA_ROOT, RUN_ROOT, DockerEngine

    if name.startswith("ad-compose_") and name.endswith("-docker"):
        from agentd.lab.compose import private_engine

        return private_engine(name[len("ad-compose_"):-len("-docker")])
    lab, _, node = name[len("ad-"):].rpartition("-")
    engine = f"lab-{lab}-{node}"
    if name.startswith("ad-") and lab and node.startswith("node") and (RUN_ROOT / engine).is_dir():
        return DockerEngine(engine, netns=Netns(name), run_root=RUN_ROOT / engine, data_root=DATA_ROOT / engine,
                            shared_netns=True)  # fmt: skip
    return None


def stop_engine_in(name: str) -> None:
    """Before a killed run's namespace ``name`` is deleted (agentd.lab.netns.sweep_dead_owners):
    stop the Docker engine in it, if any -- its containers (each in a namespace of its own,
    which killing the namespace's processes leaves running), the namespaces it keeps mounted
    under its run directory, its files."""
    engine = engine_of_namespace(name)
    if engine is not None:
        engine.stop()


def end_run_on_sigterm() -> None:
    """Install :func:`on_sigterm` (from the main thread: pytest's, or an xdist worker's)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)


@pytest.fixture
def netns_factory() -> Iterator[Callable[[str], Netns]]:
    tag = unique_tag()
    made: list[Netns] = []

    def make(role: str) -> Netns:
        ns = Netns.create(f"ad-{tag}-{role}")
        made.append(ns)
        return ns

    try:
        yield make
    finally:
        for ns in reversed(made):
            ns.delete()
        delete_matching(f"ad-{tag}-")


@pytest.fixture
def routers(netns_factory, tmp_path):
    """:class:`agentd.lab.interop.Routers` for this test: ``routers.pair()``, ``routers.lan(3)``,
    ``routers.bird(ns, conf)``, ``routers.speaker(ns, cfg)``, ...; every daemon started through
    it is stopped before the namespaces go, pass or fail."""
    from agentd.lab.interop import Routers

    made = Routers(netns_factory, tmp_path)
    try:
        yield made
    finally:
        made.stop()


@pytest.fixture
def bpffs(tmp_path) -> Iterator[str]:
    """A BPF file system of the test's own (mounted under tmp_path, unmounted at the end)."""
    from agentd.lab import bpffs as fs

    path = fs.mount(tmp_path / "bpffs", owner=os.getpid())
    try:
        yield str(path)
    finally:
        fs.umount(path)


@pytest.fixture
async def lab_factory(tmp_path):
    """``await lab_factory(nodes=3, pods=2, bgp="mesh", ...)`` -> a running :class:`Lab`.

    Every lab made is taken down when the test ends, pass or fail; its logs stay under
    tmp_path for inspection.
    """
    from agentd.lab.lab import Lab, LabSpec

    labs: list[Lab] = []

    async def make(*, timeout: float = 60.0, full: bool = True, progress=None, **spec) -> Lab:
        lab = Lab(LabSpec(name="l" + unique_tag("")[:6], **spec), root=tmp_path / "labs", progress=progress)
        labs.append(lab)
        await lab.up(timeout=timeout, full=full)
        return lab

    try:
        yield make
    finally:
        for lab in reversed(labs):
            await lab.down(keep_files=True)


@pytest.fixture(scope="session")
def docker_engine():
    """The container lab's engine, made by the documented command and shared by the run.

    ``python -m agentd.lab.compose --name <tag> up --private`` -- what ``scripts/dev compose
    up`` runs after setup -- starts a private dockerd in a network namespace of its own,
    builds the images (without a registry: from Debian packages; once per run), brings
    compose.yaml up (host-gw) and prints the pod matrix; ``compose exec node1 agentd status``
    is asked once.  Then that project is taken down (later tests run their own on the same
    network range) and the systemd image is built on top.  Yields a
    :class:`agentd.lab.compose.SharedEngine`; at the end ``down --images`` runs and the
    teardown fails if anything of the engine is left: its namespace, a dockerd/containerd
    process, a mount, a cgroup or a file."""
    from agentd.lab.compose import shared_engine

    with shared_engine(unique_tag("c")) as shared:
        yield shared
