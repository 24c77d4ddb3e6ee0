"""agentd-cni's input checking, the delegate config it builds, and the files the agent writes.

Pure: no plugin is executed (every case here fails or finishes before the delegate would run),
no root, no network.  The real plugins are exercised in tests/system/test_cni.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
from ipaddress import IPv4Address, IPv4Network, IPv6Network

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentd.cni import plugin as cni

from agentd.cni import netconf as cni_config
from agentd.cni.netconf import SubnetFile, SubnetFileError

SF = SubnetFile(network=IPv4Network("10.244.0.0/16"), subnet=IPv4Network("10.244.3.0/24"), mtu=1450)


def _env(command: str = "ADD", **overrides: str | None) -> dict[str, str]:
    env = {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": "c0ffee01",
        "CNI_NETNS": "/proc/self/ns/net",  # must exist: ADD and CHECK refuse a missing netns
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/nonexistent/cni",
    }
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _conf(tmp_path, **overrides) -> dict:
    conf = {
        "cniVersion": "1.0.0",
        "name": "agentd",
        "type": "agentd-cni",
        "subnetFile": str(tmp_path / "subnet.env"),
        "dataDir": str(tmp_path / "state"),
        "ipam": {"dataDir": str(tmp_path / "ipam")},
        "delegate": {"bridge": "cni0", "hairpinMode": True, "isDefaultGateway": True},
    }
    for key, value in overrides.items():
        if value is None:
            conf.pop(key, None)
        else:
            conf[key] = value
    return conf


def _run(env: dict[str, str], stdin: bytes | dict) -> tuple[int, dict | None]:
    if isinstance(stdin, dict):
        stdin = json.dumps(stdin).encode()
    return cni.handle(env, stdin)


def _assert_error(outcome: tuple[int, dict | None], code: int, *words: str, version: str = "1.0.0") -> dict:
    exit_code, out = outcome
    assert exit_code != 0
    assert out is not None
    assert out["code"] == code, out
    assert out["cniVersion"] == version
    assert "\n" not in out["msg"] and out["msg"], out
    assert "Traceback" not in json.dumps(out)
    for word in words:
        assert word in out["msg"] + " " + out["details"], out
    return out


# --- VERSION and the environment ------------------------------------------------------------


@pytest.mark.parametrize("stdin", [b"", b'{"cniVersion": "0.4.0"}', b"garbage"])
def test_version_prints_supported_versions(stdin):
    assert _run({"CNI_COMMAND": "VERSION"}, stdin) == (
        0,
        {"cniVersion": "1.0.0", "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0"]},
    )


def test_missing_command(tmp_path):
    _assert_error(_run(_env(CNI_COMMAND=None), _conf(tmp_path)), 4, "CNI_COMMAND")


def test_unknown_command(tmp_path):
    _assert_error(_run(_env("GC"), _conf(tmp_path)), 4, "'GC'")


@pytest.mark.parametrize("command", ["ADD", "DEL", "CHECK"])
@pytest.mark.parametrize("var", ["CNI_CONTAINERID", "CNI_IFNAME", "CNI_PATH"])
def test_missing_required_variable(tmp_path, command, var):
    _assert_error(_run(_env(command, **{var: None}), _conf(tmp_path)), 4, var)


@pytest.mark.parametrize("command", ["ADD", "CHECK"])
def test_missing_netns(tmp_path, command):
    _assert_error(_run(_env(command, CNI_NETNS=None), _conf(tmp_path)), 4, "CNI_NETNS")


def test_del_needs_no_netns_and_succeeds_with_nothing_to_undo(tmp_path):
    # No stored config and no subnet file: nothing was ever set up here, so DEL is a success.
    assert _run(_env("DEL", CNI_NETNS=None), _conf(tmp_path)) == (0, None)


# "abc\n": Python's "$" also matches before a final newline; libcni's Go regexp does not.
@pytest.mark.parametrize("container_id", ["../etc", "a/b", "-x", ".hidden", "a b", "ü", "abc\n"])
def test_bad_container_id(tmp_path, container_id):
    _assert_error(_run(_env(CNI_CONTAINERID=container_id), _conf(tmp_path)), 4, "CNI_CONTAINERID")


@pytest.mark.parametrize("ifname", ["x" * 16, ".", "..", "a/b", "a:b", "a b", "a\tb"])
def test_bad_ifname(tmp_path, ifname):
    _assert_error(_run(_env(CNI_IFNAME=ifname), _conf(tmp_path)), 4, "CNI_IFNAME")


def test_longest_ifname_is_accepted(tmp_path):
    # 15 characters is the kernel's limit; the request gets past the environment checks
    # (and stops at the missing subnet file).
    _assert_error(_run(_env(CNI_IFNAME="x" * 15), _conf(tmp_path)), 11)


# --- decoding and the network config ---------------------------------------------------------


@pytest.mark.parametrize("stdin", [b"", b"  \n", b"{not json", b"\xff\xfe", b"[1, 2]", b'"x"', b"null"])
def test_undecodable_stdin(stdin):
    _assert_error(_run(_env(), stdin), 6)


def test_missing_cni_version(tmp_path):
    _assert_error(_run(_env(), _conf(tmp_path, cniVersion=None)), 1, "cniVersion")


@pytest.mark.parametrize("version", ["0.1.0", "0.2.0", "2.0.0", "1.0"])
def test_unsupported_cni_version(tmp_path, version):
    out = _assert_error(_run(_env(), _conf(tmp_path, cniVersion=version)), 1, "incompatible", version)
    assert "1.0.0" in out["details"]


def test_error_result_carries_request_version(tmp_path):
    _assert_error(_run(_env(CNI_IFNAME="a/b"), _conf(tmp_path, cniVersion="0.3.1")), 4, version="0.3.1")


@pytest.mark.parametrize(
    ("overrides", "word"),
    [
        ({"cniVersion": 1}, "cniVersion"),
        ({"name": None}, "name"),
        ({"name": 7}, "name"),
        ({"name": "bad name"}, "network name"),
        ({"name": "agentd\n"}, "network name"),
        ({"type": 3}, "type"),
        ({"subnetFile": ""}, "subnetFile"),
        ({"subnetFile": 5}, "subnetFile"),
        ({"dataDir": ["x"]}, "dataDir"),
        ({"dataDir": "\x00"}, "'dataDir' must be an absolute path, not '\\x00'"),
        ({"dataDir": "/var/lib/agentd\x00/cni"}, "dataDir"),
        ({"subnetFile": "/run/agentd/subnet.env\x00"}, "subnetFile"),
        ({"dataDir": "state"}, "'dataDir' must be an absolute path, not 'state'"),
        ({"subnetFile": "run/subnet.env"}, "subnetFile"),
        ({"binDir": ["/opt/cni\x00/bin"]}, "binDir"),
        ({"delegate": "bridge"}, "delegate"),
        ({"delegate": {"type": 5}}, "delegate.type"),
        ({"delegate": {"type": "../../bin/sh"}}, "delegate.type"),
        ({"delegate": {"name": "other"}}, "name"),
        ({"delegate": {"ipam": {"type": "host-local"}}}, "ipam"),
        ({"ipam": []}, "ipam"),
        ({"ipam": {"subnet": "10.0.0.0/24"}}, "ipam.subnet"),
        ({"ipam": {"ranges": []}}, "ipam.ranges"),
        ({"ipam": {"type": "a/b"}}, "ipam.type"),
        ({"ipam": {"routes": {"dst": "0.0.0.0/0"}}}, "ipam.routes"),
        ({"ipam": {"routes": [{"gw": "10.0.0.1"}]}}, "ipam.routes"),
        ({"delegateTimeout": 0}, "delegateTimeout"),
        ({"delegateTimeout": "60"}, "delegateTimeout"),
        ({"delegateTimeout": True}, "delegateTimeout"),
        ({"prevResult": []}, "prevResult"),
    ],
)
def test_invalid_network_config(tmp_path, overrides, word):
    _assert_error(_run(_env(), _conf(tmp_path, **overrides)), 7, word)


# --- the subnet file as seen by ADD ------------------------------------------------------------


def test_add_before_subnet_file_exists_is_try_again_later(tmp_path):
    out = _assert_error(_run(_env(), _conf(tmp_path)), 11, "subnet.env")
    assert "agentd" in out["details"]
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize(
    ("text", "word"),
    [
        ("garbage\n", "KEY=value"),
        ("AGENTD_NETWORK=10.244.0.0/16\nAGENTD_MTU=1450\n", "AGENTD_SUBNET"),
        ("AGENTD_NETWORK=10.244.0.0/16\nAGENTD_SUBNET=10.245.3.1/24\nAGENTD_MTU=1450\n", "not inside"),
        ("AGENTD_NETWORK=10.244.0.0/16\nAGENTD_SUBNET=10.244.3.1/24\nAGENTD_MTU=big\n", "AGENTD_MTU"),
    ],
)
def test_add_with_bad_subnet_file_is_invalid_config(tmp_path, text, word):
    (tmp_path / "subnet.env").write_text(text)
    _assert_error(_run(_env(), _conf(tmp_path)), 7, word, str(tmp_path / "subnet.env"))


def test_add_with_unwritable_data_dir_is_io_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(cni, "find_plugin", lambda plugin_type, path: "/fake/" + plugin_type)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    (tmp_path / "file").write_text("")
    _assert_error(_run(_env(), _conf(tmp_path, dataDir=str(tmp_path / "file" / "state"))), 5, "delegate config")


def test_add_stores_delegate_config_before_running_delegate(tmp_path, monkeypatch):
    # The delegate fails: what ADD ran is stored, so the runtime's clean-up DEL uses it.
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    conf = _conf(tmp_path)
    seen = []

    def invoke(conf, args, env, timeout):
        seen.append(cni.load_state(str(tmp_path / "state"), args.container_id))
        raise cni.CniError(11, "boom")

    monkeypatch.setattr(cni, "find_plugin", lambda plugin_type, path: "/fake/" + plugin_type)
    monkeypatch.setattr(cni, "invoke_delegate", invoke)
    _assert_error(_run(_env(), conf), 11, "boom")
    assert seen == [cni_config.delegate_config(conf, SF)]
    stored = json.loads((tmp_path / "state" / cni.STATE_SUBDIR / "c0ffee01").read_text())
    assert stored == dict(cni_config.delegate_config(conf, SF), agentdIfname="eth0")
    assert cni.load_state(str(tmp_path / "state"), "c0ffee01") == cni_config.delegate_config(conf, SF)


def test_add_without_the_delegate_stores_nothing_and_its_del_succeeds(tmp_path, capsys):
    """CNI_PATH has no bridge plugin: ADD fails before it stores anything (nothing ran), and the
    runtime's clean-up DEL -- like the DEL of a container never added -- has nothing to undo:
    it succeeds with one warning, instead of failing for ever on the missing delegate."""
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    conf = _conf(tmp_path)
    empty = str(tmp_path / "empty")
    _assert_error(_run(_env(CNI_PATH=empty), conf), 999, "'bridge'", "not found")
    assert not (tmp_path / "state" / "c0ffee01").exists()
    capsys.readouterr()
    for cid in ("c0ffee01", "never"):
        assert _run(_env("DEL", CNI_CONTAINERID=cid, CNI_PATH=empty, CNI_NETNS=None), conf) == (0, None)
        warning = capsys.readouterr().err.splitlines()
        assert len(warning) == 1 and "'bridge'" in warning[0] and "nothing to undo" in warning[0], warning


def test_del_with_a_stored_config_and_no_delegate_still_fails(tmp_path):
    # Something may be left to undo: the runtime must retry once the delegate is back.
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    conf = _conf(tmp_path)
    cni.save_state(str(tmp_path / "state"), "c0ffee01", cni_config.delegate_config(conf, SF), "eth0")
    _assert_error(_run(_env("DEL", CNI_PATH=str(tmp_path / "empty")), conf), 999, "'bridge'", "not found")
    assert cni.load_state(str(tmp_path / "state"), "c0ffee01") == cni_config.delegate_config(conf, SF)


def test_a_second_agentd_interface_is_refused_and_its_del_leaves_the_first(tmp_path):
    # Multus attaching agentd twice: the state is the container's, so the second ADD is refused
    # (before the delegate would run) and the runtime's clean-up DEL for it undoes nothing.
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    conf = _conf(tmp_path)
    state = tmp_path / "state" / cni.STATE_SUBDIR / "c0ffee01"
    cni.save_state(str(tmp_path / "state"), "c0ffee01", cni_config.delegate_config(conf, SF), "eth0")
    before = state.read_text()
    _assert_error(_run(_env(CNI_IFNAME="net1"), conf), 7, "already has an agentd interface (eth0)", "net1")
    assert _run(_env("DEL", CNI_IFNAME="net1"), conf) == (0, None)
    assert state.read_text() == before
    prev = {"cniVersion": "1.0.0", "ips": [{"address": "10.244.3.7/24"}]}
    _assert_error(_run(_env("CHECK", CNI_IFNAME="net1"), _conf(tmp_path, prevResult=prev)), 3, "net1")


def _recording_delegate(monkeypatch, calls):
    """A fake delegate recording (command, CNI_IFNAME, the config it was given)."""
    def invoke(conf, args, env, timeout):
        calls.append((args.command, args.ifname, conf))

    monkeypatch.setattr(cni, "invoke_delegate", invoke)
    monkeypatch.setattr(cni, "find_plugin", lambda plugin_type, path: "/fake/" + plugin_type)


def _old_endpoint_file(tmp_path, ifname="eth0"):
    from agentd.cni import endpoints as eps

    eps.write(str(tmp_path / "state"), eps.Endpoint(
        container_id="c0ffee01", namespace="ns", name="web", labels={}, ports=[], ips=["10.244.3.7"],
        interface="veth1", mac="aa:bb:cc:dd:ee:ff", bridge="cni0", ifname=ifname))  # fmt: skip


SF_NOW = dataclasses.replace(SF, subnet=IPv4Network("10.244.4.0/24"))  # the node's subnet since


@pytest.mark.parametrize("endpoint_file", [False, True])
def test_a_config_stored_before_the_ifname_was_kept_still_serves(tmp_path, monkeypatch, endpoint_file):
    """An older agentd-cni stored eth0's config without its CNI_IFNAME.  An ADD for another
    interface (Multus attaching agentd twice) is refused as for a known eth0 -- overwriting the
    state would leave eth0's DEL with nothing to undo (its host-local lease leaked) -- and eth0's
    DEL still undoes with the stored config.  With the older plugin's endpoint file (which names
    the interface) the refused ADD's clean-up DEL leaves eth0's state alone, too."""
    calls = []
    _recording_delegate(monkeypatch, calls)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    conf = _conf(tmp_path, policyTimeout=0)
    stored = cni_config.delegate_config(conf, SF)
    state = tmp_path / "state" / "c0ffee01"
    (tmp_path / "state").mkdir()
    state.write_text(json.dumps(stored))
    if endpoint_file:
        _old_endpoint_file(tmp_path)
    assert cni.stored_ifname(str(tmp_path / "state"), "c0ffee01") is None
    assert cni.load_state(str(tmp_path / "state"), "c0ffee01") == stored
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF_NOW)  # the current config differs
    assert cni_config.delegate_config(conf, SF_NOW) != stored
    before = state.read_text()

    out = _assert_error(_run(_env(CNI_IFNAME="eth1"), conf), 7, "already has an agentd interface", "eth1")
    assert ("(eth0)" in out["msg"]) == endpoint_file
    assert state.read_text() == before and calls == []
    if endpoint_file:
        assert _run(_env("DEL", CNI_IFNAME="eth1"), conf) == (0, None)  # the refused ADD's clean-up
        assert state.read_text() == before and calls == []
        assert (tmp_path / "state" / "endpoints" / "c0ffee01.json").exists()
    assert _run(_env("DEL", CNI_IFNAME="eth0"), conf) == (0, None)
    assert calls == [("DEL", "eth0", stored)]
    assert not state.exists() and not (tmp_path / "state" / "endpoints" / "c0ffee01.json").exists()


@pytest.mark.parametrize("text", ["", "{"])
@pytest.mark.parametrize("endpoint_file", [False, True])
def test_a_damaged_state_file_refuses_another_interface_and_its_del_still_releases(
        tmp_path, monkeypatch, text, endpoint_file):
    """A damaged state file names no interface and no config.  An ADD for another interface is
    refused (the file may be eth0's).  DEL keeps the power to release eth0's lease: eth0's DEL
    runs the delegate with the current config (host-local's lease is keyed by container and
    interface, not by the config) and then removes the file.  With the endpoint file naming
    eth0, the refused ADD's clean-up DEL leaves the file to eth0's DEL; without one it cannot tell,
    takes the file as its own (running the delegate for eth1, which undoes nothing of eth0's),
    and eth0's DEL, finding nothing stored, still runs the delegate with the current config."""
    calls = []
    _recording_delegate(monkeypatch, calls)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    conf = _conf(tmp_path, policyTimeout=0)
    current = cni_config.delegate_config(conf, SF)
    state = tmp_path / "state" / "c0ffee01"
    (tmp_path / "state").mkdir()
    state.write_text(text)
    if endpoint_file:
        _old_endpoint_file(tmp_path)

    _assert_error(_run(_env(CNI_IFNAME="eth1"), conf), 7, "already has an agentd interface", "eth1")
    assert state.read_text() == text and calls == []
    assert _run(_env("DEL", CNI_IFNAME="eth1"), conf) == (0, None)
    if endpoint_file:
        assert state.read_text() == text and calls == []
    else:
        assert not state.exists() and calls == [("DEL", "eth1", current)]
        calls.clear()
    assert _run(_env("DEL", CNI_IFNAME="eth0"), conf) == (0, None)
    assert calls == [("DEL", "eth0", current)]
    assert not state.exists() and not (tmp_path / "state" / "endpoints" / "c0ffee01.json").exists()


@pytest.mark.parametrize(
    ("address", "ok"),
    [("10.244.3.7/24", True), ("10.244.9.7/24", False), ("fd00::7/64", False)],
)
def test_check_wants_the_pods_addresses_inside_the_nodes_subnets_now(address, ok):
    ips = cni._result_addresses({"ips": [{"address": address}]})
    if ok:
        cni._check_in_subnets(ips, SF)
        return
    with pytest.raises(cni.CniError) as err:
        cni._check_in_subnets(ips, SF)
    assert "outside this node's" in err.value.msg and str(ips[0]) in err.value.msg


@pytest.mark.parametrize("result", [{}, {"ips": []}, {"ips": [{"address": "nonsense"}]}, {"ips": "10.0.0.1"}, []])
def test_check_refuses_a_prev_result_without_addresses(result):
    with pytest.raises(cni.CniError) as err:
        cni._result_addresses(result)
    assert err.value.code == 7 and "prevResult" in err.value.msg


def test_check_wants_the_endpoint_file_with_the_pods_addresses(tmp_path):
    from ipaddress import ip_address

    from agentd.cni import endpoints

    ips = [ip_address("10.244.3.7")]
    with pytest.raises(cni.CniError, match="missing or unreadable"):
        cni._check_endpoint(str(tmp_path), "c0ffee01", ips)
    ep = endpoints.Endpoint(container_id="c0ffee01", namespace="ns", name="web", labels={}, ports=[],
                            ips=["10.244.3.8"], interface="veth1", mac="aa:bb:cc:dd:ee:ff", bridge="cni0")
    endpoints.write(str(tmp_path), ep)
    with pytest.raises(cni.CniError, match="names 10.244.3.8, not the pod's 10.244.3.7"):
        cni._check_endpoint(str(tmp_path), "c0ffee01", ips)
    endpoints.write(str(tmp_path), dataclasses.replace(ep, ips=["10.244.3.7"]))
    cni._check_endpoint(str(tmp_path), "c0ffee01", ips)


# --- CHECK -----------------------------------------------------------------------------------


def test_check_needs_version_040(tmp_path):
    outcome = _run(_env("CHECK"), _conf(tmp_path, cniVersion="0.3.1", prevResult={}))
    _assert_error(outcome, 1, "CHECK", version="0.3.1")


def test_check_needs_prev_result(tmp_path):
    _assert_error(_run(_env("CHECK"), _conf(tmp_path)), 7, "prevResult")


def test_check_of_unknown_container(tmp_path):
    _assert_error(_run(_env("CHECK"), _conf(tmp_path, prevResult={"cniVersion": "1.0.0"})), 3, "c0ffee01")


# --- delegate_config -------------------------------------------------------------------------


def test_delegate_config_defaults_from_subnet_file():
    netconf = {"cniVersion": "0.4.0", "name": "podnet", "type": "agentd-cni"}
    assert cni_config.delegate_config(netconf, SF) == {
        "name": "podnet",
        "cniVersion": "0.4.0",
        "type": "bridge",
        "ipMasq": False,
        "mtu": 1450,
        "bridge": "cni0",
        "isGateway": True,
        "hairpinMode": True,
        "ipam": {
            "type": "host-local",
            "subnet": "10.244.3.0/24",
            "routes": [{"dst": "10.244.0.0/16", "gw": "10.244.3.1"}],
        },
    }


def test_delegate_settings_win_over_derived_ones():
    netconf = {
        "cniVersion": "1.0.0",
        "name": "podnet",
        "delegate": {"mtu": 1400, "ipMasq": True, "isGateway": False, "bridge": "br9", "hairpinMode": False,
                     "forceAddress": True},
    }
    d = cni_config.delegate_config(netconf, SF)
    assert (d["mtu"], d["ipMasq"], d["isGateway"], d["bridge"], d["hairpinMode"], d["forceAddress"]) == (
        1400, True, False, "br9", False, True
    )


def test_name_and_version_always_come_from_the_network_config():
    netconf = {"cniVersion": "0.3.1", "name": "podnet", "delegate": {"name": "x", "cniVersion": "9.9.9"}}
    d = cni_config.delegate_config(netconf, SF)
    assert (d["name"], d["cniVersion"]) == ("podnet", "0.3.1")


def test_non_bridge_delegate_gets_no_bridge_settings():
    netconf = {"cniVersion": "1.0.0", "name": "n", "delegate": {"type": "ipvlan", "master": "eth0"}}
    d = cni_config.delegate_config(netconf, SF)
    assert d["type"] == "ipvlan" and d["master"] == "eth0"
    assert not {"bridge", "isGateway", "hairpinMode"} & set(d)
    assert d["mtu"] == 1450 and d["ipam"]["subnet"] == "10.244.3.0/24"


def test_ipam_settings_are_merged_and_cluster_route_appended():
    netconf = {
        "cniVersion": "1.0.0",
        "name": "n",
        "ipam": {"type": "my-ipam", "dataDir": "/x/ipam", "routes": [{"dst": "192.0.2.0/24"}]},
    }
    assert cni_config.delegate_config(netconf, SF)["ipam"] == {
        "type": "my-ipam",
        "dataDir": "/x/ipam",
        "subnet": "10.244.3.0/24",
        "routes": [{"dst": "192.0.2.0/24"}, {"dst": "10.244.0.0/16", "gw": "10.244.3.1"}],
    }


def test_ipmasq_from_subnet_file_and_runtime_config_copied():
    sf = SubnetFile(network=SF.network, subnet=SF.subnet, mtu=1500, ipmasq=True)
    netconf = {"cniVersion": "1.0.0", "name": "n", "runtimeConfig": {"portMappings": []}}
    d = cni_config.delegate_config(netconf, sf)
    assert d["ipMasq"] is True and d["mtu"] == 1500
    assert d["runtimeConfig"] == {"portMappings": []}


def test_delegate_config_does_not_modify_the_network_config():
    netconf = {
        "cniVersion": "1.0.0",
        "name": "n",
        "delegate": {"mtu": 9000},
        "ipam": {"routes": [{"dst": "192.0.2.0/24"}]},
    }
    before = json.dumps(netconf, sort_keys=True)
    cni_config.delegate_config(netconf, SF)
    assert json.dumps(netconf, sort_keys=True) == before


# --- the subnet file -------------------------------------------------------------------------


def test_subnet_file_is_written_like_flannels(tmp_path):
    path = tmp_path / "run" / "subnet.env"
    sf = SubnetFile(network=SF.network, subnet=SF.subnet, mtu=1450, ipmasq=False, backend="vxlan")
    cni_config.write_subnet_file(str(path), sf)
    assert path.read_text() == (
        "AGENTD_NETWORK=10.244.0.0/16\n"
        "AGENTD_SUBNET=10.244.3.1/24\n"
        "AGENTD_MTU=1450\n"
        "AGENTD_IPMASQ=false\n"
        "AGENTD_BACKEND=vxlan\n"
    )
    assert cni_config.read_subnet_file(str(path)) == sf
    assert os.listdir(path.parent) == ["subnet.env"]  # no temp file left behind


def test_subnet_file_is_replaced_atomically(tmp_path):
    path = str(tmp_path / "subnet.env")
    cni_config.write_subnet_file(path, SF)
    inode = os.stat(path).st_ino
    new = SubnetFile(network=SF.network, subnet=IPv4Network("10.244.9.0/24"), mtu=1400, ipmasq=True)
    cni_config.write_subnet_file(path, new)
    assert cni_config.read_subnet_file(path) == new
    assert os.stat(path).st_ino != inode  # renamed over, never rewritten in place
    assert os.listdir(tmp_path) == ["subnet.env"]


def test_subnet_file_reader_is_lenient_where_flannels_is():
    text = (
        "# written by agentd\n\n"
        "AGENTD_NETWORK=10.244.0.0/16\nAGENTD_SUBNET=10.244.3.0/24\nAGENTD_MTU=1450\nAGENTD_NEW_KEY=1\n"
    )
    assert cni_config.parse_subnet_file(text) == SubnetFile(SF.network, SF.subnet, 1450, False, "host-gw")


_GOOD = {"AGENTD_NETWORK": "10.244.0.0/16", "AGENTD_SUBNET": "10.244.3.1/24", "AGENTD_MTU": "1450"}


@pytest.mark.parametrize(
    ("change", "word"),
    [
        ({"AGENTD_NETWORK": None}, "missing AGENTD_NETWORK"),
        ({"AGENTD_MTU": None, "AGENTD_SUBNET": None}, "missing AGENTD_SUBNET, AGENTD_MTU"),
        ({"AGENTD_NETWORK": "10.244.0.1/16"}, "AGENTD_NETWORK"),
        ({"AGENTD_NETWORK": "fd00::/64"}, "AGENTD_NETWORK"),
        ({"AGENTD_SUBNET": "10.244.3.1"}, "prefix length"),
        ({"AGENTD_SUBNET": "10.244.3.300/24"}, "AGENTD_SUBNET"),
        ({"AGENTD_SUBNET": "10.245.3.1/24"}, "not inside"),
        ({"AGENTD_SUBNET": "10.244.3.1/31"}, "too small"),
        ({"AGENTD_MTU": "-1"}, "AGENTD_MTU"),
        ({"AGENTD_MTU": "67"}, "mtu"),
        ({"AGENTD_MTU": "70000"}, "mtu"),
        ({"AGENTD_IPMASQ": "yes"}, "AGENTD_IPMASQ"),
        ({"AGENTD_BACKEND": ""}, "backend"),
    ],
)
def test_subnet_file_errors_are_one_line(change, word):
    values = {**_GOOD, **change}
    text = "".join(f"{k}={v}\n" for k, v in values.items() if v is not None)
    with pytest.raises(SubnetFileError) as exc:
        cni_config.parse_subnet_file(text, "/run/agentd/subnet.env")
    msg = str(exc.value)
    assert word in msg and "/run/agentd/subnet.env" in msg and "\n" not in msg


def test_subnet_file_line_errors_name_the_line():
    with pytest.raises(SubnetFileError, match=r"^f:2: expected KEY=value"):
        cni_config.parse_subnet_file("AGENTD_MTU=1450\nnonsense\n", "f")
    with pytest.raises(SubnetFileError, match=r"^f:2: AGENTD_MTU given twice"):
        cni_config.parse_subnet_file("AGENTD_MTU=1450\nAGENTD_MTU=1400\n", "f")


def test_reading_missing_and_unreadable_subnet_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        cni_config.read_subnet_file(str(tmp_path / "absent"))
    with pytest.raises(SubnetFileError, match="cannot read subnet file"):
        cni_config.read_subnet_file(str(tmp_path))  # a directory
    (tmp_path / "bin").write_bytes(b"AGENTD_MTU=\xff\n")
    with pytest.raises(SubnetFileError, match="cannot read subnet file"):
        cni_config.read_subnet_file(str(tmp_path / "bin"))


def test_a_subnet_file_that_is_no_regular_file_fails_the_plugin_at_once(tmp_path):
    # agentd-cni reads the subnet file at every ADD, DEL and CHECK: a FIFO there hung the
    # runtime's call for ever, /dev/zero was read until memory ran out (read as docker-opts
    # and the configuration file read theirs).
    from blocking import unblock, within

    fifo = tmp_path / "subnet.env"
    os.mkfifo(fifo)
    try:
        got = within(1, cni_config.read_subnet_file, str(fifo))
    finally:
        unblock(fifo)
    assert isinstance(got.error, SubnetFileError) and "not a regular file" in str(got.error)
    with pytest.raises(SubnetFileError, match="not a regular file"):
        cni_config.read_subnet_file("/dev/zero")
    (tmp_path / "big.env").write_text("#" * 70_000 + "\n")
    with pytest.raises(SubnetFileError, match="over 65536 bytes"):
        cni_config.read_subnet_file(str(tmp_path / "big.env"))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"network": "10.244.0.0/16"},
        {"subnet": IPv4Network("10.1.0.0/24")},
        {"mtu": True},
        {"mtu": 1450.0},
        {"ipmasq": "false"},
        {"backend": "vx lan"},
    ],
)
def test_subnet_file_value_is_checked(kwargs):
    with pytest.raises(SubnetFileError):
        SubnetFile(**{"network": SF.network, "subnet": SF.subnet, "mtu": 1450, **kwargs})


