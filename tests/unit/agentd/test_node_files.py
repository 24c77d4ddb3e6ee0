"""The files the agent keeps about this node's subnets (agentd/daemon/node_files.py): the
subnet file in /run, which a reboot empties, and the record in ``[agent] state_dir`` that
outlives it; what a restarted agent takes for the subnet it had."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from ipaddress import IPv4Address, IPv4Network, IPv6Network

import pytest
from agent_config import agent_cfg

from agentd.cni import endpoints
from agentd.cni.netconf import read_subnet_file
from agentd.daemon import node_files
from agentd.daemon.agent import Agent
from agentd.datastore.records import ClusterConfig, SubnetLease

CLUSTER = ClusterConfig(IPv4Network("10.244.0.0/16"), 24, "host-gw", "always")
S = IPv4Network("10.244.3.0/24")


def _lease(subnet=S) -> SubnetLease:
    return SubnetLease(subnet, "n1", IPv4Address("10.1.1.1"), "host-gw")


def test_the_subnet_survives_a_reboot_that_empties_run(tmp_path):
    """The subnet file is in /run (a tmpfs): after a reboot only the record in state_dir says
    which subnet the node had; it used to be {} there, and the node took a random subnet."""
    cfg = agent_cfg(tmp_path, **{"cni.write_conflist": False})
    node_files.write_cni_files(cfg, CLUSTER, {4: _lease()}, 1450)
    assert node_files.previous_subnets(cfg) == {4: S}
    os.unlink(cfg.cni.subnet_file)  # the reboot
    assert node_files.previous_subnets(cfg) == {4: S}
    record = tmp_path / "state" / node_files.KEPT_FILE
    assert json.loads(record.read_text()) == {"subnets": [str(S)]}
    assert sorted(p.name for p in record.parent.iterdir()) == [node_files.KEPT_FILE]  # no temporary file left


def test_the_subnet_file_wins_over_the_record_and_both_families_are_kept(tmp_path):
    cfg = agent_cfg(tmp_path)
    v6 = IPv6Network("fd00:10:244:3::/64")
    node_files.keep_subnets(cfg, {6: v6, 4: S})
    assert json.loads(node_files.kept_subnets_path(cfg).read_text()) == {"subnets": [str(S), str(v6)]}
    assert node_files.previous_subnets(cfg) == {4: S, 6: v6}
    other = IPv4Network("10.244.9.0/24")
    node_files.write_cni_files(agent_cfg(tmp_path, **{"cni.write_conflist": False, "agent.state_dir": str(tmp_path / "x")}),
                               CLUSTER, {4: _lease(other)}, 1450)  # the subnet file (pods' addresses) names another
    assert node_files.previous_subnets(cfg) == {4: other}


@pytest.mark.parametrize("text", ["{", "[]", '{"subnets": "10.244.3.0/24"}', '{"subnets": ["10.244.3.0/33"]}',
                                  '{"subnets": ["10.244.3.0/24", "10.244.4.0/24"]}', '{"other": 1}'])
def test_a_record_that_cannot_be_read_is_ignored_saying_so(tmp_path, caplog, text):
    cfg = agent_cfg(tmp_path)
    path = node_files.kept_subnets_path(cfg)
    path.parent.mkdir()
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="agentd"):
        assert node_files.previous_subnets(cfg) == {}
    assert f"ignoring {path}" in caplog.text


def test_an_unwritable_record_is_a_warning_and_the_subnet_file_is_written(tmp_path, caplog):
    cfg = agent_cfg(tmp_path, **{"cni.write_conflist": False})
    (tmp_path / "state").write_text("not a directory")
    node_files.write_cni_files(cfg, CLUSTER, {4: _lease()}, 1450)
    assert read_subnet_file(cfg.cni.subnet_file).subnet == S
    assert "after a reboot this node may get another subnet" in caplog.text


def test_the_subnet_file_says_how_the_agent_runs_and_agentd_cni_still_reads_it(tmp_path):
    """`agentd docker-opts` in docker.service's ExecStartPre= does not see the agent's
    environment (AGENTD_CNI_WRITE_CONFLIST=false in its unit): the subnet file says it."""
    for conflist, masq in ((False, True), (True, False)):
        cfg = agent_cfg(tmp_path, **{"cni.write_conflist": conflist, "network.ip_masq": masq})
        node_files.write_cni_files(cfg, CLUSTER, {4: _lease()}, 1450)
        lines = (tmp_path / "subnet.env").read_text().splitlines()
        assert f"AGENTD_WRITE_CONFLIST={str(conflist).lower()}" in lines
        assert f"AGENTD_MASQUERADE={str(masq).lower()}" in lines
        assert read_subnet_file(cfg.cni.subnet_file).subnet == S  # what agentd-cni reads


def test_the_plugins_directories_are_the_agents_and_made_before_the_subnet_file(tmp_path, monkeypatch):
    """Review r12: nothing made [cni] data_dir before the subnet file let ADD through, so the
    first ADD made it and its endpoints/ root's (the plugin runs as root): an agent of its own
    user could not acknowledge a pod there nor open the lock.  The agent makes them first, its
    own, 0755 whatever its umask."""
    import stat

    from agentd.cni import endpoints

    cfg = agent_cfg(tmp_path, **{"cni.write_conflist": False, "cni.data_dir": str(tmp_path / "lib" / "cni")})
    directories = [tmp_path / "lib" / "cni", tmp_path / "lib" / "cni" / endpoints.SUBDIR,
                   tmp_path / "lib" / "cni" / endpoints.SUBDIR / endpoints.PROGRAMMED]  # fmt: skip
    written = node_files.cni_config.atomic_write
    seen = []

    def atomic_write(path, text, mode):
        if path == str(cfg.cni.subnet_file):
            seen.append([d.is_dir() for d in directories])
        return written(path, text, mode=mode)

    monkeypatch.setattr(node_files.cni_config, "atomic_write", atomic_write)
    umask = os.umask(0o077)
    try:
        node_files.write_cni_files(cfg, CLUSTER, {4: _lease()}, 1450)
    finally:
        os.umask(umask)
    assert seen == [[True, True, True]]
    for d in directories:
        st = d.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), 0o755), d
    node_files.write_cni_files(cfg, CLUSTER, {4: _lease()}, 1450)  # there already: left as they are


def test_a_data_dir_that_cannot_be_made_is_logged_and_the_subnet_file_written(tmp_path, caplog):
    (tmp_path / "lib").write_text("not a directory")
    cfg = agent_cfg(tmp_path, **{"cni.write_conflist": False, "cni.data_dir": str(tmp_path / "lib" / "cni")})
    with caplog.at_level(logging.ERROR, logger="agentd"):
        node_files.write_cni_files(cfg, CLUSTER, {4: _lease()}, 1450)
    assert read_subnet_file(cfg.cni.subnet_file).subnet == S
    assert f"cannot make {tmp_path / 'lib' / 'cni'} (Not a directory)" in caplog.text
    assert f"make {tmp_path / 'lib' / 'cni' / endpoints.SUBDIR} the agent's user's" in caplog.text
    assert f"not {tmp_path / 'lib' / 'cni' / '.state'}, which only root may write" in caplog.text


def test_a_symlink_at_endpoints_is_logged_and_the_agent_makes_nothing_root_acts_on(tmp_path, caplog):
    """The agent makes data_dir, endpoints/ and .programmed, never the plugin's state directory
    (root's alone); an endpoints/ that is a symlink (which agentd-cni refuses) is logged."""
    cfg = agent_cfg(tmp_path, **{"cni.write_conflist": False, "cni.data_dir": str(tmp_path / "cni")})
    node_files.write_cni_files(cfg, CLUSTER, {4: _lease()}, 1450)
    assert sorted(os.listdir(tmp_path / "cni")) == [endpoints.SUBDIR]
    os.rename(tmp_path / "cni" / endpoints.SUBDIR, tmp_path / "elsewhere")
    (tmp_path / "cni" / endpoints.SUBDIR).symlink_to(tmp_path / "elsewhere")
    with caplog.at_level(logging.ERROR, logger="agentd"):
        node_files.write_cni_files(cfg, CLUSTER, {4: _lease()}, 1450)
    assert f"cannot make {tmp_path / 'cni' / endpoints.SUBDIR} (a symlink or no directory: refused)" in caplog.text


class _Datastore:
    async def remove_node(self, name, timeout=None):
        return True

    async def close(self):
        pass


def test_a_lost_subnet_is_remembered_for_the_next_starts_warning(tmp_path):
    """An agent whose subnet another node took stops and removes the subnet file; the next
    start found no previous subnet, took another without the documented warning "this node's
    subnet changed from X to Y".  The record in state_dir names the lost subnet now."""
    cfg = agent_cfg(tmp_path)
    lost = IPv4Network("10.244.7.0/24")

    async def main():
        agent = Agent(cfg)
        agent.datastore = _Datastore()
        agent._subnet_lost(_lease(lost))
        await agent._shutdown()
        return agent.exit_status

    assert asyncio.run(main()) == 1
    assert not os.path.exists(cfg.cni.subnet_file)
    assert node_files.previous_subnets(cfg) == {4: lost}


# ------------------------------------------------------------------ the conflist at leave


def _agentds(cfg, **changed) -> dict:
    from agentd.cni import netconf

    return netconf.conflist(mtu=1450, **{**node_files._conflist_settings(cfg), **changed})


def _conflist_path(cfg):
    from agentd.cni import netconf

    cfg.cni.conf_dir.mkdir(parents=True, exist_ok=True)
    return cfg.cni.conf_dir / netconf.CONFLIST_NAME


def _older_layout(doc: dict) -> dict:
    """As an agentd before 29c8a8b (no bandwidth plugin) and 1f570b7 (no binDir) wrote it."""
    doc["plugins"] = doc["plugins"][:2]
    doc["plugins"][0].pop("binDir", None)
    doc["plugins"][0].pop("capabilities", None)  # (none declared before review s57/r4)
    return doc


def test_the_conflist_the_agent_writes_declares_what_agentd_cni_reads_of_runtime_config(tmp_path):
    """A runtime (libcni's injectRuntimeConfig) hands a plugin only the capability arguments its
    conflist entry declares: agentd-cni's declares the runtimeConfig keys it reads, the
    chained plugins theirs."""
    cfg = agent_cfg(tmp_path, **{"cni.write_conflist": "true"})
    node_files.write_cni_files(cfg, CLUSTER, {4: _lease()}, 1450)
    doc = json.loads(_conflist_path(cfg).read_text())
    assert [(p["type"], p.get("capabilities")) for p in doc["plugins"]] == [
        ("agentd-cni", {"labels": True, "containerPorts": True, "mac": True}),
        ("portmap", {"portMappings": True}),
        ("bandwidth", {"bandwidth": True}),
    ]


@pytest.mark.parametrize("variant", ["this version", "older layout", "other data_dir", "other subnet_file",
                                     "other bin_dir", "no mtu"])
def test_a_leave_removes_agentds_conflist_whichever_version_or_settings_wrote_it(tmp_path, variant):
    """After an upgrade where the agent does not come back, the runtime kept choosing agentd's
    network (10-agentd.conflist) and every ADD failed: a file an older agentd wrote, or one
    written under other [cni] paths, was taken for an operator's and left."""
    cfg = agent_cfg(tmp_path, **{"cni.write_conflist": "true"})
    doc = {"this version": lambda: _agentds(cfg),
           "older layout": lambda: _older_layout(_agentds(cfg)),
           "other data_dir": lambda: _agentds(cfg, data_dir="/var/lib/agentd-old/cni"),
           "other subnet_file": lambda: _agentds(cfg, subnet_file="/run/flannel-ish/subnet.env"),
           "other bin_dir": lambda: _agentds(cfg, bin_dir=["/usr/libexec/cni"]),
           "no mtu": lambda: {**_agentds(cfg), "plugins": [
               {k: v for k, v in _agentds(cfg)["plugins"][0].items() if k != "delegate"}]}}[variant]()
    path = _conflist_path(cfg)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    assert node_files.remove_conflist(cfg) is True
    assert not os.path.exists(path)
    assert node_files.remove_conflist(cfg) is False  # none left


@pytest.mark.parametrize("text", [
    json.dumps({"cniVersion": "1.0.0", "name": "mine", "plugins": [{"type": "bridge", "bridge": "br0"}]}),
    # agentd-cni chained after an operator's own first plugin: the operator's network
    json.dumps({"cniVersion": "1.0.0", "name": "mine", "plugins": [
        {"type": "bridge"}, {"type": "agentd-cni", "subnetFile": "/run/agentd/subnet.env", "dataDir": "/x"}]}),
    json.dumps({"cniVersion": "1.0.0", "name": "mine", "plugins": [{"type": "agentd-cni"}]}),  # no agentd keys
    json.dumps({"cniVersion": "1.0.0", "name": "mine", "plugins": []}),
    json.dumps({"cniVersion": "1.0.0", "name": "mine", "type": "agentd-cni", "subnetFile": "/s", "dataDir": "/d"}),
    json.dumps(["plugins"]),
    "{not json",
])
def test_a_leave_keeps_an_operators_file_of_that_name(tmp_path, text):
    cfg = agent_cfg(tmp_path, **{"cni.write_conflist": "true"})
    path = _conflist_path(cfg)
    with open(path, "w") as f:
        f.write(text)
    with pytest.raises(ValueError, match="is not one agentd writes.*left as it is"):
        node_files.remove_conflist(cfg)
    with open(path) as f:
        assert f.read() == text


# ------------------------------------------------------------------ the runtime's plugins


def _plugins(directory, *names, mode=0o755):
    directory.mkdir(exist_ok=True)
    for name in names:
        (directory / name).write_text("#!/bin/sh\n")
        (directory / name).chmod(mode)
    return str(directory)


def test_the_start_warns_when_no_bin_dir_holds_every_plugin_of_the_conflist(tmp_path, caplog):
    """The runtime runs agentd-cni, portmap and bandwidth from its own CNI bin directory (the
    conflist's binDir is agentd-cni's delegates' only): an install that put agentd-cni in
    /opt/cni/bin and left Debian's portmap and bandwidth in /usr/lib/cni failed every ADD, and
    nothing said so.  The agent says, in one line, what each directory lacks."""
    opt = _plugins(tmp_path / "opt", "agentd-cni", "bridge")
    lib = _plugins(tmp_path / "lib", "portmap", "bandwidth", "bridge", "host-local")
    _plugins(tmp_path / "lib", "agentd-cni", mode=0o644)  # not executable: not found either
    cfg = agent_cfg(tmp_path, **{"cni.bin_dir": f"{opt}:{lib}:{tmp_path / 'none'}"})
    with caplog.at_level(logging.WARNING, logger="agentd"):
        node_files.write_cni_files(cfg, CLUSTER, {4: _lease()}, 1450)
    assert (tmp_path / "net.d" / "10-agentd.conflist").exists()  # never fatal
    (line,) = [r.getMessage() for r in caplog.records if "bin_dir" in r.getMessage()]
    assert (f"({opt} lacks portmap, bandwidth; {lib} lacks agentd-cni; {tmp_path / 'none'} lacks agentd-cni, "
            "portmap, bandwidth)") in line
    assert node_files.runtime_plugins() == ("agentd-cni", "portmap", "bandwidth")


def test_no_warning_where_one_bin_dir_holds_them_all_or_no_conflist_is_written(tmp_path, caplog):
    lib = _plugins(tmp_path / "lib", "portmap", "bandwidth")
    opt = _plugins(tmp_path / "opt", "agentd-cni", "portmap", "bandwidth")
    with caplog.at_level(logging.WARNING, logger="agentd"):
        node_files.write_cni_files(agent_cfg(tmp_path, **{"cni.bin_dir": f"{lib}:{opt}"}), CLUSTER, {4: _lease()}, 1450)
        node_files.write_cni_files(agent_cfg(tmp_path, **{"cni.bin_dir": lib, "cni.write_conflist": False}),
                                   CLUSTER, {4: _lease()}, 1450)  # a Docker host: no CNI pods
    assert "bin_dir" not in caplog.text
