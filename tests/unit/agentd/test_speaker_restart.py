"""``agentd speaker`` knows it restarted as the agent does from the kernel routes a previous run
left: from the file a speaker with graceful restart keeps in ``[agent] state_dir`` while it
runs (agentd.daemon.speaker.RunMarker).  Restarting, its OPENs carry Restart State and route
selection is deferred (RFC 4724 §3, §4.1)."""

from __future__ import annotations

import pytest

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


def _held(host="127.0.0.1"):
    import socket

    sock = socket.socket()
    sock.bind((host, 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def _start_fails(rt, tmp_path, caplog):
    """rt.run() returns 1 and leaves nothing running: neither the BGP service nor the API, no
    speaker.running to make the next start claim a graceful restart.  Its one error."""
    import asyncio
    import logging

    with caplog.at_level(logging.INFO, logger="agentd"):
        assert asyncio.run(rt.run()) == 1
    assert not rt.service.speaker.started and not rt.api.running
    assert not (tmp_path / RUNNING_FILE).exists()
    (error,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    return error


def test_an_api_port_taken_at_start_is_one_error_and_leaves_nothing_running(tmp_path, caplog):
    """`[api] listen` taken (the speaker's default is the agent's: one runs on this node):
    run() returns 1 with one error naming the key, the BGP service not started and no
    speaker.running left to make the next start claim a graceful restart."""
    held, port = _held()
    try:
        rt = SpeakerRuntime(config(tmp_path, **{"api.listen": f"127.0.0.1:{port}", "bgp.listen": "",
                                                "bgp.originate": "10.99.0.0/16"}))
        error = _start_fails(rt, tmp_path, caplog)
    finally:
        held.close()
    assert f"cannot serve the API on 127.0.0.1:{port} ([api] listen): " in error, error
    assert "give this speaker its own [api] listen" in error, error
    assert not SpeakerRuntime(config(tmp_path)).speaker.restart.restarting


# bgp.transport.SpeakerService.start leaves its listening socket unclosed when the bind fails
# (a ResourceWarning once collected): not the speaker's to close.
@pytest.mark.filterwarnings("ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning")
def test_a_bgp_port_taken_at_start_is_one_error_and_stops_the_api(tmp_path, caplog):
    """`[bgp] listen` taken (an agent on this node listens on 0.0.0.0:179): the API, started
    first, is stopped again, and nothing else has started."""
    held, port = _held()
    try:
        rt = SpeakerRuntime(config(tmp_path, **{"bgp.listen": f"127.0.0.1:{port}"}))
        rt.api.port = 0  # any free one (the configuration's must be fixed)
        error = _start_fails(rt, tmp_path, caplog)
    finally:
        held.close()
    assert f"cannot listen for BGP on 127.0.0.1:{port} ([bgp] listen): " in error, error


def test_a_speaker_that_started_writes_its_file_and_a_stop_returns_0(tmp_path):
    import asyncio
    import signal

    rt = SpeakerRuntime(config(tmp_path, **{"bgp.listen": ""}))
    rt.api.port = 0
    seen = []

    async def stop_once_ready():
        while not rt.readiness()[0]:
            await asyncio.sleep(0)
        seen.append((tmp_path / RUNNING_FILE).exists())
        rt.stop()

    async def main():
        loop = asyncio.get_running_loop()
        stopper = asyncio.ensure_future(stop_once_ready())
        code = await rt.run()
        await stopper
        assert not loop.remove_signal_handler(signal.SIGTERM)  # none left behind
        return code

    assert asyncio.run(main()) == 0 and seen == [True]
    assert (tmp_path / RUNNING_FILE).exists()  # a graceful stop keeps it
    assert not rt.api.running


@pytest.mark.parametrize("previous", [False, True], ids=["fresh", "after-a-previous-run"])
@pytest.mark.parametrize("during", ["api", "service"])
def test_a_sigterm_during_start_up_configures_no_peer_and_leaves_the_marker_alone(tmp_path, during, previous):
    """SIGTERM while the API or the BGP listener starts: the start stops after that step, with
    no peer configured (no Connect goes out) and speaker.running as it was -- not written (the
    next start would claim a graceful restart though no peer holds our routes), nor removed
    (the peers of a previous run may still hold them) -- and run() returns 0."""
    import asyncio
    import os
    import signal

    if previous:
        RunMarker(tmp_path).write()
    rt = SpeakerRuntime(config(tmp_path, **{"bgp.listen": "127.0.0.1:0",
                                            "bgp.peers": '[{"address": "192.0.2.2", "asn": 64513}]'}))
    assert len(rt.cfg.bgp.peers) == 1
    rt.api.port = 0
    step = rt.api if during == "api" else rt.service
    start = step.start

    async def sigterm_meanwhile():
        os.kill(os.getpid(), signal.SIGTERM)
        while not rt._stop.is_set():  # the loop runs the handler
            await asyncio.sleep(0)
        await start()

    step.start = sigterm_meanwhile
    assert asyncio.run(rt.run()) == 0
    assert (tmp_path / RUNNING_FILE).exists() is previous
    assert not rt.speaker.peers and not rt.speaker.started and not rt.api.running