@st.composite
def _subnet_files(draw) -> SubnetFile:
    net_len = draw(st.integers(8, 28))
    base = draw(st.integers(0, 2**32 - 1)) >> (32 - net_len) << (32 - net_len)
    network = IPv4Network((base, net_len))
    sub_len = draw(st.integers(net_len, 30))
    index = draw(st.integers(0, 2 ** (sub_len - net_len) - 1))
    subnet = IPv4Network((base + (index << (32 - sub_len)), sub_len))
    return SubnetFile(
        network=network,
        subnet=subnet,
        mtu=draw(st.integers(cni_config.MIN_MTU, cni_config.MAX_MTU)),
        ipmasq=draw(st.booleans()),
        backend=draw(st.sampled_from(["host-gw", "ipip", "vxlan", "udp"])),
    )


@given(_subnet_files())
def test_subnet_file_round_trips(sf):
    assert cni_config.parse_subnet_file(cni_config.render_subnet_file(sf)) == sf


# --- dual-stack and IPv6-only ---------------------------------------------------------------

DUAL_SF = SubnetFile(network=IPv4Network("10.244.0.0/16"), subnet=IPv4Network("10.244.3.0/24"), mtu=1450,
                     network_v6=IPv6Network("fd00:10:244::/48"), subnet_v6=IPv6Network("fd00:10:244:3::/64"))


