"""``agentd speaker``'s reload (SIGHUP) applies what the agent's does (agentd.config.settings.reloaded):
the peers, listen ranges and [log] live, and its originated prefixes; the rest waits for a
restart, so a reload that changes only [bgp] hold_time resets no session of a peer that inherits
it."""

from __future__ import annotations

import asyncio
import json
import logging

from agentd.config.settings import load_config
from agentd.daemon.speaker import SpeakerRuntime, listen_ranges, peer_settings

PEERS = [{"address": "192.0.2.2", "asn": 64513}, {"address": "192.0.2.3", "asn": 64513, "hold_time": 9}]
RANGES = [{"prefix": "10.1.0.0/16", "asn": 64513}]


def config(tmp_path, **env):
    base = {"AGENTD_NODE_NAME": "rr", "AGENTD_NODE_ADDRESS": "192.0.2.1", "AGENTD_AGENT_STATE_DIR": str(tmp_path),
            "AGENTD_BGP_LISTEN": "127.0.0.1:1179", "AGENTD_BGP_PEERS": json.dumps(PEERS),
            "AGENTD_BGP_LISTEN_RANGES": json.dumps(RANGES)}
    return load_config(None, env={**base, **env})


def _serve_configured(rt, running):
    """The service's loop (the running one), its peers and listen ranges those of ``running``:
    neither its listener (never bound here) nor the speaker started -- what a reload does to
    the peer set is all the tests look at."""
    rt.service._loop = asyncio.get_running_loop()
    rt.service.set_peers(peer_settings(p, running) for p in running.bgp.peers)
    rt.service.set_listen_ranges(listen_ranges(running))


def _speaker_started_by_the_cli(monkeypatch, environ, default_config):
    """`agentd speaker` (cli.main) with ``environ`` for the environment and ``default_config`` for
    the default file, the runtime a fake that only records what it is given: the configuration
    it started with and the reload the CLI gave it."""
    import os

    import agentd.daemon.speaker
    from agentd import cli

    monkeypatch.setattr(os, "environ", environ)
    monkeypatch.setattr(cli, "DEFAULT_CONFIG_PATH", str(default_config))
    for name in ("setup_logging", "tune_gc", "limit_malloc_arenas"):
        monkeypatch.setattr(cli, name, lambda *a, **k: None)
    started = []

    class Speaker:
        def __init__(self, cfg):
            self.cfg = cfg

        async def run(self, *, reload, set_logging):
            started.append((self.cfg, reload))
            return 0

    monkeypatch.setattr(agentd.daemon.speaker, "SpeakerRuntime", Speaker)
    assert cli.main(["speaker"]) == 0
    ((running, reload),) = started
    return running, reload


def test_a_reload_that_changes_only_bgp_hold_time_resets_no_session(tmp_path, caplog):
    running = config(tmp_path)
    rt = SpeakerRuntime(running)

    async def main():
        _serve_configured(rt, running)
        before = dict(rt.speaker.peers)
        ranges = list(rt.speaker.listen_ranges)
        with caplog.at_level(logging.INFO, logger="agentd.speaker"):
            rt._reload(lambda: config(tmp_path, AGENTD_BGP_HOLD_TIME="30"))
        # The same Peer objects (set_peers replaces a peer whose settings changed: Cease/Other
        # Configuration Change), still offering the running [bgp] hold_time.
        assert {k: id(p) for k, p in rt.speaker.peers.items()} == {k: id(p) for k, p in before.items()}
        assert [p.settings.hold_time for p in rt.speaker.peers.values()] == [90, 9]
        assert rt.speaker.listen_ranges == ranges and ranges[0].template.hold_time == 90
        assert rt.cfg.bgp.hold_time == 90
        assert "changed but applied only by a restart: [bgp] hold_time, [bgp] keepalive_time" in caplog.text
        # What changes live does: a peer, a range's own hold_time, the originated prefixes.
        caplog.clear()
        peers = json.dumps([*PEERS, {"address": "192.0.2.4", "asn": 64513}])
        rt._reload(lambda: config(tmp_path, AGENTD_BGP_HOLD_TIME="30", AGENTD_BGP_PEERS=peers,
                                  AGENTD_BGP_ORIGINATE="10.99.0.0/24",
                                  AGENTD_BGP_LISTEN_RANGES=json.dumps([{**RANGES[0], "hold_time": 30}])))
        assert sorted(rt.speaker.peers) == ["192.0.2.2", "192.0.2.3", "192.0.2.4"]
        assert rt.speaker.peers["192.0.2.2"] is before["192.0.2.2"]
        assert rt.speaker.peers["192.0.2.4"].settings.hold_time == 90
        assert rt.speaker.listen_ranges[0].template.hold_time == 30
        assert [str(p) for p in rt.cfg.bgp.originate] == ["10.99.0.0/24"] and rt.speaker.rib.count() == 1
        assert "[bgp] originate" not in caplog.text

    asyncio.run(main())


