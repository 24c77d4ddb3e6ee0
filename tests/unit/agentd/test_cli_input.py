"""Bad input to the agentd command line gives one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentd import cli
from agentd.cli import seconds_arg as _seconds
from agentd.lab.lab import Lab, LabError


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as e:  # argparse errors
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (("check-config", "--config", ""), "--config: empty path"),
        (("check-config", "--set", ".=1"), "expected SECTION.KEY=VALUE"),
        (("check-config", "--set", "bgp.=1"), "expected SECTION.KEY=VALUE"),
        (("check-config", "--config", "/dev/zero"), "not a regular file"),
        (("check-config", "--set", "api.listen=127.0.0.1:0"), "needs a fixed port"),
        (("check-config", "--set", "etcd.endpoints=http://etcd:0"), "must have a port 1..65535"),
        (("check-config", "--set", "network.cidr=0.0.0.0/0"), "pods cannot use"),
        (("check-config", "--set", "network.cidr=224.1.0.0/16"), "pods cannot use"),
        (("status", "--api", "http://127.0.0.1:abc"), "agentd status: --api 'http://127.0.0.1:abc': the port must be a number 1..65535"),
        # http.client would take 74635 as 74635 % 65536 = 9099: someone else's port gets the key
        (("flows", "--api", "http://127.0.0.1:74635"), "agentd flows: --api 'http://127.0.0.1:74635': the port must be a number 1..65535 (Port out of range"),
        (("status", "--api", "http://127.0.0.1:0"), "the port must be a number 1..65535, not 0"),
        (("flows", "--api", "ftp://127.0.0.1:9099"), "expected http://HOST[:PORT] or https://HOST[:PORT]"),
        (("flows", "--api", "127.0.0.1:9099"), "expected http://HOST[:PORT]"),
        (("status", "--api", "http://:9099"), "agentd status: --api 'http://:9099': no host"),
        (("status", "--api", "http://a b:1"), "cannot reach the agent"),
        (("leave", "--timeout", "soon"), "invalid number of seconds 'soon'"),
        (("leave", "--timeout", "0"), "0 is out of range 1..3600 seconds"),
        (("leave", "--timeout", "nan"), "nan is out of range 1..3600 seconds"),
    ],
)
def test_bad_arguments_give_one_line(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")})
    code, out, err = run(capsys, *argv)
    assert code not in (0, None) and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("command", ["status", "flows"])
@pytest.mark.parametrize("url, shown", [
    ("http://admin:s3cret@127.0.0.1:9099", "http://***@127.0.0.1:9099"),
    ("https://admin:s3cret@127.0.0.1", "https://***@127.0.0.1"),
    ("http://admin:s3cret@127.0.0.1:99999", "http://***@127.0.0.1:99999"),
    ("http://admin:s3/cret@127.0.0.1:9099", "http://***@127.0.0.1:9099"),  # (its port would be "s3")
    ("http://s3cret@127.0.0.1:9099", "http://***@127.0.0.1:9099"),
])
def test_an_api_url_with_a_password_is_refused_without_showing_it(capsys, monkeypatch, command, url, shown):
    """`--api http://user:pw@host` passed the URL's check, then failed looking up the name
    "user:pw@host" ("Name or service not known"), the password in the message."""
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")})
    code, out, err = run(capsys, command, "--api", url)
    assert (code, out) == (2, "") and "s3" not in err and "cret" not in err, err
    assert err == (f"agentd {command}: --api {shown!r}: a user or password in the URL is not for the agent's "
                   "API, whose key comes from [api] token_file: leave it out\n")


def test_a_bad_api_url_is_a_usage_error(capsys):
    code, out, err = run(capsys, "flows", "--api", "http://127.0.0.1:65536")
    assert (code, out) == (2, "") and err.startswith("agentd flows: --api 'http://127.0.0.1:65536': the port must be")


@pytest.mark.parametrize("argv, message", [
    (("--verison",), "agentd: unrecognized arguments: --verison (see agentd --help)\n"),
    (("--bogus", "-x"), "agentd: unrecognized arguments: --bogus -x (see agentd --help)\n"),
    (("--bogus=1",), "agentd: unrecognized arguments: --bogus=1 (see agentd --help)\n"),
    ((), "agentd: the following arguments are required: COMMAND (see agentd --help)\n"),
])
def test_a_mistyped_top_level_option_is_named(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert (code, out, err) == (2, "", message)


def test_fifo_config_is_refused_not_waited_on(capsys, tmp_path):
    fifo = tmp_path / "agentd.toml"
    os.mkfifo(fifo)
    code, _, err = run(capsys, "check-config", "--config", str(fifo))
    assert code == 1 and "not a regular file" in err


def test_env_section_typo_is_an_error(capsys, monkeypatch, tmp_path):
    (tmp_path / "agentd.toml").write_text("")
    monkeypatch.setenv("AGENTD_BPG_HOLD_TIME", "30")
    code, _, err = run(capsys, "check-config", "--config", str(tmp_path / "agentd.toml"))
    assert code == 1 and "did you mean AGENTD_BGP_HOLD_TIME" in err


def test_peer_description_must_be_printable(capsys, tmp_path):
    conf = tmp_path / "agentd.toml"
    conf.write_text('[[bgp.peers]]\naddress = "192.0.2.1"\nasn = 1\ndescription = "a\\u001b[31m"\n')
    code, _, err = run(capsys, "check-config", "--config", str(conf))
    assert code == 1 and "must be printable" in err


@pytest.mark.parametrize(
    "reply",
    [[], "hello", {}, {"node": "x"}, {"node": {}, "bgp": {"peers": [{}]}}, {"node": {}, "bgp": {"peers": "x"}},
     {"node": {}, "routes": {"last_sync": "abc"}}, {"node": {}, "routes": {"last_sync": 1e300}},
     {"node": {}, "flows": {"on": True, "lost": "x"}},
     {"node": {}, "routes": {"last_sync": 1e18}},  # time_t holds it, the year does not: EOVERFLOW
     {"node": {}, "bgp": {"peers": [{"address": "10.0.0.2", "since": 1e18}]}}],
)
def test_status_with_an_unexpected_reply_is_one_line(capsys, monkeypatch, reply):
    monkeypatch.setattr(cli, "fetch_json", lambda url, timeout=5.0: reply)
    code, _, err = run(capsys, "status", "--api", "http://127.0.0.1:9099")
    assert code == 1 and "did not answer with an agentd status" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("reply", [[1], [], "hello", None, 3, {}, {"node": "x"}, {"nodes": {}}])
def test_status_json_refuses_what_is_no_agentd_status(capsys, monkeypatch, reply):
    """`agentd status --json` printed whatever JSON answered and exited 0 (the text mode's
    check of the answer's shape came after it): a script took any server for an agent."""
    monkeypatch.setattr(cli, "fetch_json", lambda url, timeout=5.0: reply)
    code, out, err = run(capsys, "status", "--json", "--api", "http://127.0.0.1:9099")
    assert (code, out) == (1, "")
    assert err == "agentd status: http://127.0.0.1:9099/status did not answer with an agentd status (no 'node' object)\n"
    monkeypatch.setattr(cli, "fetch_json", lambda url, timeout=5.0: {"node": {"name": "n1"}, "x": [1]})
    code, out, err = run(capsys, "status", "--json", "--api", "http://127.0.0.1:9099")
    assert (code, err) == (0, "") and json.loads(out) == {"node": {"name": "n1"}, "x": [1]}


def test_status_with_json_nested_too_deep_is_one_line(capsys, monkeypatch):
    def deep(url, timeout=5.0):
        raise RecursionError("maximum recursion depth exceeded while decoding a JSON object")

    monkeypatch.setattr(cli, "fetch_json", deep)
    code, _, err = run(capsys, "status", "--api", "http://127.0.0.1:9099")
    assert code == 1 and "not with JSON" in err and len(err.strip().splitlines()) == 1


def test_a_listen_range_password_is_never_shown(capsys, monkeypatch, tmp_path):
    """A bad [[bgp.listen_ranges]] given in the environment or with --set: the error names
    where it came from, never the password in it (as for [[bgp.peers]])."""
    bad = '[{"password": "s3cret-pw", "prefix": "x", "asn": 1}]'
    monkeypatch.setenv("AGENTD_BGP_LISTEN_RANGES", bad)
    code, _, err = run(capsys, "check-config", "--config", str(tmp_path / "none.toml"))
    assert code == 1 and "AGENTD_BGP_LISTEN_RANGES" in err and "s3cret-pw" not in err
    monkeypatch.delenv("AGENTD_BGP_LISTEN_RANGES")
    code, _, err = run(capsys, "check-config", "--config", str(tmp_path / "none.toml"), "--set", f"bgp.listen_ranges={bad}")
    assert code == 1 and "--set bgp.listen_ranges" in err and "s3cret-pw" not in err


def test_a_shell_that_sourced_the_subnet_file_can_run_every_command(capsys, monkeypatch, tmp_path):
    """Every line the agent writes into the subnet file (write_cni_files: netconf's keys, then
    AGENTD_WRITE_CONFLIST and AGENTD_MASQUERADE) is taken for no configuration key: a shell
    that sourced it (or a unit's EnvironmentFile=) was refused every command ("unknown
    section [write]")."""
    from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

    from agent_config import agent_cfg

    from agentd.cni import docker_opts, netconf
    from agentd.config.settings import SUBNET_FILE_NAMES
    from agentd.daemon import node_files
    from agentd.datastore.records import ClusterConfig, SubnetLease

    assert SUBNET_FILE_NAMES == set(netconf._KEYS) | {docker_opts.WRITE_CONFLIST_KEY, docker_opts.MASQUERADE_KEY}
    cfg = agent_cfg(tmp_path, **{"cni.write_conflist": False, "dns.enabled": True})
    cluster = ClusterConfig(IPv4Network("10.244.0.0/16"), 24, "host-gw", "always", ip_family="dual",
                            cidr_v6=IPv6Network("fd00:10:244::/56"), subnet_len_v6=64)
    node_files.write_cni_files(cfg, cluster, {
        4: SubnetLease(IPv4Network("10.244.3.0/24"), "n1", IPv4Address("10.1.1.1"), "host-gw"),
        6: SubnetLease(IPv6Network("fd00:10:244:3::/64"), "n1", IPv6Address("fd00::1"), "host-gw")}, 1450)
    written = dict(line.split("=", 1) for line in Path(cfg.cni.subnet_file).read_text().splitlines())
    assert {"AGENTD_WRITE_CONFLIST", "AGENTD_MASQUERADE", "AGENTD_IPV6_SUBNET"} <= set(written), written
    for name, value in written.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "agentd.toml").write_text("")
    code, _, err = run(capsys, "check-config", "--config", str(tmp_path / "agentd.toml"))
    assert code == 0, err