def test_dual_stack_subnet_file_and_delegate_ranges():
    text = cni_config.render_subnet_file(DUAL_SF)
    assert "AGENTD_IPV6_NETWORK=fd00:10:244::/48\nAGENTD_IPV6_SUBNET=fd00:10:244:3::1/64\n" in text
    assert cni_config.parse_subnet_file(text) == DUAL_SF
    d = cni_config.delegate_config({"cniVersion": "1.0.0", "name": "podnet", "ipam": {"dataDir": "/x"}}, DUAL_SF)
    assert d["ipam"] == {
        "type": "host-local", "dataDir": "/x",
        "ranges": [[{"subnet": "10.244.3.0/24"}], [{"subnet": "fd00:10:244:3::/64"}]],  # IPv4 first: the podIP
        "routes": [{"dst": "10.244.0.0/16", "gw": "10.244.3.1"}, {"dst": "fd00:10:244::/48", "gw": "fd00:10:244:3::1"}],
    }


def test_ipv6_only_subnet_file_and_delegate_range():
    sf = SubnetFile(network=None, subnet=None, mtu=1430, network_v6=IPv6Network("fd00:10:244::/48"),
                    subnet_v6=IPv6Network("fd00:10:244:3::/64"))
    text = cni_config.render_subnet_file(sf)
    assert "AGENTD_NETWORK" not in text and cni_config.parse_subnet_file(text) == sf
    d = cni_config.delegate_config({"cniVersion": "1.0.0", "name": "podnet"}, sf)
    assert d["ipam"]["ranges"] == [[{"subnet": "fd00:10:244:3::/64"}]] and "subnet" not in d["ipam"]
    assert d["ipam"]["routes"] == [{"dst": "fd00:10:244::/48", "gw": "fd00:10:244:3::1"}]


@pytest.mark.parametrize(
    ("values", "word"),
    [
        ({"AGENTD_MTU": "1450"}, "missing AGENTD_NETWORK, AGENTD_SUBNET"),
        ({"AGENTD_IPV6_NETWORK": "fd00::/48", "AGENTD_MTU": "1450"}, "missing AGENTD_IPV6_SUBNET"),
        ({"AGENTD_IPV6_NETWORK": "10.0.0.0/8", "AGENTD_IPV6_SUBNET": "10.0.0.1/24", "AGENTD_MTU": "1450"},
         "AGENTD_IPV6_NETWORK '10.0.0.0/8' is not an IPv6 network"),
        ({"AGENTD_IPV6_NETWORK": "fd00::/48", "AGENTD_IPV6_SUBNET": "fd01::1/64", "AGENTD_MTU": "1450"}, "not inside"),
        ({"AGENTD_IPV6_NETWORK": "fd00::/48", "AGENTD_IPV6_SUBNET": "fd00::1/127", "AGENTD_MTU": "1450"},
         "too small for a gateway and pods (max /126)"),
    ],
)
def test_ipv6_subnet_file_errors_are_one_line(values, word):
    text = "".join(f"{k}={v}\n" for k, v in values.items())
    with pytest.raises(SubnetFileError) as exc:
        cni_config.parse_subnet_file(text, "/run/agentd/subnet.env")
    assert word in str(exc.value) and "\n" not in str(exc.value)


# --- the conflist ----------------------------------------------------------------------------


def test_conflist_is_written_with_per_node_dirs(tmp_path):
    path = cni_config.write_conflist(
        str(tmp_path / "net.d"),
        subnet_file="/run/ad/n1/subnet.env",
        data_dir="/var/lib/ad/n1/cni",
        ipam_data_dir="/var/lib/ad/n1/ipam",
        mtu=1400,
        extra={"promiscMode": True},
    )
    assert path == str(tmp_path / "net.d" / "10-agentd.conflist")
    assert os.listdir(tmp_path / "net.d") == ["10-agentd.conflist"]
    assert json.loads((tmp_path / "net.d" / "10-agentd.conflist").read_text()) == {
        "cniVersion": "1.0.0",
        "name": "agentd",
        "plugins": [
            {
                "type": "agentd-cni",
                "capabilities": {"labels": True, "containerPorts": True, "mac": True},
                "subnetFile": "/run/ad/n1/subnet.env",
                "dataDir": "/var/lib/ad/n1/cni",
                "ipam": {"dataDir": "/var/lib/ad/n1/ipam"},
                "delegate": {
                    "bridge": "cni0",
                    "hairpinMode": True,
                    "isDefaultGateway": True,
                    "forceAddress": True,
                    "mtu": 1400,
                    "promiscMode": True,
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}, "snat": True},
            {"type": "bandwidth", "capabilities": {"bandwidth": True}},
        ],
    }


def test_conflist_without_optional_settings(tmp_path):
    # Path objects (as agentd.config.settings holds them) are accepted as well as strings.
    path = cni_config.write_conflist(
        tmp_path, name="podnet", subnet_file=pathlib.Path("/s"), data_dir="/d", bridge="br1"
    )
    doc = json.loads(pathlib.Path(path).read_text())
    plugin = doc["plugins"][0]
    assert doc["name"] == "podnet"
    assert "ipam" not in plugin and "mtu" not in plugin["delegate"]
    assert (plugin["subnetFile"], plugin["dataDir"]) == ("/s", "/d")
    assert plugin["delegate"]["bridge"] == "br1"


@pytest.mark.parametrize("key", ["name", "ipam"])
def test_conflist_extra_may_not_set_plugin_owned_keys(tmp_path, key):
    with pytest.raises(ValueError, match=key):
        cni_config.write_conflist(str(tmp_path), subnet_file="/s", data_dir="/d", extra={key: {}})