def test_a_reload_whose_peers_need_a_restart_only_key_keeps_the_running_peers(tmp_path, caplog):
    """An rr_client peer read with a new [node] route_reflector = true (applied only by a
    restart): the running peers and ranges stay, one error says why; the originated prefixes
    and [log] still change."""
    running = config(tmp_path)
    rt = SpeakerRuntime(running)

    async def main():
        _serve_configured(rt, running)
        before = dict(rt.speaker.peers)
        peers = json.dumps([*PEERS, {"address": "192.0.2.4", "asn": 64512, "rr_client": True}])
        with caplog.at_level(logging.INFO, logger="agentd.speaker"):
            rt._reload(lambda: config(tmp_path, AGENTD_NODE_ROUTE_REFLECTOR="true", AGENTD_BGP_PEERS=peers,
                                      AGENTD_BGP_ORIGINATE="10.99.0.0/24", AGENTD_LOG_LEVEL="debug"))
        assert rt.speaker.peers == before and rt.cfg.bgp.peers == running.bgp.peers
        assert [str(p) for p in rt.cfg.bgp.originate] == ["10.99.0.0/24"] and rt.cfg.log.level == "debug"
        (error,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert "[[bgp.peers]] #3 rr_client: needs [node] route_reflector = true" in error, error
        assert "running [node] route_reflector" in error, error

    asyncio.run(main())


def test_agentd_status_of_a_speaker_shows_its_loc_rib_and_no_datastore_alarm(tmp_path):
    """A dedicated reflector uses no etcd by design: `agentd status` said "datastore
    DISCONNECTED" (and "Routes programmed 0") on a healthy one.  Its Loc-RIB's size instead,
    and "datastore -"."""
    from agentd.cli import render_status

    running = config(tmp_path, AGENTD_BGP_ORIGINATE="10.99.0.0/24")
    rt = SpeakerRuntime(running)

    async def main():
        rt.service._loop = asyncio.get_running_loop()
        rt._reload(lambda: config(tmp_path, AGENTD_BGP_ORIGINATE="10.99.0.0/24,10.98.0.0/24"))
        return rt.status()

    status = asyncio.run(main())
    assert status["bgp"]["loc_rib_prefixes"] == 2
    lines = render_status(status).splitlines()
    assert "Loc-RIB 2 prefixes  datastore -" in lines, lines
    assert "DISCONNECTED" not in "\n".join(lines) and "Routes programmed" not in "\n".join(lines)
    # An agent without its etcd still says so.
    agent = {"node": {"name": "n1"}, "bgp": {"peers": []}, "routes": {"programmed": 3, "last_sync": None},
             "datastore": {"connected": False, "endpoints": ["http://127.0.0.1:2379"], "endpoint": None}}
    assert "Routes programmed 3  last sync -  datastore DISCONNECTED" in render_status(agent).splitlines()


def test_a_reload_with_the_default_file_read_at_start_gone_keeps_the_running_configuration(tmp_path, monkeypatch,
                                                                                              caplog):
    """`agentd speaker` without --config or $AGENTD_CONFIG reads the default file; gone for a
    moment at the SIGHUP (an editor's save, a config management run), the reload the CLI
    gives the speaker fails, and its peers (its whole job) and [log] stay: the defaults would
    de-configure every one."""
    import os

    conf = tmp_path / "agentd.toml"
    conf.write_text('[node]\nname = "rr"\naddress = "192.0.2.1"\n[log]\nlevel = "debug"\n'
                    f'[agent]\nstate_dir = "{tmp_path}"\n[bgp]\nlisten = ""\n'
                    '[[bgp.peers]]\naddress = "192.0.2.2"\nasn = 64513\n')
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}
    running, reload = _speaker_started_by_the_cli(monkeypatch, environ, conf)
    assert running.source == str(conf) and len(running.bgp.peers) == 1
    rt = SpeakerRuntime(running)
    applied = []
    rt.set_logging = lambda level, fmt: applied.append(level)

    async def main():
        rt.service._loop = asyncio.get_running_loop()
        rt.service.set_peers(peer_settings(p, running) for p in running.bgp.peers)
        before = dict(rt.speaker.peers)
        conf.unlink()
        with caplog.at_level(logging.INFO, logger="agentd.speaker"):
            rt._reload(reload)
        assert rt.speaker.peers == before and rt.cfg.bgp.peers == running.bgp.peers
        assert rt.cfg.log.level == "debug" and applied == []
        (error,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert "reload failed, keeping the running configuration" in error and "no such file" in error, error

    asyncio.run(main())


def test_a_default_file_missing_at_start_may_be_missing_at_a_reload_until_one_has_read_it(tmp_path, monkeypatch):
    """`agentd speaker` started without the default file (the environment configures it): a
    reload without the file is the environment again, as at start; once a reload has read it,
    the file is required as if read at start -- gone for a moment, the reload fails rather than
    fall back to the defaults (no peers), as the agent's does."""
    import os

    import pytest

    from agentd.config.model import ConfigError

    conf = tmp_path / "agentd.toml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}
    env.update({"AGENTD_NODE_NAME": "rr", "AGENTD_NODE_ADDRESS": "192.0.2.1",
                "AGENTD_AGENT_STATE_DIR": str(tmp_path), "AGENTD_BGP_LISTEN": ""})
    running, reload = _speaker_started_by_the_cli(monkeypatch, env, conf)
    assert running.source is None and running.bgp.peers == ()
    assert reload().bgp.peers == ()  # still no file: the environment, as at start
    conf.write_text('[bgp]\n[[bgp.peers]]\naddress = "192.0.2.2"\nasn = 64513\n')
    read = reload()
    assert read.source == str(conf) and len(read.bgp.peers) == 1
    conf.unlink()
    with pytest.raises(ConfigError, match="no such file"):
        reload()


class _Bfd:
    """The BFD sessions the service asks for (bgp.bfd_transport.BfdService's calls)."""

    def __init__(self) -> None:
        self.started = False
        self.sessions: dict[str, tuple] = {}

    def open(self, addresses=None) -> None:
        self.started = True

    def set_listen(self, addresses) -> None:
        pass

    def add(self, peer, local_address=None, settings=None) -> None:
        self.sessions[peer] = (local_address, settings)

    def remove(self, peer, *, drain=True) -> None:
        self.sessions.pop(peer, None)


def test_a_reload_re_tunes_bfd_without_resetting_a_session(tmp_path, caplog):
    """[bgp] bfd, bfd_interval and bfd_multiplier change with a reload (docs/bfd.md, as in
    BIRD): each neighbour inheriting them takes the new timers over in place -- the same BGP
    session, its BFD session re-tuned -- and no "applied only by a restart" warning.  They
    waited for a restart while the docs said a reload applied them."""
    running = config(tmp_path)
    rt = SpeakerRuntime(running)

    async def main():
        _serve_configured(rt, running)
        rt.service.bfd = bfd = _Bfd()  # (no socket opened, no packet sent)
        before = dict(rt.speaker.peers)
        assert [p.settings.bfd for p in before.values()] == [None, None]
        with caplog.at_level(logging.INFO, logger="agentd.speaker"):
            rt._reload(lambda: config(tmp_path, AGENTD_BGP_BFD="true", AGENTD_BGP_BFD_INTERVAL="0.1",
                                      AGENTD_BGP_BFD_MULTIPLIER="5"))
        assert {k: id(p) for k, p in rt.speaker.peers.items()} == {k: id(p) for k, p in before.items()}
        assert [p.settings.bfd for p in rt.speaker.peers.values()] == [(0.1, 5), (0.1, 5)]
        assert rt.speaker.listen_ranges[0].template.bfd == (0.1, 5)
        assert (rt.cfg.bgp.bfd, rt.cfg.bgp.bfd_interval, rt.cfg.bgp.bfd_multiplier) == (True, 0.1, 5)
        assert "applied only by a restart" not in caplog.text
        assert {peer: settings.desired_min_tx for peer, (_, settings) in bfd.sessions.items()} == {
            "192.0.2.2": 0.1, "192.0.2.3": 0.1}

    asyncio.run(main())
