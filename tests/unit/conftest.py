import os

import pytest


@pytest.fixture(autouse=True)
def _no_agentd_environment(monkeypatch):
    """AGENTD_* variables are configuration sources (AGENTD_CONFIG, AGENTD_<SECTION>_<KEY>): the
    commands and the agent's reload read os.environ, so a caller's -- an operator's shell on a
    node -- would change what these tests see. A test that wants one sets it itself."""
    for key in list(os.environ):
        if key.startswith("AGENTD_"):
            monkeypatch.delenv(key)


@pytest.fixture(autouse=True)
def _root_logger_as_it_was():
    """A test that runs a command's set-up (agentd.cli.setup_logging: a StreamHandler on the
    sys.stderr of that moment, pytest's capture) leaves the root logger as it found it: a
    handler left on a capture stream that is closed by then made a later test's every log
    record a "--- Logging error ---" traceback on stderr (test_docker_opts after test_resources)."""
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for h in root.handlers[:]:
        if h not in handlers:
            root.removeHandler(h)
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)