def test_conflist_entry_is_accepted_by_the_plugin(tmp_path):
    # The runtime hands the plugin its conflist entry with name and cniVersion filled in (libcni).
    path = cni_config.write_conflist(
        str(tmp_path), subnet_file=str(tmp_path / "subnet.env"), data_dir=str(tmp_path / "state"),
        ipam_data_dir=str(tmp_path / "ipam"),
    )
    doc = json.loads(pathlib.Path(path).read_text())
    netconf = {**doc["plugins"][0], "name": doc["name"], "cniVersion": doc["cniVersion"]}
    assert cni.parse_netconf(json.dumps(netconf).encode()) == netconf
    d = cni_config.delegate_config(netconf, SF)
    assert d["ipam"]["dataDir"] == str(tmp_path / "ipam")
    assert d["isDefaultGateway"] is True and d["forceAddress"] is True and d["bridge"] == "cni0"


# --- audit findings ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stdin", "word"),
    [
        (b"[" * 100000, "nested too deeply"),
        (b'{"cniVersion": "1.0.0", "name": "agentd", "x": ' + b"9" * 5000 + b"}", "number too long"),
    ],
)
def test_stdin_too_deep_or_with_huge_integer_is_a_decoding_failure(stdin, word):
    out = _assert_error(_run(_env(), stdin), 6, word)
    assert len(out["msg"]) < 100


@pytest.mark.parametrize(
    "timeout",
    [float("inf"), float("-inf"), float("nan"), 1e308, 10**400, 3600.5, -1, 0.0, "60", False, None, []],
    ids=lambda v: repr(v)[:12],
)
def test_delegate_timeout_must_be_finite_positive_and_at_most_an_hour(tmp_path, timeout):
    conf = {**_conf(tmp_path), "delegateTimeout": timeout}  # json writes inf and nan as Infinity, NaN
    out = _assert_error(_run(_env(), conf), 7, "delegateTimeout")
    assert len(out["msg"]) < 150


@pytest.mark.parametrize("timeout", [0.001, 1, 60, 3600])
def test_delegate_timeout_in_range_is_accepted(tmp_path, timeout):
    conf = _conf(tmp_path, delegateTimeout=timeout)
    assert cni.parse_netconf(json.dumps(conf).encode())["delegateTimeout"] == timeout


# Superscript two (isdigit() but not int()), Arabic-Indic and fullwidth digits (int() reads them),
# and more digits than int() converts.
@pytest.mark.parametrize("mtu", ["\u00b2", "1\u00b2", "\u0661\u0664\u0665\u0660", "\uff11\uff14\uff15\uff10", "9" * 5000])
def test_subnet_file_mtu_takes_only_ascii_digits(mtu):
    text = "".join(f"{k}={v}\n" for k, v in {**_GOOD, "AGENTD_MTU": mtu}.items())
    with pytest.raises(SubnetFileError) as exc:
        cni_config.parse_subnet_file(text, "/run/agentd/subnet.env")
    msg = str(exc.value)
    assert "AGENTD_MTU" in msg and "/run/agentd/subnet.env" in msg and len(msg) < 120


def test_add_with_non_ascii_mtu_in_subnet_file_is_invalid_config(tmp_path):
    (tmp_path / "subnet.env").write_text(
        "AGENTD_NETWORK=10.244.0.0/16\nAGENTD_SUBNET=10.244.3.1/24\nAGENTD_MTU=\u00b2\n", encoding="utf-8"
    )
    _assert_error(_run(_env(), _conf(tmp_path)), 7, "AGENTD_MTU")


@pytest.mark.parametrize("ifname", ["\u00e9" * 8, "\u00e9" * 13, "a" * 14 + "\u00e9"])
def test_ifname_limit_counts_bytes_not_characters(tmp_path, ifname):
    _assert_error(_run(_env(CNI_IFNAME=ifname), _conf(tmp_path)), 4, "CNI_IFNAME", "bytes")


def test_ifname_of_15_bytes_with_non_ascii_is_accepted(tmp_path):
    # 7 two-byte characters and one ASCII: 15 bytes; stops at the missing subnet file.
    _assert_error(_run(_env(CNI_IFNAME="\u00e9" * 7 + "x"), _conf(tmp_path)), 11)


@pytest.mark.parametrize("command", ["ADD", "CHECK"])
def test_missing_netns_path_is_invalid_environment_and_nothing_is_stored(tmp_path, command):
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    netns = str(tmp_path / "no-such-netns")
    conf = _conf(tmp_path, prevResult={"cniVersion": "1.0.0"}) if command == "CHECK" else _conf(tmp_path)
    _assert_error(_run(_env(command, CNI_NETNS=netns), conf), 4, "CNI_NETNS", netns)
    assert not (tmp_path / "state").exists()


def test_del_with_missing_netns_path_is_still_accepted(tmp_path):
    assert _run(_env("DEL", CNI_NETNS=str(tmp_path / "gone")), _conf(tmp_path)) == (0, None)


def test_endpoint_files_are_readable_by_an_agent_of_its_own_user(tmp_path):
    """The plugin runs as root under the runtime; the agent may run as a user of its own
    (docs/operations.md): the endpoint files and their directory are readable by it, whatever
    the umask the plugin runs with."""
    import stat as stat_mod

    from agentd.cni import endpoints as eps

    ep = eps.Endpoint("c1", "default", "web-0", {"app": "web"}, [], ["10.244.1.5"], "veth1234", "aa:bb:cc:dd:ee:ff", "cni0")
    umask = os.umask(0o077)
    try:
        eps.write(tmp_path, ep)
    finally:
        os.umask(umask)
    directory = pathlib.Path(eps.endpoints_dir(tmp_path))
    assert stat_mod.S_IMODE(directory.stat().st_mode) == 0o755
    assert stat_mod.S_IMODE((directory / ("c1" + eps.SUFFIX)).stat().st_mode) == 0o644
    assert stat_mod.S_IMODE((directory / eps.LOCK).stat().st_mode) == 0o600  # not others': see test_agent_views


def test_a_data_dir_the_plugin_makes_lets_an_agent_of_its_own_user_in(tmp_path, monkeypatch):
    """Review r12: ADD before the agent made dataDir (a new node, a retried ADD) made it 0700,
    and an agent of its own user could not read the endpoint files in it (PermissionError, not
    "no pods").  dataDir and endpoints/ are 0755 whatever the umask; what is private stays so:
    the state file (the delegate's config, any runtimeConfig passed) 0600, the lock 0600."""
    import stat as stat_mod

    from agentd.cni import endpoints as eps

    _fake_delegate(monkeypatch, [])
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    umask = os.umask(0o077)
    try:
        assert _run(_env(CNI_ARGS="K8S_POD_NAMESPACE=default;K8S_POD_NAME=web"), _conf(tmp_path, policyTimeout=0))[0] == 0
    finally:
        os.umask(umask)
    state = tmp_path / "state"
    private = cni.STATE_SUBDIR
    modes = {p: stat_mod.S_IMODE((state / p).stat().st_mode)
             for p in (".", private, f"{private}/c0ffee01", eps.SUBDIR, f"{eps.SUBDIR}/c0ffee01{eps.SUFFIX}",
                       f"{eps.SUBDIR}/{eps.LOCK}")}  # fmt: skip
    assert modes == {".": 0o755, private: 0o700, f"{private}/c0ffee01": 0o600, eps.SUBDIR: 0o755,
                     f"{eps.SUBDIR}/c0ffee01{eps.SUFFIX}": 0o644, f"{eps.SUBDIR}/{eps.LOCK}": 0o600}  # fmt: skip


def _fake_delegate(monkeypatch, calls):
    def invoke(conf, args, env, timeout):
        calls.append((args.command, args.container_id))
        if args.command == "ADD":
            return {"cniVersion": "1.0.0", "interfaces": [{"name": "cni0"}, {"name": "veth1", "mac": "bb"},
                                                          {"name": "eth0", "sandbox": args.netns}],
                    "ips": [{"address": "10.244.3.7/24", "interface": 2}]}  # fmt: skip
        return None

    monkeypatch.setattr(cni, "invoke_delegate", invoke)
    monkeypatch.setattr(cni, "find_plugin", lambda plugin_type, path: "/fake/" + plugin_type)


@pytest.mark.parametrize("command", ["ADD", "CHECK"])
@pytest.mark.parametrize("container_id", ["a" * 201, "endpoints"])
def test_container_ids_that_cannot_name_a_state_file_are_refused(tmp_path, monkeypatch, command, container_id):
    """The ID names the state file in dataDir: one too long for a file name, or the name of the
    endpoint files' directory (whose state file would keep every other pod's file out), is
    refused before anything is stored."""
    calls = []
    _fake_delegate(monkeypatch, calls)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    conf = _conf(tmp_path, prevResult={"cniVersion": "1.0.0"}) if command == "CHECK" else _conf(tmp_path)
    _assert_error(_run(_env(command, CNI_CONTAINERID=container_id), conf), 4, "CNI_CONTAINERID")
    assert calls == [] and not (tmp_path / "state").exists()


def test_the_longest_container_id_is_added_and_deleted(tmp_path, monkeypatch):
    calls = []
    _fake_delegate(monkeypatch, calls)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    cid = "a" * cni.MAX_ID_BYTES
    args = "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web"
    conf = _conf(tmp_path, policyTimeout=0)
    assert _run(_env(CNI_CONTAINERID=cid, CNI_ARGS=args), conf)[0] == 0
    assert (tmp_path / "state" / "endpoints" / (cid + ".json")).exists()
    assert _run(_env("DEL", CNI_CONTAINERID=cid), conf) == (0, None)
    assert calls == [("ADD", cid), ("DEL", cid)] and sorted(os.listdir(tmp_path / "state")) == [cni.STATE_SUBDIR, "endpoints"]
    assert os.listdir(tmp_path / "state" / cni.STATE_SUBDIR) == []


@pytest.mark.parametrize("container_id", ["a" * 300, "endpoints"])
def test_del_of_an_id_no_state_file_can_have_succeeds(tmp_path, monkeypatch, container_id):
    """The runtime retries a failed DEL for ever: an ID ADD refuses (or one whose name is the
    endpoint directory's) is a DEL with nothing stored, not "File name too long" or "Is a
    directory"."""
    calls = []
    _fake_delegate(monkeypatch, calls)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    conf = _conf(tmp_path, policyTimeout=0)
    args = "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web"
    assert _run(_env(CNI_ARGS=args), conf)[0] == 0  # another pod: the endpoint directory is there
    assert _run(_env("DEL", CNI_CONTAINERID=container_id), conf) == (0, None)
    assert calls[-1] == ("DEL", container_id)  # the delegate releases what it may have, as for any unknown ID
    assert cni.load_state(str(tmp_path / "state"), container_id) is None
    assert cni.stored_ifname(str(tmp_path / "state"), container_id) is None
    assert (tmp_path / "state" / "endpoints" / "c0ffee01.json").exists()


def test_del_of_a_state_file_named_endpoints_lets_the_endpoint_directory_be_made(tmp_path, monkeypatch):
    """An older plugin stored the config of a container named "endpoints" before the endpoint
    directory existed (in dataDir itself, where it kept state files): its DEL removes it, and
    pods' endpoint files can be written again."""
    calls = []
    _fake_delegate(monkeypatch, calls)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    conf = _conf(tmp_path, policyTimeout=0)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "endpoints").write_text(json.dumps(cni_config.delegate_config(conf, SF)))
    assert _run(_env("DEL", CNI_CONTAINERID="endpoints"), conf) == (0, None)
    assert not (tmp_path / "state" / "endpoints").exists()
    assert _run(_env(CNI_ARGS="K8S_POD_NAMESPACE=default;K8S_POD_NAME=web"), conf)[0] == 0
    assert (tmp_path / "state" / "endpoints" / "c0ffee01.json").exists()


def test_unacknowledged_are_the_containers_no_agent_marked_programmed(tmp_path):
    """The policy agent guards a new pods' bridge before acknowledging only pods whose ADD may
    be waiting: none an agent marked programmed before (a restarted agent re-acknowledging)."""
    from agentd.cni import endpoints

    ep = endpoints.Endpoint("a", "default", "web-0", {}, [], ["10.244.1.5"], "veth1", "aa:bb:cc:dd:ee:ff", "cni0")
    endpoints.write(tmp_path, ep)
    (which,) = (e.ident for e in endpoints.read_all(tmp_path).values())
    assert endpoints.unacknowledged(tmp_path, {"a", "b"}) == {"a", "b"}  # nothing marked yet
    assert endpoints.acknowledge(tmp_path, {("a", which)}, set()) == {("a", which)}
    assert endpoints.unacknowledged(tmp_path, {"a", "b"}) == {"b"}
    assert endpoints.unacknowledged(tmp_path, set()) == set()


