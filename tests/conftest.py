import getpass
import os
import pathlib
import signal
import tempfile

import pytest
from hypothesis import HealthCheck, settings

pytest_plugins = ["agentd.lab.fixtures", "agentd.lab.fixtures_etcd"]

_ROOT = pathlib.Path(__file__).parent.parent
_SYSTEM = _ROOT / "tests" / "system"

# Hypothesis' defaults are wall-clock assertions (a 200 ms deadline per example, a health
# check that fails "too slow" data generation): on a shared, loaded machine they fail tests
# that are right.  Examples are bounded by count; the per-test timeout still applies.
settings.register_profile("agentd", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("agentd")

# `scripts/dev test` runs the suite on several pytest-xdist workers with --dist loadfile: a
# worker takes a file at a time and runs all its tests, in order, so what a file's tests share
# (a module-scoped lab, a module's event loop) is made once, on one worker.  Files that share a
# resource of the whole run are one unit, below.  Everything else a test makes is its own on
# any worker -- namespaces and labs named by agentd.lab.netns.unique_tag, etcd on picked
# ports, files under tmp_path, a private dockerd per name -- as it must be beside the other
# runs on the machine.
#
# The session-scoped ``docker_engine`` is one private dockerd with the images built in it (once
# per worker that asks for it), and the Docker networks these files make on it have fixed
# ranges: one worker, one after another.
SHARED = {"docker-engine": ("tests/system/test_compose_lab.py", "tests/system/test_systemd_container.py")}
_SHARED_FIXTURES = {"docker_engine": "docker-engine"}
_UNIT_OF = {path: unit for unit, paths in SHARED.items() for path in paths}

# Workers take units in collection order (--no-loadscope-reorder), one at a time as they run
# dry: the ones that take minutes first, so that no worker is left with a long one at the end
# while the others idle; then the other system tests, the quick unit tests last.  Only an
# order: a file missing here runs all the same.
LONG_FIRST = (
    "docker-engine",
    "tests/system/test_encap.py",
    "tests/system/test_lab.py",
    "tests/system/test_flows.py",
    "tests/system/test_netpol.py",
    "tests/system/test_etcd_cluster.py",
    "tests/system/test_bgp_bird.py",
    "tests/system/test_dataplane.py",
    "tests/system/test_systemd.py",
)


def pytest_configure(config):
    """In the controller and in every xdist worker: SIGTERM ends the run with its teardown (a
    KeyboardInterrupt, as Ctrl-C), and the daemons a test starts die with this process even
    when it is SIGKILLed (PR_SET_PDEATHSIG: agentd.lab.netns.tie_children_to_this_process)."""
    from agentd.lab.fixtures import end_run_on_sigterm
    from agentd.lab.netns import tie_children_to_this_process

    end_run_on_sigterm()
    tie_children_to_this_process()


def pytest_sessionstart(session):
    """Before the run (once, not in each xdist worker): delete the network namespaces an earlier
    run left when it was killed (agentd.lab.netns.sweep_dead_owners: only those a test run
    recorded as its own, whose process is gone), then unmount the BPF file systems of labs an
    earlier run left behind when it was killed (agentd.lab.bpffs.sweep_dead) -- their pins keep
    programs and maps alive, and pytest cannot remove their directories."""
    if os.geteuid() != 0 or hasattr(session.config, "workerinput"):
        return
    from agentd.lab import bpffs, netns
    from agentd.lab.fixtures import stop_engine_in

    # First the namespaces (and the daemons in them, a Docker engine's containers too) such a
    # run made: a lab's bpffs is left mounted while its namespaces exist.
    for name in netns.sweep_dead_owners(before_delete=stop_engine_in):
        print(f"agentd: deleted network namespace {name}, left by a run that was killed")

    tmp = pathlib.Path(tempfile.gettempdir())
    try:  # pytest's base temp, and the short lab roots some tests make beside it (ad-sb-*)
        swept = [p for base in (tmp / f"pytest-of-{getpass.getuser()}", *tmp.glob("ad-sb-*"))
                 for p in bpffs.sweep_dead(base)]
    except OSError as err:  # a tidy-up: the run goes on without it
        print(f"agentd: could not look for file systems left by killed runs: {err}")
        swept = []
    for point in swept:
        print(f"agentd: unmounted {point}, left by a lab of a run that was killed")


def pytest_collection_modifyitems(config, items):
    files: dict[pathlib.Path, list[pytest.Item]] = {}
    for item in items:
        path = pathlib.Path(str(item.path))
        # Everything under tests/system is a system test: root, namespaces, real daemons.
        if _SYSTEM in path.parents:
            item.add_marker(pytest.mark.system)
        files.setdefault(path, []).append(item)
    rank: dict[pathlib.Path, tuple[int, int]] = {}
    for n, (path, file_items) in enumerate(files.items()):
        name = path.relative_to(_ROOT).as_posix()
        unit = _UNIT_OF.get(name, name)
        for fixture in {f for item in file_items for f in item.fixturenames if f in _SHARED_FIXTURES}:
            assert unit == _SHARED_FIXTURES[fixture], (
                f"{name} uses {fixture}: add it to SHARED[{_SHARED_FIXTURES[fixture]!r}] in tests/conftest.py "
                "(one worker has the resource)")
        first = LONG_FIRST.index(unit) if unit in LONG_FIRST else len(LONG_FIRST) + (_SYSTEM not in path.parents)
        rank[path] = (first, n)
    # A stable sort: each file's tests stay together and in their order.
    items.sort(key=lambda item: rank[pathlib.Path(str(item.path))])


# The first test to ask for ``docker_engine`` pays for it in its setup: a dockerd started, the
# images built from Debian packages, compose.yaml up, the systemd image -- on a clean machine
# more than the 300 s pyproject.toml gives a test.  Whichever test that is (test_compose_lab's
# first in a whole run; another where -k or a file chooses), it gets this long.
ENGINE_TIMEOUT = 900


def pytest_collection_finish(session):
    """After selection (-k, -m, node ids): the first test using ``docker_engine``, as its
    worker runs them (a SHARED unit's files are one worker's, in this order), has
    :data:`ENGINE_TIMEOUT` unless its own timeout is longer."""
    first = next((item for item in session.items if "docker_engine" in getattr(item, "fixturenames", ())), None)
    if first is None:
        return
    mark = first.get_closest_marker("timeout")
    given = mark.args[0] if mark is not None and mark.args else mark.kwargs.get("timeout") if mark is not None else None
    if given is None or given < ENGINE_TIMEOUT:
        first.add_marker(pytest.mark.timeout(ENGINE_TIMEOUT), append=False)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with the files of one SHARED unit as one."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileUnits(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return _UNIT_OF.get(path, path)

    return FileUnits(config, log)


@pytest.fixture(autouse=True)
def _system_tests_need_root(request):
    if request.node.get_closest_marker("system") and os.geteuid() != 0:
        pytest.fail("system tests need root (network namespaces); run them via scripts/dev test")


@pytest.fixture(autouse=True)
def _signal_handlers_kept():
    """SIGTERM, SIGINT and SIGHUP as the run has them after every test: a test that runs an
    event loop's signal handlers (Agent.run) leaves them at SIG_DFL when the loop removes its
    own, which would lose the run's SIGTERM teardown (pytest_configure)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    yield
    for sig, handler in saved.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
