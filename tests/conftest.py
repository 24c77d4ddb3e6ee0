import os
import pathlib

import pytest
from hypothesis import HealthCheck, settings

pytest_plugins = ["agentd.lab.fixtures", "agentd.lab.fixtures_etcd"]

_SYSTEM = pathlib.Path(__file__).parent / "system"

# Hypothesis' defaults are wall-clock assertions (a 200 ms deadline per example, a health
# check that fails "too slow" data generation): on a shared, loaded machine they fail tests
# that are right.  Examples are bounded by count; the per-test timeout still applies.
settings.register_profile("agentd", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("agentd")


def pytest_collection_modifyitems(config, items):
    # Everything under tests/system is a system test: root, namespaces, real daemons.
    for item in items:
        if _SYSTEM in pathlib.Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.system)


@pytest.fixture(autouse=True)
def _system_tests_need_root(request):
    if request.node.get_closest_marker("system") and os.geteuid() != 0:
        pytest.fail("system tests need root (network namespaces); run them via scripts/dev test")