def test_a_new_attachment_with_the_same_container_id_is_acknowledged_again(tmp_path):
    """DEL then ADD with one container ID (podman restart, the compose lab's entrypoint), the
    agent not having built without the container in between: the new ADD is acknowledged once
    a build has its file -- not by the old acknowledgement, nor by a build of the old file."""
    from agentd.cni import endpoints

    ep = endpoints.Endpoint("a", "default", "web-0", {}, [], ["10.244.1.5"], "veth1", "aa:bb:cc:dd:ee:ff", "cni0")
    endpoints.write(tmp_path, ep)
    (old,) = (e.ident for e in endpoints.read_all(tmp_path).values())
    acked = endpoints.acknowledge(tmp_path, {("a", old)}, set())
    endpoints.write(tmp_path, dataclasses.replace(ep, ips=["10.244.1.6"], interface="veth2"))  # no DEL came
    (new,) = (e.ident for e in endpoints.read_all(tmp_path).values())
    assert new != old
    assert endpoints.unacknowledged(tmp_path, {"a"}) == {"a"}  # ADD waits for the agent again
    # a restarted agent's first build still had the old file: that is no acknowledgement of this one
    assert endpoints.acknowledge(tmp_path, {("a", old)}, set()) == set()
    assert endpoints.acknowledge(tmp_path, {("a", old)}, acked) == {("a", old)}
    assert endpoints.unacknowledged(tmp_path, {"a"}) == {"a"}
    # the build with the new file acknowledges it, though the container ID was acknowledged before
    acked = endpoints.acknowledge(tmp_path, {("a", new)}, acked)
    assert acked == {("a", new)} and endpoints.unacknowledged(tmp_path, {"a"}) == set()
    endpoints.remove(tmp_path, "a")
    assert endpoints.acknowledge(tmp_path, set(), acked) == set()


def test_a_del_and_add_within_one_mtime_tick_is_a_new_file_to_the_agent(tmp_path):
    """The file system's timestamps are coarse (a clock tick): a DEL and ADD of one container
    ID in quick succession leave a file with the very same mtime.  Its ident still differs, so
    a build of the old file acknowledges nothing and relabelling the old file writes nothing,
    even when the new file says the same as the old one."""
    from agentd.cni import endpoints

    ep = endpoints.Endpoint("a", "default", "web-0", {"app": "web"}, [], ["10.244.1.5"], "veth1", "aa:bb:cc:dd:ee:ff", "cni0")
    path = os.path.join(endpoints.endpoints_dir(tmp_path), "a.json")
    endpoints.write(tmp_path, ep)
    os.utime(path, ns=(1_000, 1_000))
    (old,) = endpoints.read_all(tmp_path).values()
    for again in (dataclasses.replace(ep, labels={"app": "other"}), ep):  # new content, then the same content
        endpoints.remove(tmp_path, "a")
        endpoints.write(tmp_path, again)
        os.utime(path, ns=(1_000, 1_000))  # the same tick
        (new,) = endpoints.read_all(tmp_path).values()
        assert new.written == old.written and new.ident != old.ident
        assert endpoints.acknowledge(tmp_path, {("a", old.ident)}, set()) == set()
        assert endpoints.unacknowledged(tmp_path, {"a"}) == {"a"}
        assert endpoints.relabel(tmp_path, old, {"app": "z"}) is None
        assert endpoints.read(tmp_path, "a").labels == again.labels
        assert endpoints.acknowledge(tmp_path, {("a", new.ident)}, set()) == {("a", new.ident)}
        old = new


def test_a_file_of_an_older_plugin_without_a_generation_is_told_apart_by_inode_and_size(tmp_path):
    """An endpoint file an agentd-cni from before generations wrote: its ident is inode, mtime
    and size; relabelling it hands back the ident of the file it wrote."""
    import json

    from agentd.cni import endpoints

    ep = endpoints.Endpoint("a", "default", "web-0", {}, [], ["10.244.1.5"], "veth1", "aa:bb:cc:dd:ee:ff", "cni0")
    directory = endpoints.endpoints_dir(tmp_path)
    os.makedirs(directory)
    path = os.path.join(directory, "a.json")
    with open(path, "w") as f:
        f.write(ep.to_json())
    with open(path) as f:
        assert "generation" not in json.loads(f.read())
    (read,) = endpoints.read_all(tmp_path).values()
    st = os.stat(path)
    assert read.generation == "" and read.ident == f"s:{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"
    relabelled = endpoints.relabel(tmp_path, read, {"app": "z"})
    assert relabelled is not None and relabelled.ident == endpoints.read_all(tmp_path)["a"].ident
    assert endpoints.acknowledge(tmp_path, {("a", relabelled.ident)}, set()) == {("a", relabelled.ident)}


def test_the_bridge_guard_before_an_ack_is_clsacts_alone():
    """BpfPath.guard_bridges guards now under clsact (the qdisc's graft must come before the
    bridge carries traffic) and leaves tcx to the refresh."""
    import asyncio

    from agentd.dataplane.bpf_backend import BpfPath

    class Datapath:
        def __init__(self, hook):
            self.hook, self.calls = hook, 0

        def guard_bridges(self):
            self.calls += 1

    for hook, calls in (("clsact", 1), ("tcx", 0)):
        path = BpfPath.__new__(BpfPath)
        path.dp, path._lock = Datapath(hook), asyncio.Lock()
        asyncio.run(path.guard_bridges())
        assert path.dp.calls == calls, hook


# --- pod identity: podman's CNI_ARGS --------------------------------------------------------------

PODMAN_CNI_ARGS = [
    # podman 4/5, CNI backend (containers/common libnetwork/cni/run.go getRuntimeConfig: "Do not
    # set the K8S env vars", podman#12083): the container name as K8S_POD_NAME, nothing more.
    "IgnoreUnknown=1;K8S_POD_NAME=objective_tesla",
    "IgnoreUnknown=1;K8S_POD_NAME=web",
    # podman 3 (ocicni): the container name as namespace and name; default names hold "_".
    "IgnoreUnknown=1;K8S_POD_NAMESPACE=objective_tesla;K8S_POD_NAME=objective_tesla;K8S_POD_INFRA_CONTAINER_ID=c0ffee01",
]


@pytest.mark.parametrize("cni_args", PODMAN_CNI_ARGS)
def test_a_podman_container_is_attached_without_pod_identity_and_one_warning(tmp_path, monkeypatch, capsys, cni_args):
    calls = []
    _fake_delegate(monkeypatch, calls)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    conf = _conf(tmp_path, policyTimeout=0)
    code, result = _run(_env(CNI_ARGS=cni_args), conf)
    assert code == 0 and result is not None and result["ips"][0]["address"] == "10.244.3.7/24", result
    assert calls == [("ADD", "c0ffee01")]
    assert not (tmp_path / "state" / "endpoints" / "c0ffee01.json").exists()  # no pod to policy
    warning = capsys.readouterr().err.splitlines()
    assert len(warning) == 1 and "c0ffee01" in warning[0] and "without pod identity" in warning[0], warning
    assert "K8S_POD_NAMESPACE" in warning[0]  # why: missing, or not a namespace's name
    prev = dict(result, cniVersion="1.0.0")
    assert _run(_env("CHECK", CNI_ARGS=cni_args), _conf(tmp_path, prevResult=prev)) == (0, None)
    assert _run(_env("DEL", CNI_ARGS=cni_args), conf) == (0, None)


def test_a_kubernetes_pod_still_gets_its_identity(tmp_path, monkeypatch, capsys):
    calls = []
    _fake_delegate(monkeypatch, calls)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    args = "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=c0ffee01"
    assert _run(_env(CNI_ARGS=args), _conf(tmp_path, policyTimeout=0))[0] == 0
    ep = json.loads((tmp_path / "state" / "endpoints" / "c0ffee01.json").read_text())
    assert (ep["namespace"], ep["name"]) == ("shop", "web-0")
    assert capsys.readouterr().err == ""


# --- a corrupt state file, and how state files are written -----------------------------------------


@pytest.mark.parametrize("text", ["", "{", '{"cniVersion": "1.0.0"}', "[]"])
@pytest.mark.parametrize("subnet_file", [True, False])
def test_del_removes_a_corrupt_state_file_once_it_has_done_its_work(tmp_path, monkeypatch, text, subnet_file):
    """An empty or damaged state file (a crash, a full disk) names nothing to undo: DEL does what it
    does with nothing stored, then removes the file, so it does not stay for ever."""
    calls = []
    _fake_delegate(monkeypatch, calls)
    if subnet_file:
        cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    conf = _conf(tmp_path)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "c0ffee01").write_text(text)
    assert _run(_env("DEL"), conf) == (0, None)
    assert calls == ([("DEL", "c0ffee01")] if subnet_file else [])  # the current config, if there is one
    assert os.listdir(tmp_path / "state") == []


def test_del_keeps_a_corrupt_state_file_while_the_delegate_fails(tmp_path, monkeypatch):
    def invoke(conf, args, env, timeout):
        raise cni.CniError(11, "busy")

    monkeypatch.setattr(cni, "invoke_delegate", invoke)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "c0ffee01").write_text("")
    _assert_error(_run(_env("DEL"), _conf(tmp_path)), 11, "busy")
    assert os.listdir(tmp_path / "state") == ["c0ffee01"]  # the runtime retries DEL


def test_del_without_the_delegate_keeps_a_corrupt_state_file_and_fails(tmp_path):
    """A state file, even one that cannot be read, says ADD got past its look for the delegate
    (which may have set things up): without the delegate DEL fails, the file kept for the
    runtime's retry once the delegate is back."""
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "c0ffee01").write_text("")
    rc, err = _run(_env("DEL", CNI_PATH=str(tmp_path / "empty")), _conf(tmp_path))
    assert rc == 1 and err["code"] == cni.INTERNAL and "not found" in err["msg"]
    assert os.listdir(tmp_path / "state") == ["c0ffee01"]


