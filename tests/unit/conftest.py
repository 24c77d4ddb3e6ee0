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
