"""``agentd speaker`` knows it restarted as the agent does from the kernel routes a previous run
left: from the file a speaker with graceful restart keeps in ``[agent] state_dir`` while it
runs (agentd.daemon.speaker.RunMarker).  Restarting, its OPENs carry Restart State and route
selection is deferred (RFC 4724 §3, §4.1)."""

from __future__ import annotations

from agentd.config.settings import load_config
from agentd.daemon.speaker import RUNNING_FILE, RunMarker, SpeakerRuntime


def config(tmp_path, **overrides):
    return load_config(None, env={}, overrides={"node.name": "rr", "node.address": "192.0.2.1",
                                                "agent.state_dir": str(tmp_path), **overrides})


def test_a_speaker_finding_a_previous_runs_file_is_restarting(tmp_path):
    fresh = SpeakerRuntime(config(tmp_path))
    assert not fresh.speaker.restart.restarting and not fresh.speaker.deferring
    RunMarker(tmp_path).write()  # what the first speaker leaves when killed or stopped gracefully
    assert (tmp_path / RUNNING_FILE).exists()
    again = SpeakerRuntime(config(tmp_path))
    assert again.speaker.restart.restarting and again.speaker.deferring
    assert again.speaker.local.forwarding_preserved  # its routes come from its configuration


def test_without_graceful_restart_or_after_a_withdrawing_stop_it_is_not(tmp_path):
    marker = RunMarker(tmp_path)
    marker.write()
    assert not SpeakerRuntime(config(tmp_path, **{"bgp.graceful_restart": False})).speaker.restart.restarting
    marker.remove()  # a stop that sent Cease to every peer
    marker.remove()  # twice: no error
    assert not SpeakerRuntime(config(tmp_path)).speaker.restart.restarting


def test_an_unwritable_state_dir_is_one_warning(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    marker = RunMarker(tmp_path / "file" / "sub")  # a file where a directory should be
    marker.write()
    assert not marker.found()
    assert "cannot write" in caplog.text