def _fsyncs_and_renames(monkeypatch):
    """os.fsync and os.replace, recorded in order as they go on: ("fsync", of a directory?),
    ("replace", the name taken)."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst, **dir_fds):
        events.append(("replace", os.path.basename(dst)))
        real_replace(src, dst, **dir_fds)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def test_the_state_file_is_on_disk_before_it_takes_the_name(tmp_path, monkeypatch):
    """save_state fsyncs the temporary file before the rename (else a crash can leave the name
    with no content: an empty state file), and the directory after it."""
    events = _fsyncs_and_renames(monkeypatch)
    cni.save_state(str(tmp_path / "state"), "c0ffee01", {"type": "bridge"}, "eth0")
    assert events == [("fsync", False), ("replace", "c0ffee01"), ("fsync", True)]
    assert cni.load_state(str(tmp_path / "state"), "c0ffee01") == {"type": "bridge"}


def test_an_endpoint_file_is_on_disk_before_it_takes_the_name(tmp_path, monkeypatch):
    """endpoints.write (ADD) and relabel (the agent) fsync the temporary file before the rename
    (else a crash can leave the name with no content: an endpoint file never readable), and
    the directory after it."""
    from agentd.cni import endpoints as eps

    events = _fsyncs_and_renames(monkeypatch)
    ep = eps.Endpoint(container_id="c0ffee01", namespace="ns", name="web", labels={}, ports=[],
                      ips=["10.244.3.7"], interface="veth1", mac="aa:bb:cc:dd:ee:ff", bridge="cni0")
    eps.write(str(tmp_path), ep)
    assert events == [("fsync", False), ("replace", "c0ffee01.json"), ("fsync", True)]
    events.clear()
    read = eps.read_all(str(tmp_path))["c0ffee01"]
    assert eps.relabel(str(tmp_path), read, {"app": "web"}) is not None
    assert events == [("fsync", False), ("replace", "c0ffee01.json"), ("fsync", True)]
    assert eps.read(str(tmp_path), "c0ffee01").labels == {"app": "web"}



def _file(path: pathlib.Path, mtime: float | None = None) -> pathlib.Path:
    """A file at ``path``, last changed at ``mtime`` (None: now)."""
    path.write_text("{")
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_del_sweeps_the_temporary_files_a_crash_left_and_nothing_else(tmp_path, monkeypatch):
    """A crash between mkstemp and the rename (save_state, endpoints.write, the agent's relabel)
    leaves ".<container ID>.<8 characters>": any DEL removes such regular files once they are
    TEMP_MAX_AGE old.  Fresh ones (a write going on), other dot files, state and endpoint files
    (of containers whose DEL never came: nothing tells a container gone from one not) stay."""
    calls = []
    _fake_delegate(monkeypatch, calls)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    conf = _conf(tmp_path, policyTimeout=0)
    state = tmp_path / "state"
    assert _run(_env(CNI_CONTAINERID="other", CNI_ARGS="K8S_POD_NAMESPACE=default;K8S_POD_NAME=web"), conf)[0] == 0
    epdir = state / "endpoints"
    old = 1000.0  # long before now
    doomed = [_file(state / ".c0ffee01.ab_d12z4", old), _file(state / ".a.b-c.x9999999", old),
              _file(epdir / ".c0ffee01.abcd1234", old)]
    kept = [_file(state / ".c0ffee01.fresh123"),  # a write going on
            _file(state / ".c0ffee01.abc", old), _file(state / ".c0ffee01.ABCD1234", old),
            _file(state / "c0ffee01.abcd1234", old), _file(epdir / ".lock.abcd1234x", old),
            _file(state / "gone00", old), _file(epdir / "gone00.json", old)]  # a DEL that never came
    (state / ".dir.abcd1234").mkdir()
    os.utime(state / ".dir.abcd1234", (old, old))
    (state / ".link.abcd1234").symlink_to(state / "gone00")
    before = sorted(p.name for p in epdir.iterdir())

    assert _run(_env("DEL", CNI_CONTAINERID="c0ffee01"), conf) == (0, None)
    assert [p for p in doomed if p.exists()] == []
    assert [p for p in kept if not p.exists()] == []
    assert (state / ".dir.abcd1234").is_dir() and (state / ".link.abcd1234").is_symlink()
    assert sorted(p.name for p in epdir.iterdir()) == sorted(set(before) - {".c0ffee01.abcd1234"})
    assert cni.load_state(str(state), "other") is not None and (epdir / "other.json").exists()


def test_the_temporary_file_sweep_goes_by_the_time_passed_in(tmp_path):
    (tmp_path / "endpoints").mkdir()
    tmp = _file(tmp_path / "endpoints" / ".c0ffee01.abcd1234", 1000.0)
    assert cni.sweep_temp_files(str(tmp_path), 1000.0 + cni.TEMP_MAX_AGE - 1) == []
    assert tmp.exists()
    assert cni.sweep_temp_files(str(tmp_path), 1000.0 + cni.TEMP_MAX_AGE) == [str(tmp)]
    assert not tmp.exists()
    assert cni.sweep_temp_files(str(tmp_path / "none"), 1e12) == []  # no directory: nothing to do


# --- what root's plugin acts on: nothing another user could have written (review s55 r1) -----
#
# An agent of a user of its own owns dataDir (it makes it, docs/operations.md) and endpoints/.
# The plugin runs as root: "another user" below is any but the test's (os.geteuid()), and
# where the test needs a directory of another user it says the plugin runs as another uid.

CRAFTED = {"type": "tuning", "sysctl": {"net.ipv4.ip_forward": "0"}}  # what that user would have root run
POD_ARGS = "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web"


def _delegate_seeing(monkeypatch, calls):
    """A fake delegate recording (command, the config's type) and answering ADD as bridge does."""
    def invoke(conf, args, env, timeout):
        calls.append((args.command, conf["type"]))
        if args.command == "ADD":
            return {"cniVersion": "1.0.0", "interfaces": [{"name": "cni0"}, {"name": "veth1", "mac": "bb"},
                                                          {"name": "eth0", "sandbox": args.netns}],
                    "ips": [{"address": "10.244.3.7/24", "interface": 2}]}  # fmt: skip
        return None

    monkeypatch.setattr(cni, "invoke_delegate", invoke)
    monkeypatch.setattr(cni, "find_plugin", lambda plugin_type, path: "/fake/" + plugin_type)


def _as_another_uid(monkeypatch):
    """The plugin runs as a uid other than the owner of what the test made (the test's user)."""
    euid = os.geteuid()
    monkeypatch.setattr(cni.os, "geteuid", lambda: euid + 1)


def _stat(mode: int, uid: int = 0, nlink: int = 1) -> os.stat_result:
    return os.stat_result((mode, 1, 1, nlink, uid, 0, 0, 0, 0, 0))


@pytest.mark.parametrize(("st", "directory", "problem"), [
    (_stat(0o40700), True, ""),
    (_stat(0o40755), True, ""),  # readable by others: nothing in it is (0600)
    (_stat(0o40700, uid=4242), True, "owned by uid 4242, not 0"),
    (_stat(0o40770), True, "writable by its group or others (mode 0770)"),
    (_stat(0o40703), True, "writable by its group or others (mode 0703)"),
    (_stat(0o120777), True, "is a symlink"),
    (_stat(0o100600), True, "is not a directory"),
    (_stat(0o100600), False, ""),
    (_stat(0o100644), False, ""),
    (_stat(0o100600, uid=4242), False, "owned by uid 4242, not 0"),
    (_stat(0o100620), False, "writable by its group or others (mode 0620)"),
    (_stat(0o100600, nlink=2), False, "has 2 links"),  # a hard link to root's file elsewhere
    (_stat(0o120777), False, "is a symlink"),
    (_stat(0o10600), False, "is not a regular file"),  # a FIFO
    (_stat(0o40700), False, "is not a regular file"),
])  # fmt: skip
def test_what_the_plugin_trusts_is_its_users_alone_by_its_stat(st, directory, problem):
    """The state directory and a state file are trusted only when no other user than the
    plugin's (root, uid 0, under the runtime) can have written them."""
    got = cni.private_problem(st, 0, directory=directory)
    assert (problem in got if problem else got == ""), got


def test_add_keeps_the_state_file_in_a_directory_only_the_plugins_user_writes(tmp_path, monkeypatch):
    """Review s55 r1 #1: dataDir is the agent's user's when the agent runs as one (0755): a
    state file there could be unlinked and replaced by that user, and root's DEL would run
    what the new one says.  ADD stores it in dataDir/.state, the plugin's own, 0700; DEL uses
    and removes it."""
    import stat as stat_mod

    calls = []
    _delegate_seeing(monkeypatch, calls)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    conf = _conf(tmp_path, policyTimeout=0)
    (tmp_path / "state").mkdir(mode=0o755)  # the agent's, made first
    assert _run(_env(CNI_ARGS=POD_ARGS), conf)[0] == 0
    private = tmp_path / "state" / cni.STATE_SUBDIR
    assert not (tmp_path / "state" / "c0ffee01").exists()
    st = os.lstat(private)
    assert stat_mod.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat_mod.S_IMODE(st.st_mode) == 0o700
    st = os.lstat(private / "c0ffee01")
    assert stat_mod.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat_mod.S_IMODE(st.st_mode) == 0o600
    assert _run(_env("DEL"), conf) == (0, None)
    assert calls == [("ADD", "bridge"), ("DEL", "bridge")] and os.listdir(private) == []


@pytest.mark.parametrize("tampered", ["a symlink", "group-writable", "writable by others", "another user's", "a file"])
def test_a_state_directory_another_user_could_write_in_is_refused(tmp_path, monkeypatch, tampered):
    """The state directory is used only while it is the plugin's user's alone: a symlink to a
    directory of that user's (or its own directory in its place), or one another user may
    write in, fails ADD, DEL and CHECK (IO_FAILURE, naming it), and nothing in it is run."""
    calls = []
    _delegate_seeing(monkeypatch, calls)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    conf = _conf(tmp_path, policyTimeout=0)
    data = tmp_path / "state"
    data.mkdir(mode=0o755)
    private = data / cni.STATE_SUBDIR
    if tampered == "a symlink":
        (tmp_path / "mine").mkdir(mode=0o700)
        (tmp_path / "mine" / "c0ffee01").write_text(json.dumps(CRAFTED))
        os.chmod(tmp_path / "mine" / "c0ffee01", 0o600)
        private.symlink_to(tmp_path / "mine")
    elif tampered == "a file":
        private.write_text(json.dumps(CRAFTED))
    else:
        private.mkdir(mode=0o700)
        (private / "c0ffee01").write_text(json.dumps(CRAFTED))
        os.chmod(private / "c0ffee01", 0o600)
        if tampered == "another user's":
            _as_another_uid(monkeypatch)
        else:
            os.chmod(private, 0o770 if tampered == "group-writable" else 0o702)
    prev = {"cniVersion": "1.0.0", "ips": [{"address": "10.244.3.7/24"}]}
    for command, c in (("ADD", conf), ("CHECK", _conf(tmp_path, prevResult=prev)), ("DEL", conf)):
        out = _assert_error(_run(_env(command, CNI_ARGS=POD_ARGS), c), 5, str(private), "refused")
        assert "chown root:root" in out["details"], out
    assert calls == []  # neither the crafted config nor any other ran


@pytest.mark.parametrize("placed", ["dataDir group-writable", "dataDir another user's", "a symlink", "a hard link",
                                    "writable by others", "a FIFO"])
def test_an_older_plugins_state_file_another_user_could_have_placed_is_not_used(tmp_path, monkeypatch, capsys, placed):
    """An agentd-cni before .state kept the state file in dataDir itself; a DEL after the upgrade
    still looks there, but uses a file only when no other user could have put it there: dataDir
    the plugin's user's and writable by no group or other user, the file a regular file (not
    followed through a symlink; a FIFO never waited on) of that user's, of one link, writable by
    no group or other user.  Otherwise DEL undoes with the current config (as with nothing
    stored), says so, and removes the name; CHECK finds nothing stored."""
    calls = []
    _delegate_seeing(monkeypatch, calls)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    conf = _conf(tmp_path, policyTimeout=0)
    data = tmp_path / "state"
    data.mkdir(mode=0o755)
    old = data / "c0ffee01"
    elsewhere = tmp_path / "elsewhere"  # a file of the plugin's user's the other user cannot change
    elsewhere.write_text(json.dumps(CRAFTED))
    os.chmod(elsewhere, 0o600)
    if placed == "a symlink":
        old.symlink_to(elsewhere)
    elif placed == "a hard link":
        os.link(elsewhere, old)
    elif placed == "a FIFO":
        os.mkfifo(old, 0o600)
    else:
        old.write_text(json.dumps(CRAFTED))
        os.chmod(old, 0o666 if placed == "writable by others" else 0o600)
        if placed == "dataDir group-writable":
            os.chmod(data, 0o775)
        elif placed == "dataDir another user's":
            _as_another_uid(monkeypatch)
    prev = {"cniVersion": "1.0.0", "ips": [{"address": "10.244.3.7/24"}]}
    _assert_error(_run(_env("CHECK", CNI_ARGS=POD_ARGS), _conf(tmp_path, prevResult=prev)), 3, "c0ffee01")
    capsys.readouterr()
    assert _run(_env("DEL"), conf) == (0, None)
    assert calls == [("DEL", "bridge")]  # the current config, not the one placed
    assert "not using the stored delegate config" in capsys.readouterr().err
    assert not os.path.lexists(old) and json.loads(elsewhere.read_text()) == CRAFTED


def test_an_older_plugins_state_file_no_other_user_could_have_placed_still_serves_its_del(tmp_path, monkeypatch):
    """The upgrade: a container an older agentd-cni added, its state file in dataDir itself
    (the plugin's user's, 0700 as older plugins made it), is undone with that config, though
    another container's ADD has made .state since; both places are left without it."""
    calls = []
    _delegate_seeing(monkeypatch, calls)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    conf = _conf(tmp_path, policyTimeout=0)
    data = tmp_path / "state"
    data.mkdir(mode=0o700)
    stored = dict(cni_config.delegate_config(conf, SF), type="bridge-of-old")
    (data / "c0ffee01").write_text(json.dumps(stored))
    os.chmod(data / "c0ffee01", 0o600)
    assert _run(_env(CNI_CONTAINERID="other", CNI_ARGS=POD_ARGS), conf)[0] == 0
    assert cni.load_state(str(data), "c0ffee01") == stored
    assert _run(_env("DEL"), conf) == (0, None)
    assert calls == [("ADD", "bridge"), ("DEL", "bridge-of-old")]
    assert not (data / "c0ffee01").exists() and os.listdir(data / cni.STATE_SUBDIR) == ["other"]


def _endpoint(cid: str = "c0ffee01"):
    from agentd.cni import endpoints as eps

    return eps.Endpoint(container_id=cid, namespace="default", name="web", labels={}, ports=[], ips=["10.244.3.7"],
                        interface="veth1", mac="aa:bb:cc:dd:ee:ff", bridge="cni0", ifname="eth0")


def test_a_symlink_at_endpoints_is_refused_and_nothing_is_done_where_it_points(tmp_path, monkeypatch):
    """Review s55 r1 #2: the agent's user owns dataDir and may put a symlink where endpoints/
    was (to /etc/cni/net.d, whose *.json the runtime reads as network configs).  Root's plugin
    writes, locks, reads and unlinks in endpoints/ only as a directory opened without following
    a symlink: ADD and DEL fail (IO_FAILURE) and the symlink's target is left as it was."""
    from agentd.cni import endpoints as eps

    calls = []
    _delegate_seeing(monkeypatch, calls)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    conf = _conf(tmp_path, policyTimeout=0)
    data = tmp_path / "state"
    data.mkdir()
    netd = tmp_path / "net.d"
    netd.mkdir()
    (data / eps.SUBDIR).symlink_to(netd)
    with pytest.raises(NotADirectoryError):
        eps.write(str(data), _endpoint())
    assert os.listdir(netd) == []
    _assert_error(_run(_env(CNI_ARGS=POD_ARGS), conf), 5, "endpoint file")
    assert os.listdir(netd) == []
    (netd / "c0ffee01.json").write_text(_endpoint().to_json())  # a file of that name there
    assert eps.read(str(data), "c0ffee01") is None  # (CHECK reads it)
    with pytest.raises(NotADirectoryError):
        eps.remove(str(data), "c0ffee01")
    _assert_error(_run(_env("DEL"), conf), 5, "endpoint file", str(data / eps.SUBDIR))
    old = _file(netd / ".c0ffee01.abcd1234", 1000.0)  # a name the sweep removes in endpoints/
    assert cni.sweep_temp_files(str(data), 1e12) == []
    assert sorted(os.listdir(netd)) == [old.name, "c0ffee01.json"]


def test_a_symlink_at_programmed_is_refused_and_nothing_is_unlinked_where_it_points(tmp_path):
    """endpoints/.programmed is in a directory of the agent's user's too: a symlink there to the
    plugin's state directory would have ADD unlink the container's state file (its DEL would
    then undo with the current config)."""
    from agentd.cni import endpoints as eps

    data = tmp_path / "state"
    cni.save_state(str(data), "c0ffee01", {"type": "bridge"}, "eth0")
    (data / eps.SUBDIR).mkdir()
    (data / eps.SUBDIR / eps.PROGRAMMED).symlink_to(data / cni.STATE_SUBDIR)
    with pytest.raises(NotADirectoryError):
        eps.write(str(data), _endpoint())
    with pytest.raises(NotADirectoryError):
        eps.remove(str(data), "c0ffee01")
    assert cni.load_state(str(data), "c0ffee01") == {"type": "bridge"}


def test_a_lock_root_did_not_make_is_not_given_away_nor_waited_on(tmp_path, caplog):
    """endpoints/.lock is in the agent's user's directory: root makes it LOCK_MODE and gives it
    to that user only when it is an empty regular file of one link (not a hard link to a file of
    root's elsewhere, nor a file of root's moved there); a FIFO in its place is never opened
    for a wait (ADD and DEL go on without the lock)."""
    import stat as stat_mod

    from agentd.cni import endpoints as eps

    directory = tmp_path / eps.SUBDIR
    directory.mkdir()
    elsewhere = tmp_path / "shadow"
    elsewhere.write_text("")
    os.chmod(elsewhere, 0o644)
    os.link(elsewhere, directory / eps.LOCK)
    eps.write(str(tmp_path), _endpoint())
    assert stat_mod.S_IMODE(os.stat(elsewhere).st_mode) == 0o644
    os.unlink(directory / eps.LOCK)
    moved = directory / eps.LOCK
    moved.write_text(_endpoint().to_json())  # a file of root's the user moved in: not empty
    os.chmod(moved, 0o644)
    eps.remove(str(tmp_path), "c0ffee01")
    assert stat_mod.S_IMODE(os.stat(moved).st_mode) == 0o644
    os.unlink(moved)
    os.mkfifo(moved, 0o600)
    eps.write(str(tmp_path), _endpoint())  # no wait on the FIFO
    assert eps.read(str(tmp_path), "c0ffee01") is not None
    eps.remove(str(tmp_path), "c0ffee01")
    assert "no regular file" in caplog.text


def test_a_fifo_in_an_endpoint_files_place_is_no_endpoint_file_and_no_wait(tmp_path):
    from agentd.cni import endpoints as eps

    (tmp_path / eps.SUBDIR).mkdir()
    os.mkfifo(tmp_path / eps.SUBDIR / "c0ffee01.json")
    assert eps.read(str(tmp_path), "c0ffee01") is None


# --- a pod's labels: bounded ----------------------------------------------------------------


def _labels_of(size: int) -> dict[str, str]:
    """Labels of exactly ``size`` bytes as ADD counts them (key + value + 8 each)."""
    labels = {}
    while size:
        key = f"k{len(labels):04d}"
        value = "v" * min(63, size - len(key) - 8)
        if size - len(key) - len(value) - 8 in range(1, 14):  # leave the last label room for a key
            value = value[:-14]
        labels[key] = value
        size -= len(key) + len(value) + 8
    return labels


def _cni_process(env: dict[str, str], conf: dict, timeout: float = 60) -> tuple[int, dict]:
    """agentd-cni as the runtime runs it: the console script's function in a process of its
    own, the network config on its stdin, the result on its stdout."""
    import subprocess
    import sys

    root = pathlib.Path(cni.__file__).resolve().parents[2]  # this tree's agentd, not an installed one
    proc = subprocess.run([sys.executable, "-c", "import sys; from agentd.entry import agentd_cni; sys.exit(agentd_cni())"],
                          input=json.dumps(conf).encode(), capture_output=True, timeout=timeout, check=False,
                          env={**env, "PYTHONPATH": str(root), "PATH": os.environ.get("PATH", "")})
    assert "Traceback" not in proc.stderr.decode(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_add_refuses_a_pod_with_more_labels_than_it_takes(tmp_path):
    """A pod's labels from runtimeConfig and args.cni were taken however many, however large,
    into the endpoint file, the agent's pod record and its tables.  Past LABELS_MAX bytes (what a
    flow record carries of a pod's labels) ADD is one CNI error, before anything is set up: not
    the labels cut, which would leave policies selecting the pod as another one."""
    from agentd.cni import endpoints

    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    (tmp_path / "bin").mkdir()  # no delegate: the refusal comes before it is looked for
    env = _env(CNI_ARGS="K8S_POD_NAMESPACE=default;K8S_POD_NAME=web", CNI_PATH=str(tmp_path / "bin"))
    labels = _labels_of(endpoints.LABELS_MAX + 1)
    assert sum(len(k) + len(v) + 8 for k, v in labels.items()) == endpoints.LABELS_MAX + 1
    listed = list(labels.items())[:100]  # a part through each way a runtime passes them
    conf = _conf(tmp_path, policyTimeout=0, runtimeConfig={"labels": dict(list(labels.items())[100:])},
                 args={"cni": {"labels": [{"key": k, "value": v} for k, v in listed]}})
    code, out = _cni_process(env, conf)
    assert code == 1 and out["code"] == 7 and out["cniVersion"] == "1.0.0", out
    assert out["msg"] == (f"pod identity: labels: Too long: {len(labels)} labels of {endpoints.LABELS_MAX + 1} bytes "
                          f"(key + value + 8 each), more than the {endpoints.LABELS_MAX} a pod may have here"), out
    assert not (tmp_path / "state").exists()
    thousands = {f"app{i}": "x" for i in range(100_000)}  # each label small, too many of them
    code, out = _cni_process(env, _conf(tmp_path, runtimeConfig={"labels": thousands}))
    assert code == 1 and out["code"] == 7 and "100000 labels of" in out["msg"], out


def test_check_of_a_pod_added_with_more_labels_than_add_takes_now_succeeds(tmp_path, monkeypatch):
    """A pod ADDed before LABELS_MAX (by an older agentd-cni) with more labels: CHECK, which
    the runtime passes the same labels, succeeds (a failed CHECK may get the pod torn down);
    only ADD refuses them."""
    from agentd.cni import endpoints

    calls = []
    _fake_delegate(monkeypatch, calls)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    args = "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web"
    labels = _labels_of(17 << 10)
    conf = _conf(tmp_path, policyTimeout=0, runtimeConfig={"labels": labels})
    with monkeypatch.context() as before_the_upgrade:
        before_the_upgrade.setattr(endpoints, "LABELS_MAX", 1 << 30)
        code, result = _run(_env(CNI_ARGS=args), conf)
    assert code == 0 and result is not None, result
    assert endpoints.read(str(tmp_path / "state"), "c0ffee01").labels == labels
    prev = dict(result, cniVersion="1.0.0")
    check = _conf(tmp_path, prevResult=prev, runtimeConfig={"labels": labels})
    assert _run(_env("CHECK", CNI_ARGS=args), check) == (0, None)
    _assert_error(_run(_env(CNI_ARGS=args, CNI_CONTAINERID="c0ffee02"), conf), 7, "labels: Too long")


def test_add_takes_a_pods_labels_to_the_bound_whole(tmp_path, monkeypatch, capsys):
    """LABELS_MAX bytes of labels: every one in the endpoint file (and so in every flow record)."""
    import io
    import sys

    from agentd.cni import endpoints
    from agentd.flows.model import LABELS_MAX, record_labels

    calls = []
    _fake_delegate(monkeypatch, calls)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    labels = _labels_of(endpoints.LABELS_MAX)
    conf = _conf(tmp_path, policyTimeout=0, runtimeConfig={"labels": labels})
    monkeypatch.setattr(os, "environ", _env(CNI_ARGS="K8S_POD_NAMESPACE=default;K8S_POD_NAME=web"))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(json.dumps(conf).encode())))
    assert cni.main() == 0, capsys.readouterr()
    assert json.loads(capsys.readouterr().out)["ips"]
    assert endpoints.read(str(tmp_path / "state"), "c0ffee01").labels == labels
    assert endpoints.LABELS_MAX == LABELS_MAX and record_labels(labels) == (labels, 0)


# --- CHECK and DEL through the plugin, the delegate run for real, bounded messages -------------


def test_check_through_the_plugin_fails_once_the_nodes_subnet_moved_away(tmp_path, monkeypatch):
    """CHECK's own check, not the delegate's: the pod's address inside the node's subnet as the
    subnet file gives it now (a node that lost its lease has another)."""
    calls = []
    _fake_delegate(monkeypatch, calls)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    code, result = _run(_env(CNI_ARGS=POD_ARGS), _conf(tmp_path, policyTimeout=0))
    assert code == 0 and result is not None, result
    check = _conf(tmp_path, policyTimeout=0, prevResult=result)
    assert _run(_env("CHECK", CNI_ARGS=POD_ARGS), check) == (0, None)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF_NOW)
    out = _assert_error(_run(_env("CHECK", CNI_ARGS=POD_ARGS), check), 999,
                        "pod address 10.244.3.7 is outside this node's IPv4 pod subnet (10.244.4.0/24)")
    assert "lost lease" in out["details"]
    assert calls == [("ADD", "c0ffee01"), ("CHECK", "c0ffee01"), ("CHECK", "c0ffee01")]  # the delegate's passed