def test_check_config_shows_the_log_level_given(capsys, tmp_path):
    (tmp_path / "agentd.toml").write_text("")
    code, out, _ = run(capsys, "check-config", "--config", str(tmp_path / "agentd.toml"), "--log-level", "debug", "--show")
    assert code == 0 and json.loads(out)["log"]["level"] == "debug"


def test_status_escapes_control_characters_from_the_agent(capsys, monkeypatch):
    reply = {"node": {"name": "n1"}, "bgp": {"peers": [
        {"address": "10.0.0.2", "description": "tor\n\x1b[31mred", "state": "Active", "info": "x\ny"}]}}
    monkeypatch.setattr(cli, "fetch_json", lambda url, timeout=5.0: reply)
    code, out, _ = run(capsys, "status")
    assert code == 0 and "\x1b" not in out and "tor\\n\\x1b[31mred" in out


@pytest.mark.parametrize("state", ["{}", "[]", '{"spec": "x"}', '{"spec": {"name": "c3", "bogus": 1}}',
                                   '{"spec": {"name": "c4", "nodes": "abc"}}'])
def test_corrupt_lab_state_is_a_lab_error(tmp_path, state):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "lab.json").write_text(state)
    with pytest.raises(LabError, match="not a lab state file"):
        Lab.load("c", tmp_path)


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "abc", "4000"])
def test_lab_timeout_must_be_sane(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        _seconds(text)
    assert _seconds("90") == 90.0


def test_check_config_without_a_file_says_so(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "DEFAULT_CONFIG_PATH", str(tmp_path / "absent.toml"))
    code, out, _ = run(capsys, "check-config")
    assert code == 0 and "no such file" in out


@pytest.mark.parametrize(
    "peer, message",
    [
        ('address = "255.255.255.255"', "must be a unicast address"),
        ('address = "fe80::1%eth0"', "%zone"),
        ('address = "224.0.0.5"', "must be a unicast address"),
    ],
)
def test_peer_addresses_must_be_usable(capsys, tmp_path, peer, message):
    conf = tmp_path / "agentd.toml"
    conf.write_text(f"[[bgp.peers]]\n{peer}\nasn = 1\n")
    code, _, err = run(capsys, "check-config", "--config", str(conf))
    assert code == 1 and message in err, err


def test_a_peer_written_twice_in_two_spellings_is_caught(capsys, tmp_path):
    conf = tmp_path / "agentd.toml"
    conf.write_text('[[bgp.peers]]\naddress = "192.0.2.1"\nasn = 1\n[[bgp.peers]]\naddress = "::ffff:192.0.2.1"\nasn = 1\n')
    code, _, err = run(capsys, "check-config", "--config", str(conf))
    assert code == 1 and "192.0.2.1" in err


@pytest.mark.parametrize("value, message", [("zzz", "must be an IPv6 address"), ("::1", "no ::1")])
def test_next_hop_v6_must_be_a_usable_ipv6_address(capsys, value, message):
    code, _, err = run(capsys, "check-config", "--set", f"bgp.next_hop_v6={value}")
    assert code == 1 and message in err, err


def test_cluster_id_out_of_range_says_so(capsys, monkeypatch):
    monkeypatch.setenv("AGENTD_NODE_CLUSTER_ID", "99999999999")
    code, _, err = run(capsys, "check-config", "--config", os.devnull)
    assert code == 1 and "out of range" in err, err


@pytest.mark.parametrize("fast, line", [
    ({"on": True, "pods": 3, "packets": {"carried": 1234}, "between_nodes": {"on": True}},
     "Pod fast path on, same node and between nodes  carried 1234 packets  pods 3"),
    ({"on": True, "pods": 4, "packets": {"carried": 9}, "between_nodes": {"on": True},
      "ipv6": {"pods": 2, "cluster": "fd00:10:244::/48", "packets": {"carried": 77}}},
     "Pod fast path on, same node and between nodes  carried 9 packets  pods 4 (IPv6: carried 77, pods 2)"),
    ({"on": True, "pods": 1, "packets": {}, "between_nodes": {"on": False, "why_not": "no tcx\n"}},
     "Pod fast path on, same node only (between nodes: no tcx\\n)  carried 0 packets  pods 1"),
    ({"on": False, "error": "switched off ([network] bpf_pod_fast_path = false)"},
     "Pod fast path off: switched off ([network] bpf_pod_fast_path = false)"),
])  # fmt: skip
def test_status_says_what_the_pod_fast_path_does(capsys, monkeypatch, fast, line):
    reply = {"node": {"name": "n1"}, "bgp": {"peers": []}, "policy": {"isolated": {}, "fast_path": fast}}
    monkeypatch.setattr(cli, "fetch_json", lambda url, timeout=5.0: reply)
    code, out, _ = run(capsys, "status")
    assert code == 0 and line in out.splitlines()


@pytest.mark.parametrize("flows, line", [
    ({"on": True, "connections": True, "records": 812, "ring_size": 10000, "lost": {}},
     "Flows on: connections and drops  records 812 of 10000"),
    ({"on": True, "connections": False, "records": 3, "ring_size": 10000, "lost": {"log": 0}},
     "Flows on: drops only ([flows] connections = false)  records 3 of 10000"),
    ({"on": True, "connections": True, "records": 10000, "ring_size": 10000, "lost": {"conntrack": 5, "log": 2}},
     "Flows on: connections and drops  records 10000 of 10000  LOST 7 events"),
    ({"on": False, "error": "switched off ([flows] enabled = false)"}, "Flows off: switched off ([flows] enabled = false)"),
    ({"on": False, "error": None}, "Flows not on yet (starting)"),
    ({"on": False, "error": "flow records off: NFLOG group 143 is bound\nby another process"},
     "Flows off: flow records off: NFLOG group 143 is bound\\nby another process"),
])  # fmt: skip
def test_status_says_what_flow_records_keep(capsys, monkeypatch, flows, line):
    reply = {"node": {"name": "n1"}, "bgp": {"peers": []}, "flows": flows}
    monkeypatch.setattr(cli, "fetch_json", lambda url, timeout=5.0: reply)
    code, out, _ = run(capsys, "status")
    assert code == 0 and line in out.splitlines(), out


def test_status_shows_a_user_space_worker_that_is_down_with_its_error(capsys, monkeypatch):
    down = {"datapath": "userspace", "running": False, "worker_pid": None,
            "error": "could not be started again: [Errno 98] Address already in use"}
    reply = {"node": {"name": "n1"}, "bgp": {"peers": []},
             "backends": {"active": {"udp": down, "vxlan": {"datapath": "kernel"}, "ipip": {**down, "running": True, "error": None}},
                          "userspace_peers_worker": {"ipip": {**down, "error": None}}}}
    monkeypatch.setattr(cli, "fetch_json", lambda url, timeout=5.0: reply)
    code, out, _ = run(capsys, "status")
    lines = [line for line in out.splitlines() if "worker" in line]
    assert code == 0 and lines == [
        "Data-plane worker udp DOWN: could not be started again: [Errno 98] Address already in use",
        "Data-plane worker ipip for peers that receive in user space DOWN: not running"], out


def test_status_names_a_program_on_our_hooks_it_could_not_take_over(capsys, monkeypatch):
    line = "eth0 ingress (tcx): program 77, attached without a link, is not agentd's by any pin"
    reply = {"node": {"name": "n1"}, "bgp": {"peers": []}, "backends": {"bpf": {"unidentified_programs": [line]}},
             "policy": {"isolated": {}, "fast_path": {"on": True, "unidentified_programs": [line]}}}
    monkeypatch.setattr(cli, "fetch_json", lambda url, timeout=5.0: reply)
    code, out, _ = run(capsys, "status")
    assert code == 0 and out.splitlines().count(f"BPF: {line}") == 1, out


@pytest.mark.parametrize(
    "args, status, message",
    [
        (("--port", "http=80/TCP", "--host-port", "http=99999"), 2, "expected NAME=HOSTPORT (1-65535)"),
        (("--port", "http=80/TCP", "--host-port", "http"), 2, "expected NAME=HOSTPORT"),
        # digits str.isdigit() takes: int() reads "٣" as 3 (a port 3 nobody asked for), refuses "²"
        (("--port", "http=80/TCP", "--host-port", "http=\u0663"), 2, "expected NAME=HOSTPORT (1-65535)"),
        (("--port", "http=80/TCP", "--host-port", "http=\u00b2"), 2, "expected NAME=HOSTPORT (1-65535)"),
        (("--port", "http=80/TCP", "--host-port", "http=" + "9" * 5000), 2, "expected NAME=HOSTPORT (1-65535)"),
        (("--port", "http=\u0663/TCP",), 2, "expected NAME=PORT[/PROTO]"),
        (("--port", "http=\u00b2/TCP",), 2, "expected NAME=PORT[/PROTO]"),
        (("--port", "http=" + "9" * 5000,), 2, "expected NAME=PORT[/PROTO]"),
        (("--host-port", "http=8080"), 1, "no --port named 'http' (named ports: none)"),
        (("--port", "http=80/TCP", "--port", "alt=81/TCP", "--host-port", "http=8080", "--host-port", "alt=8080"), 1,
         "host port 8080/TCP is given twice"),
    ],
)  # fmt: skip
def test_lab_pod_host_ports_name_a_port(capsys, args, status, message):
    """`agentd lab pod add --host-port NAME=HOSTPORT` maps a named --port; a bad one is one line,
    before the lab is even looked for."""
    code, _, err = run(capsys, "lab", "pod", "add", "--name", "nolab", "node1", "shop/web", *args)
    assert code == status and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("listen, url", [
    ("[::]:9099", "http://[::1]:9099/ui/"),  # the API on [::] takes IPv6 alone (IPV6_V6ONLY): not 127.0.0.1
    ("0.0.0.0:9099", "http://127.0.0.1:9099/ui/"),
    ("127.0.0.1:9100", "http://127.0.0.1:9100/ui/"),
    ("[2001:db8::7]:9099", "http://[2001:db8::7]:9099/ui/"),
    ("[::1]:9099", "http://[::1]:9099/ui/"),
])  # fmt: skip
def test_ui_prints_an_address_the_api_answers_at(capsys, monkeypatch, tmp_path, listen, url):
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")})
    (tmp_path / "token").write_text("t0ken\n")
    conf = tmp_path / "agentd.toml"
    conf.write_text(f"[api]\nlisten = '{listen}'\ntoken_file = '{tmp_path / 'token'}'\n")
    code, out, err = run(capsys, "ui", "--config", str(conf))
    assert code == 0 and out.startswith(url + "?key="), out + err


@pytest.mark.parametrize("value", ["web", "shop/", "/web"])
def test_flows_service_filter_is_namespace_slash_name(capsys, monkeypatch, value):
    """Records name a Service "ns/name": `--service web` could never match."""
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")})
    monkeypatch.setattr(cli, "load_config", lambda *a, **kw: type("C", (), {"api": type("A", (), {"token_file": None})})())
    code, _, err = run(capsys, "flows", "--service", value)
    assert code == 2 and err == f"agentd flows: filter service: expected NAMESPACE/NAME, got {value!r}\n"


@pytest.mark.parametrize("extra", [(), ("-A",), ("--node", "node2")])
def test_flows_sends_the_read_only_key_not_the_api_token(capsys, monkeypatch, tmp_path, extra):
    """What `agentd flows` gathers needs only the token's browser key, which cannot POST /leave."""
    import io

    from agentd.daemon import auth

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")})
    token = tmp_path / "api-token"
    token.write_text("t0ken\n")
    monkeypatch.setattr(cli, "load_config", lambda *a, **kw: type("C", (), {"api": type("A", (), {"token_file": token})})())
    asked = []

    def urlopen(req, timeout=None, deadline=None, idle=None):
        asked.append(req)
        return io.BytesIO(b'{"time": 1.0, "node": "node2", "event": "new", "protocol": "TCP", "verdict": "forwarded", '
                          b'"direction": "ingress", "src": {"ip": "10.244.1.2", "port": 1}, "dst": {"ip": "10.244.2.3", "port": 80}}\n')

    monkeypatch.setattr(cli, "api_open", urlopen)  # the CLI's one way to an agent's API
    code, out, err = run(capsys, "flows", "-o", "json", *extra)
    assert code == 0 and json.loads(out)["node"] == "node2", err
    (req,) = asked
    sent = req.get_header("Authorization")
    assert sent == f"Bearer {auth.ui_key('t0ken')}" and "t0ken" not in sent
    assert auth.may_read_cluster(sent, "t0ken")  # what the agent asks of a cluster read


def test_flows_says_whose_records_were_lost(capsys, monkeypatch, tmp_path):
    """A gathered stream's lost line names the node whose records they were: `agentd flows`
    says it; one naming no node (the reader itself too slow) is said as before."""
    import io

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")})
    token = tmp_path / "api-token"
    token.write_text("t0ken\n")
    monkeypatch.setattr(cli, "load_config", lambda *a, **kw: type("C", (), {"api": type("A", (), {"token_file": token})})())
    stream = (b'{"lost": 5, "why": "made after the reader\'s last record, since scrolled out of the node\'s ring", '
              b'"node": "node2"}\n{"lost": 3, "node": "node1"}\n{"lost": 2}\n')
    monkeypatch.setattr(cli, "api_open", lambda req, timeout=None, deadline=None, idle=None: io.BytesIO(stream))
    code, out, err = run(capsys, "flows", "-A", "-f")
    assert code == 0 and out == ""
    assert err.splitlines() == [
        "agentd flows: node node2: 5 records lost (made after the reader's last record, since scrolled out of the node's ring)",
        "agentd flows: node node1: 3 records lost (not read fast enough from it)",
        "agentd flows: 2 records lost (this reader was too slow)"]


def test_flows_help_says_labels_are_all_of_and_other_filters_any_of(capsys):
    """Repeated -l are one selector on one end (FlowFilter.label), not any of several."""
    code, out, _ = run(capsys, "flows", "--help")
    text = " ".join(out.split())  # as argparse wrapped it
    label = text[text.index("-l KEY[=VALUE] ") :].split(" --", 1)[0]
    assert code == 0 and "any of" not in label and "all on one end" in label and "every one must hold" in label
    assert "--pod NS/NAME only records whose pod matches (repeat for any of several)" in text


def test_lab_help_describes_every_subcommand(capsys):
    """`agentd lab --help` says what each of its subcommands does (down and status too)."""
    code, out, _ = run(capsys, "lab", "--help")
    rows = [line.split() for line in out.splitlines() if line.startswith("    ") and line[4] != " "]
    assert code == 0 and [row[0] for row in rows] == ["up", "down", "status", "restart", "exec", "pod"], out
    assert all(len(row) > 1 for row in rows), out  # a help text beside each name


def _leave_config(tmp_path, node: str = "") -> Path:
    """A config whose etcd TLS files do not exist (a node's certificates gone), the API on
    127.0.0.1:9123; ``node``: its [node] section's lines, if any."""
    conf = tmp_path / "agentd.toml"
    conf.write_text((f"[node]\n{node}\n" if node else "") + f"""[etcd]
endpoints = ["https://192.0.2.2:2379"]
ca = "{tmp_path}/ca.pem"
cert = "{tmp_path}/cert.pem"
key = "{tmp_path}/key.pem"
[api]
listen = "127.0.0.1:9123"
token_file = "{tmp_path}/api-token"
""")
    return conf


def test_leave_asks_the_running_agent_without_reading_etcds_files(capsys, monkeypatch, tmp_path):
    """A token_group member cannot read root's [etcd] TLS files: POST /leave needs only the
    token, so `agentd leave` asks the agent before it looks at them; only with no agent
    answering does it need them (to clean etcd up itself) and then says which one it lacks."""
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")})
    conf = _leave_config(tmp_path, node='name = "n1"\naddress = "192.0.2.10"')
    asked = []

    def agent(host, port, token_file, answers=True, **_kw):
        asked.append((host, port, str(token_file)))
        return 0 if answers else None  # its exit status, or None: no agent answers

    monkeypatch.setattr(cli, "leave_running_agent", agent)
    code, _, err = run(capsys, "leave", "--config", str(conf))
    assert (code, err) == (0, ""), err
    assert asked == [("127.0.0.1", 9123, f"{tmp_path}/api-token")]
    assert len(asked) == 1


class NoDefaultRoute:
    """A host that has lost its default route (a node being taken out of service)."""

    def hostname(self) -> str:
        return "n1"

    def default_address(self):
        return None

    def default_address_v6(self, beside=None):
        return None


def test_leave_without_an_agent_cleans_the_host_up_without_etcds_files_or_a_node_address(
        capsys, monkeypatch, tmp_path):
    """With no agent answering, `agentd leave` loaded the whole configuration first: a missing
    [etcd] TLS file, or no [node] address on a host without a default route, made it exit 1
    before any step ran -- BPF pins, tc filters, tables, routes, worker, proxy and sysctls all
    stayed.  Now the leave runs; only its etcd step needs etcd's files (test_leave_report.py)."""
    from agentd.daemon import agent as agent_module
    from agentd.daemon.leave_report import FAILED, LeaveReport

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")})
    conf = _leave_config(tmp_path)
    monkeypatch.setattr(cli, "leave_running_agent", lambda *a, **kw: None)  # no agent answers
    monkeypatch.setattr(cli, "LocalHost", NoDefaultRoute)
    ran = []

    async def leave(cfg, on_step=None):  # the host's steps, as far as the loading goes
        ran.append(cfg)
        report = LeaveReport(cfg.node.name, "abc", agent=False, finished=True)
        report.failed(agent_module.ETCD_STEP, f"etcd TLS ca file '{cfg.etcd.ca}': No such file or directory")
        on_step(report.steps[-1])
        return report

    monkeypatch.setattr(agent_module, "leave", leave)
    code, out, err = run(capsys, "leave", "--config", str(conf))
    assert len(ran) == 1 and ran[0].node.name == "n1" and ran[0].node.address is None, err
    assert code == 1 and err == "", err
    assert f"{agent_module.ETCD_STEP}: {FAILED}: etcd TLS ca file '{tmp_path}/ca.pem'" in out, out


class RouteGoesAway(NoDefaultRoute):
    """A host whose default route is there at start and gone at the reload (a link flap)."""

    route: str | None = "10.0.0.5"

    def default_address(self):
        from ipaddress import IPv4Address

        return None if self.route is None else IPv4Address(self.route)


def test_a_speaker_reload_takes_the_node_address_of_its_start(capsys, monkeypatch, tmp_path):
    """`agentd speaker`'s SIGHUP read the host's default route again: without [node] address
    and with the route gone at that moment, the reload failed ("[node] address: not set and
    this host has no IPv4 default route") and its new peers and prefixes were not applied.
    Now it takes the start's [node] name and address, as the agent's reload does."""
    import agentd.daemon.speaker

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")})
    monkeypatch.setattr(RouteGoesAway, "route", "10.0.0.5")
    monkeypatch.setattr(cli, "LocalHost", RouteGoesAway)
    for name in ("setup_logging", "tune_gc", "limit_malloc_arenas"):
        monkeypatch.setattr(cli, name, lambda *a, **k: None)
    conf = tmp_path / "spk.toml"
    conf.write_text('[bgp]\noriginate = ["10.9.0.0/24"]\n')
    seen = []

    class Speaker:
        def __init__(self, cfg):
            self.cfg = cfg

        async def run(self, *, reload, set_logging):
            seen.append(self.cfg)
            RouteGoesAway.route = None  # the default route is gone at the SIGHUP
            conf.write_text('[bgp]\noriginate = ["10.9.0.0/24", "10.9.1.0/24"]\n')
            seen.append(reload())
            return 0

    monkeypatch.setattr(agentd.daemon.speaker, "SpeakerRuntime", Speaker)
    code, _, err = run(capsys, "speaker", "--config", str(conf))
    assert code == 0, err
    start, reloaded = seen
    assert str(start.node.address) == str(reloaded.node.address) == "10.0.0.5"
    assert reloaded.node.name == start.node.name == "n1"
    assert [str(p) for p in reloaded.bgp.originate] == ["10.9.0.0/24", "10.9.1.0/24"]


@pytest.mark.parametrize("command", [[sys.executable, "-m", "agentd.cli"], [str(Path(sys.executable).parent / "agentd")]],
                         ids=["python -m agentd.cli", "installed agentd"])
def test_lab_help_works_both_as_installed_and_as_python_m(command):
    """``python -m agentd.cli`` runs the file as ``__main__``: the lab's plugged-in Command (it
    imports agentd.cli) used to be refused as not agentd.cli's Command (a TypeError)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}
    proc = subprocess.run([*command, "lab", "--help"], capture_output=True, text=True, timeout=60, env=env, check=False)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: agentd lab ") and not proc.stderr, proc.stderr


@pytest.mark.parametrize("argv", [["get", "pods"], ["get", "pod", "web-1", "-n", "shop"], ["delete", "service", "web", "-n", "shop"]])
@pytest.mark.parametrize("error", ["permission", "bad request"])
def test_etcd_refusing_a_resource_command_is_one_line_not_a_traceback(capsys, monkeypatch, tmp_path, argv, error):
    """A non-transient aetcd ClientError (no retry helps: a user without the prefix's
    permission, a request etcd calls invalid) is one error line and exit status 1."""
    import aetcd

    from agentd.datastore.store import Datastore
    from agentd.resources.store import ResourceStore

    conf = tmp_path / "agentd.toml"
    conf.write_text("[etcd]\nendpoints = ['http://192.0.2.7:2379']\n")
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")})
    exc = (aetcd.ClientError("etcdserver: permission denied") if error == "permission"
           else aetcd.InvalidArgumentError("etcdserver: request is too large"))  # fmt: skip

    async def refused(*args, **kwargs):
        raise exc

    async def nothing(*args, **kwargs):
        return None

    monkeypatch.setattr(Datastore, "connect", nothing)
    monkeypatch.setattr(Datastore, "close", nothing)
    for method in ("get", "list", "delete"):
        monkeypatch.setattr(ResourceStore, method, refused)
    code, _, err = run(capsys, *argv, "--config", str(conf))
    assert code == 1 and "Traceback" not in err, err
    (line,) = err.splitlines()
    assert line.startswith(f"agentd {argv[0]}: etcd refused the request") and str(exc) in line, line


def test_check_config_refuses_a_token_file_that_is_no_regular_file(capsys, monkeypatch, tmp_path):
    """[api] token_file /dev/zero or a FIFO was "configuration OK", then hung or ate memory in
    leave, flows and ui (and the agent renames its token file over whatever is there)."""
    from blocking import unblock, within

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")})
    fifo = tmp_path / "api.token"
    os.mkfifo(fifo)
    config = tmp_path / "agentd.toml"
    for token_file in ("/dev/zero", fifo, tmp_path):
        config.write_text(f'[api]\ntoken_file = "{token_file}"\n')
        try:
            code, _, err = within(5, run, capsys, "check-config", "--config", str(config))
        finally:
            unblock(fifo)
        assert code == 1 and err.startswith(f"{config}:2: [api] token_file = ") and err.endswith(
            f": {token_file} exists and is not a regular file (the agent writes its API token there)\n"), err
        assert err.count("\n") == 1
    config.write_text(f'[api]\ntoken_file = "{tmp_path / "none-yet"}"\n')
    assert run(capsys, "check-config", "--config", str(config))[0] == 0
