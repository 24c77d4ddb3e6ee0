import os
import pathlib

import pytest

pytest_plugins = ["agentd.lab.fixtures", "agentd.lab.fixtures_etcd"]

_SYSTEM = pathlib.Path(__file__).parent / "system"


def pytest_collection_modifyitems(config, items):
    # Everything under tests/system is a system test: root, namespaces, real daemons.
    for item in items:
        if _SYSTEM in pathlib.Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.system)


@pytest.fixture(autouse=True)
def _system_tests_need_root(request):
    if request.node.get_closest_marker("system") and os.geteuid() != 0:
        pytest.fail("system tests need root (network namespaces); run them via scripts/dev test")