def test_check_through_the_plugin_fails_once_the_pods_endpoint_file_is_gone(tmp_path, monkeypatch):
    """The endpoint file is what the agent programs the pod's network policy from."""
    calls = []
    _fake_delegate(monkeypatch, calls)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    code, result = _run(_env(CNI_ARGS=POD_ARGS), _conf(tmp_path, policyTimeout=0))
    assert code == 0 and result is not None, result
    check = _conf(tmp_path, policyTimeout=0, prevResult=result)
    assert _run(_env("CHECK", CNI_ARGS=POD_ARGS), check) == (0, None)
    (tmp_path / "state" / "endpoints" / "c0ffee01.json").unlink()
    _assert_error(_run(_env("CHECK", CNI_ARGS=POD_ARGS), check), 999,
                  "the endpoint file of container c0ffee01 is missing or unreadable")


def test_del_retries_with_the_current_config_when_the_delegate_rejects_the_stored_one(tmp_path, monkeypatch, capsys):
    """An ADD with a broken config stored it; the delegate rejects it at DEL too.  Once the
    network config is fixed DEL succeeds with it (the runtime retries DEL until it does)."""
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    conf = _conf(tmp_path, policyTimeout=0)
    current = cni_config.delegate_config(conf, SF)
    stored = dict(current, vlan=5000)
    seen = []

    def invoke(conf, args, env, timeout):
        seen.append(conf)
        if conf.get("vlan") == 5000 or fixed is False:
            raise cni.CniError(999, f"invalid VLAN ID {conf.get('vlan')} (must be between 0 and 4094)")

    monkeypatch.setattr(cni, "invoke_delegate", invoke)
    monkeypatch.setattr(cni, "find_plugin", lambda plugin_type, path: "/fake/" + plugin_type)
    state = tmp_path / "state" / cni.STATE_SUBDIR / "c0ffee01"
    cni.save_state(str(tmp_path / "state"), "c0ffee01", stored, "eth0")
    fixed = False  # the current config fails as well: the stored config's error, the file kept
    _assert_error(_run(_env("DEL"), conf), 999, "invalid VLAN ID 5000")
    assert seen == [stored, current] and state.exists()
    seen.clear()
    capsys.readouterr()
    fixed = True
    assert _run(_env("DEL"), conf) == (0, None)
    assert seen == [stored, current] and not state.exists()
    assert ("agentd-cni: DEL with the stored config failed (invalid VLAN ID 5000 (must be between 0 and 4094)); "
            "retrying with the current one") in capsys.readouterr().err


def test_a_nameserver_the_delegate_returned_is_kept(tmp_path, monkeypatch):
    """The node's DNS goes into the result only where the delegate named no nameserver."""
    answer = {"cniVersion": "1.0.0", "interfaces": [{"name": "cni0"}, {"name": "veth1", "mac": "bb"}],
              "ips": [{"address": "10.244.3.7/24"}]}  # fmt: skip

    def invoke(conf, args, env, timeout):
        return json.loads(json.dumps(answer))

    monkeypatch.setattr(cni, "invoke_delegate", invoke)
    monkeypatch.setattr(cni, "find_plugin", lambda plugin_type, path: "/fake/" + plugin_type)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), dataclasses.replace(SF, dns=IPv4Address("169.254.20.10")))
    conf = _conf(tmp_path, policyTimeout=0)
    code, result = _run(_env(), conf)
    assert code == 0 and result["dns"]["nameservers"] == ["169.254.20.10"], result
    answer["dns"] = {"nameservers": ["1.1.1.1"]}
    code, result = _run(_env(CNI_CONTAINERID="c0ffee02"), conf)
    assert code == 0 and result["dns"] == {"nameservers": ["1.1.1.1"]}, result


def _script_delegate(tmp_path: pathlib.Path, body: str) -> str:
    """A ``bridge`` in a directory of its own that reads its config and runs ``body`` (sh)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "bridge"
    exe.write_text("#!/bin/sh\ncat >/dev/null\n" + body)
    exe.chmod(0o755)
    return str(bin_dir)


@pytest.mark.parametrize("error", [
    {"cniVersion": "1.0.0", "code": 11, "msg": "host-local: no IP addresses available in range set",
     "details": "try again later"},
    {"cniVersion": "0.4.0", "code": 999, "msg": "failed to create bridge \"cni0\": no such device"},  # no details
])
def test_a_delegates_own_cni_error_is_passed_through_unchanged(tmp_path, error):
    """host-local's "try again later" (11) must reach the runtime as host-local said it."""
    bin_dir = _script_delegate(tmp_path, f"echo '{json.dumps(error)}'\nexit 1\n")
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    assert _run(_env(CNI_PATH=bin_dir), _conf(tmp_path, policyTimeout=0)) == (1, error)


def _gone(pid: int) -> bool:
    """The process ``pid`` has ended (no such process, or a zombie not reaped yet)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_a_timed_out_delegate_is_killed_with_what_it_started(tmp_path):
    """The delegate and what it started (host-local under bridge) go at delegateTimeout: a
    child of the delegate's that holds its stdout would keep ADD waiting for ever were only the
    delegate killed.  The plugin runs in a process of its own, bounded: a regression fails here."""
    import signal
    import subprocess
    import time

    pids = tmp_path / "pids"
    bin_dir = _script_delegate(tmp_path, f"sleep 600 &\necho $$ $! > {pids}\nexec sleep 600\n")
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    start = time.monotonic()
    try:
        code, out = _cni_process(_env(CNI_PATH=bin_dir), _conf(tmp_path, policyTimeout=0, delegateTimeout=0.2),
                                 timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("ADD with a hung delegate did not return within 20 s")
    finally:
        if pids.exists():  # the delegate's session (it leads its process group): whatever is left
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pids.read_text().split()[0]), signal.SIGKILL)
    assert time.monotonic() - start < 15
    assert code == 1 and out["code"] == 999 and out["msg"] == "delegate bridge did not finish ADD within 0.2 s", out
    assert all(_gone(int(pid)) for pid in pids.read_text().split())  # the shell and its background child


MB = 1 << 20


@pytest.mark.parametrize(("command", "env", "conf", "word"), [
    ("ADD", {"CNI_COMMAND": "X" * MB}, {}, "unknown CNI_COMMAND"),
    ("ADD", {"CNI_CONTAINERID": "-" * MB}, {}, "invalid characters in CNI_CONTAINERID"),
    ("DEL", {"CNI_CONTAINERID": "-" * MB}, {}, "invalid characters in CNI_CONTAINERID"),
    ("ADD", {"CNI_CONTAINERID": "a" * MB}, {}, "is longer than 200 bytes"),
    ("ADD", {"CNI_IFNAME": "x" * MB}, {}, "invalid CNI_IFNAME"),
    ("DEL", {"CNI_IFNAME": "x" * MB}, {}, "invalid CNI_IFNAME"),
    ("ADD", {}, {"name": "-" * MB}, "invalid characters in network name"),
    ("ADD", {}, {"cniVersion": ["x" * MB]}, "cniVersion must be a string"),
    ("ADD", {}, {"cniVersion": "x" * MB}, "incompatible CNI versions"),
    ("ADD", {}, {"delegate": {"type": "/" * MB}}, "'delegate.type' must be a plugin name"),
    ("ADD", {}, {"ipam": {"type": "/" * MB}}, "'ipam.type' must be a plugin name"),
    ("ADD", {}, {"dataDir": "x" * MB}, "'dataDir' must be an absolute path"),
    ("DEL", {}, {"subnetFile": "x" * MB}, "'subnetFile' must be an absolute path"),
    ("ADD", {}, {"delegate": {"type": "b" * MB}}, "not found in CNI_PATH"),
    ("ADD", {}, {"binDir": ["/" + "d" * MB]}, "not found in CNI_PATH"),
])
def test_error_messages_are_bounded_whatever_the_value(tmp_path, command, env, conf, word):
    """A CNI error is one line the runtime logs and shows (kubelet's events): a megabyte of a bad
    value in the environment or the config is cut, never repeated whole."""
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    outcome = _run(_env(command, **env), _conf(tmp_path, policyTimeout=0, **conf))
    out = _assert_error(outcome, outcome[1]["code"], word, version="1.0.0")
    assert len(out["msg"]) < 300 and len(out["details"]) < 300, (len(out["msg"]), len(out["details"]))


@pytest.mark.parametrize(("args", "said"), [
    (["--key", "not a name"], "--key 'not a name' is not a variable name"),
    (["--individual", "--format", "json"], "--individual writes variables: it goes with --format env, not json"),
    (["--output", ""], "--output: empty path"),
])
def test_docker_opts_names_a_bad_argument_before_it_reads_the_subnet_file(tmp_path, capsys, args, said):
    """A unit's ExecStartPre runs before the agent has written the subnet file: a bad flag is
    named then (exit 2), not reported as the missing file (exit 1)."""
    from agentd.cli import main

    assert main(["docker-opts", "--subnet-file", str(tmp_path / "none.env"), *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"agentd docker-opts: {said}") and "subnet file" not in err, err


def _as_libcni_hands_it(doc: dict, index: int, capability_args: dict) -> dict:
    """The conflist entry ``index`` as libcni gives it to its plugin (buildOneConfig and
    injectRuntimeConfig, libcni/api.go): name and cniVersion of the list, and in runtimeConfig
    only the runtime's capability arguments the entry declares."""
    entry = doc["plugins"][index]
    conf = {**entry, "name": doc["name"], "cniVersion": doc["cniVersion"]}
    runtime = {k: v for k, v in capability_args.items() if (entry.get("capabilities") or {}).get(k) is True}
    if runtime:
        conf["runtimeConfig"] = runtime
    return conf


def test_the_conflist_declares_the_capabilities_agentd_cni_reads(tmp_path, monkeypatch):
    """libcni passes a runtimeConfig key only to a plugin whose conflist entry declares it as a
    capability: agentd-cni's entry declares the keys it reads (labels, containerPorts, mac), so
    a runtime's labels, named ports and MAC reach the endpoint file (and the MAC the bridge
    delegate, which sets it), and none of the others' (portmap's, bandwidth's; ipRanges would
    have host-local put the runtime's ranges before the node's subnet)."""
    from agentd.cni import endpoints

    path = cni_config.write_conflist(str(tmp_path / "net.d"), subnet_file=str(tmp_path / "subnet.env"),
                                     data_dir=str(tmp_path / "state"), ipam_data_dir=str(tmp_path / "ipam"))
    doc = json.loads(pathlib.Path(path).read_text())
    assert doc["plugins"][0]["capabilities"] == {"labels": True, "containerPorts": True, "mac": True}
    mac = "02:42:0a:f4:03:07"
    capability_args = {  # what containerd, CRI-O, podman or Multus may pass
        "portMappings": [{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"}],
        "bandwidth": {"ingressRate": 10_000_000, "ingressBurst": 1_000_000},
        "ipRanges": [[{"subnet": "10.1.0.0/24"}]],
        "dns": {"servers": ["10.96.0.10"]},
        "io.kubernetes.cri.pod-annotations": {"a": "b"},
        "labels": {"app": "web"},
        "containerPorts": [{"name": "http", "containerPort": 80, "protocol": "TCP"}],
        "mac": mac,
    }
    confs = [_as_libcni_hands_it(doc, i, capability_args) for i in range(len(doc["plugins"]))]
    assert [c.get("runtimeConfig") for c in confs[1:]] == [{"portMappings": capability_args["portMappings"]},
                                                           {"bandwidth": capability_args["bandwidth"]}]
    seen = []

    def invoke(conf, args, env, timeout):
        seen.append(conf)
        return {"cniVersion": "1.0.0", "interfaces": [{"name": "cni0"}, {"name": "veth1", "mac": "bb"},
                                                      {"name": "eth0", "sandbox": args.netns, "mac": mac}],
                "ips": [{"address": "10.244.3.7/24", "interface": 2}]}  # fmt: skip

    monkeypatch.setattr(cni, "invoke_delegate", invoke)
    monkeypatch.setattr(cni, "find_plugin", lambda plugin_type, path: "/fake/" + plugin_type)
    cni_config.write_subnet_file(str(tmp_path / "subnet.env"), SF)
    code, result = _run(_env(CNI_ARGS=POD_ARGS), dict(confs[0], policyTimeout=0))
    assert code == 0, result
    assert seen[0]["runtimeConfig"] == {k: capability_args[k] for k in ("labels", "containerPorts", "mac")}
    assert seen[0]["ipam"]["subnet"] == "10.244.3.0/24" and "ranges" not in seen[0]["ipam"]
    ep = endpoints.read(str(tmp_path / "state"), "c0ffee01")
    assert (ep.labels, [p["name"] for p in ep.ports], ep.pod_mac) == ({"app": "web"}, ["http"], mac)
