"""Every command finds its configuration by one rule: ``--config``, else ``$AGENTD_CONFIG``,
else /etc/agentd/agentd.toml (a missing default file means the defaults; a named file must
exist).  The resource commands once ignored the default file and talked to 127.0.0.1:2379
on nodes whose etcd is elsewhere."""

from __future__ import annotations

import os

import pytest

from agentd import cli

COMMANDS = {
    "run": [],
    "speaker": [],
    "leave": [],
    "check-config": [],
    "apply": ["-f", "-"],
    "get": ["pods"],
    "delete": ["pod", "ns/name"],
    "label": ["pod", "ns/name", "a=b"],
}


class _Loaded(Exception):
    pass


@pytest.fixture
def loads(monkeypatch):
    """The (path, require_file) of every configuration a command reads; the command stops there."""
    seen: list[tuple[str, bool]] = []

    def spy(path, *, overrides=None, require_file=False, host=None, **_):
        seen.append((os.fspath(path), require_file))
        raise _Loaded

    monkeypatch.setattr(cli, "load_config", spy)
    monkeypatch.setattr(cli, "check_config", spy)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")})
    return seen


def _run(command: str, *extra: str) -> None:
    with pytest.raises(_Loaded):
        cli.main([command, *COMMANDS[command], *extra])


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_default_file_when_nothing_names_one(loads, command):
    _run(command)
    assert loads == [(cli.DEFAULT_CONFIG_PATH, False)]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_agentd_config_names_the_file(loads, command):
    os.environ["AGENTD_CONFIG"] = "/srv/node.toml"
    _run(command)
    assert loads == [("/srv/node.toml", True)]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_flag_wins_over_the_variable(loads, command):
    os.environ["AGENTD_CONFIG"] = "/srv/node.toml"
    _run(command, "--config", "/srv/other.toml")
    assert loads == [("/srv/other.toml", True)]


def test_an_empty_agentd_config_is_one_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(os, "environ", {"AGENTD_CONFIG": " "})
    with pytest.raises(SystemExit) as exc:
        cli.main(["get", "pods"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "AGENTD_CONFIG is set but empty" in err and "Traceback" not in err


def test_resource_commands_use_the_default_files_etcd(monkeypatch, tmp_path):
    """End to end through the real loader: the default file's etcd endpoints reach the command."""
    conf = tmp_path / "agentd.toml"
    conf.write_text('[etcd]\nendpoints = ["http://192.0.2.7:2379"]\n')
    monkeypatch.setattr(cli, "DEFAULT_CONFIG_PATH", str(conf))
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")})
    got = []
    from agentd.resources import cli as resource_cli

    monkeypatch.setattr(resource_cli, "run", lambda args, cfg: got.append(cfg) or 0)
    assert cli.main(["get", "pods"]) == 0
    assert [str(e) for e in got[0].etcd.endpoints] == ["http://192.0.2.7:2379"]


def test_get_takes_kubectls_all_namespaces_flag(capsys):
    """``agentd get ingress -A`` as kubectl users type it: every namespace (the default), and
    never together with -n."""
    parser = cli.build_parser(["get", "ingress", "-A"])
    args = parser.parse_args(["get", "ingress", "-A"])
    assert args.all_namespaces and args.namespace is None
    assert parser.parse_args(["get", "pods", "--all-namespaces"]).all_namespaces
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["get", "pods", "-A", "-n", "shop"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["flows", "ui", "docker-opts"])
def test_commands_that_never_open_etcds_files_run_without_reading_them(monkeypatch, tmp_path, capsys, command):
    """`agentd flows` (which needs no credential) and `agentd ui` (a token_group member) are run
    by users who cannot read etcd's TLS key, mode 0600: they do not look at it."""
    from agentd.config import values

    (tmp_path / "ca.pem").write_text("PEM")
    (tmp_path / "etcd-key.pem").write_text("PEM")
    token = tmp_path / "api-token"
    token.write_text("t0ken\n")
    conf = tmp_path / "agentd.toml"
    conf.write_text("[etcd]\nendpoints = ['https://192.0.2.7:2379']\nca = 'ca.pem'\ncert = 'ca.pem'\n"
                    f"key = 'etcd-key.pem'\n[api]\ntoken_file = '{token}'\n[cni]\nsubnet_file = '{tmp_path}/subnet.env'\n")
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")})
    monkeypatch.setattr(values.os, "access", lambda p, mode: not str(p).endswith("etcd-key.pem"))
    ran = []
    monkeypatch.setattr(cli, "flows_command", lambda args, token_file: ran.append(token_file) or 0)
    from agentd.cni import docker_opts

    monkeypatch.setattr(docker_opts, "run", lambda args, **_: ran.append(args.subnet_file) or 0)
    assert cli.main([command, "--config", str(conf)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert ran or "/ui/?key=" in out
    # A command that talks to etcd still says the key cannot be read.
    assert cli.main(["get", "pods", "--config", str(conf)]) == 1
    assert "etcd-key.pem is not readable" in capsys.readouterr().err


class NoDefaultRoute:
    """A host whose default route is gone (a link flap, a DHCP renewal, an underlay outage)."""

    def hostname(self) -> str:
        return "n1"

    def default_address(self):
        return None

    def default_address_v6(self, beside=None):
        return None


def test_check_config_for_a_reload_takes_a_missing_default_route_as_a_warning(capsys, monkeypatch, tmp_path):
    """The unit's ExecReload= ran `agentd check-config`, which with no [node] address and no
    default route at that moment exited 1: systemd never sent the SIGHUP the agent would have
    taken (its reload keeps the running [node] address), so no peer or log level changed during
    an underlay outage.  `check-config --reload` says what a start would fail on as a warning."""
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")})
    monkeypatch.setattr(cli, "LocalHost", NoDefaultRoute)
    monkeypatch.setattr(cli, "fetch_json", refused)  # no agent runs: the host's values as they are
    conf = tmp_path / "agentd.toml"
    conf.write_text('[bgp]\n[[bgp.peers]]\naddress = "10.0.0.9"\nasn = 65000\n')
    # A start would fail: check-config says so, as before.
    assert cli.main(["check-config", "--config", str(conf)]) == 1
    assert "[node] address: not set and this host has no IPv4 default route" in capsys.readouterr().err
    # A reload would not.
    assert cli.main(["check-config", "--reload", "--config", str(conf)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{conf}: configuration OK\n"
    asked, line = err.splitlines()
    assert asked.startswith("warning: no running agent answered at http://127.0.0.1:9099/status"), err
    assert line.startswith("warning: a start would fail: ") and "[node] address: not set" in line, err
    assert cli.main(["check-config", "--reload", "--show", "--config", str(conf)]) == 0
    assert '"address": null' in capsys.readouterr().out
    # What a reload refuses all the same still fails it.
    conf.write_text('[bgp]\nhold_time = 2\n')
    assert cli.main(["check-config", "--reload", "--config", str(conf)]) == 1
    assert "[bgp] hold_time = 2" in capsys.readouterr().err


def refused(url, timeout=5.0, wait=None):
    import urllib.error

    raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))


class Host:
    """This host as it is now: ``route`` the default route's source address (None: gone)."""

    route: str | None = None

    def hostname(self) -> str:
        return "n1"

    def default_address(self):
        from ipaddress import IPv4Address

        return None if self.route is None else IPv4Address(self.route)

    def default_address_v6(self, beside=None):
        return None


def running_agent(monkeypatch, node: dict, asked: list[str] | None = None) -> None:
    """The running agent's GET /status (the [node] values of its start) on its local API."""

    def fetch(url, timeout=5.0, wait=None):
        assert wait is not None and wait <= 2.0 and timeout <= 2.0  # a short deadline
        if asked is not None:
            asked.append(url)
        return {"node": node, "bgp": {"peers": []}}

    monkeypatch.setattr(cli, "fetch_json", fetch)


@pytest.fixture
def reload_check(monkeypatch, tmp_path):
    """`agentd check-config --reload` on a file of the test's: host facts as ``Host`` says."""
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")})
    monkeypatch.setattr(cli, "LocalHost", Host)
    monkeypatch.setattr(Host, "route", None)
    conf = tmp_path / "agentd.toml"

    def check(text: str, *extra: str) -> int:
        conf.write_text(text)
        return cli.main(["check-config", *extra, "--config", str(conf)])

    return check


PEER = '[bgp]\n[[bgp.peers]]\naddress = "{}"\nasn = 65001\n'


def test_check_config_for_a_reload_takes_the_running_agents_node_address(reload_check, monkeypatch, capsys):
    """Review r10 #1: the agent started with 10.0.0.5 (the default route's source address then);
    the route is gone, and the operator adds a peer at 10.0.0.5.  `check-config --reload` took
    [node] address from the host as it is now (none), so "is this node's own address" went
    unchecked: ExecReload passed and the agent's reload (RunningHost: 10.0.0.5) refused the
    file.  It checks with the running agent's [node] values now, asked on its local API."""
    asked: list[str] = []
    running_agent(monkeypatch, {"name": "n1", "address": "10.0.0.5", "address_v6": None}, asked)
    assert reload_check(PEER.format("10.0.0.5"), "--reload") == 1
    out, err = capsys.readouterr()
    assert out == "" and '[[bgp.peers]] #1 address = "10.0.0.5": is this node\'s own address' in err, err
    assert "Traceback" not in err and asked == ["http://127.0.0.1:9099/status"]  # the file's [api] listen
    # The same asked where the file's [api] listen says (a wildcard: at its loopback address).
    asked.clear()
    assert reload_check('[api]\nlisten = "0.0.0.0:9199"\n' + PEER.format("10.0.0.5"), "--reload") == 1
    assert asked == ["http://127.0.0.1:9199/status"] and "is this node's own address" in capsys.readouterr().err
    asked.clear()
    assert reload_check('[api]\nlisten = "[::]:9199"\n' + PEER.format("10.0.0.5"), "--reload") == 1
    assert asked == ["http://[::1]:9199/status"] and "is this node's own address" in capsys.readouterr().err


def test_check_config_for_a_reload_takes_the_agent_s_address_not_a_new_dhcp_one(reload_check, monkeypatch, capsys):
    """The reverse: DHCP moved the host to 10.0.0.77 since the agent started with 10.0.0.5, and a
    peer at 10.0.0.77 is no problem for the reload (the agent is 10.0.0.5 until a restart):
    check-config --reload refused it; now a warning says a start would."""
    monkeypatch.setattr(Host, "route", "10.0.0.77")
    running_agent(monkeypatch, {"name": "n1", "address": "10.0.0.5", "address_v6": None})
    assert reload_check(PEER.format("10.0.0.77"), "--reload") == 0
    out, err = capsys.readouterr()
    assert out.endswith(": configuration OK\n")
    (line,) = err.splitlines()
    assert line.startswith("warning: a start would fail: ") and "is this node's own address" in line, err
    # A start checks the host as it is: refused.
    assert reload_check(PEER.format("10.0.0.77")) == 1
    assert "is this node's own address" in capsys.readouterr().err
    # --show shows the running values the check took.
    assert reload_check(PEER.format("10.0.0.77"), "--reload", "--show") == 0
    assert '"address": "10.0.0.5"' in capsys.readouterr().out


def test_check_config_for_a_reload_takes_an_ipv6_only_agents_addresses(reload_check, monkeypatch, capsys):
    """An IPv6-only agent's status "address" is its IPv6 address (it has no IPv4 one)."""
    running_agent(monkeypatch, {"name": "n1", "address": "fd00::5", "address_v6": "fd00::5"})
    assert reload_check('[network]\nip_family = "ipv6"\ncidr_v6 = "fd10::/56"\n' + PEER.format("fd00::5"),
                        "--reload") == 1
    assert "is this node's own address" in capsys.readouterr().err


def test_check_config_for_a_reload_without_an_agent_checks_the_host_as_today(reload_check, monkeypatch, capsys):
    """No agent answers on the local API: the host's values as they are now, said in one line."""
    monkeypatch.setattr(cli, "fetch_json", refused)
    assert reload_check(PEER.format("10.0.0.5"), "--reload") == 0  # no route: the own address unknown
    out, err = capsys.readouterr()
    assert out.endswith(": configuration OK\n")
    assert err.splitlines()[0] == ("warning: no running agent answered at http://127.0.0.1:9099/status (Connection "
                                   "refused): [node] name and address checked as this host has them now, not as "
                                   "the running agent's reload takes them"), err
    monkeypatch.setattr(Host, "route", "10.0.0.5")
    assert reload_check(PEER.format("10.0.0.5"), "--reload") == 1
    assert "is this node's own address" in capsys.readouterr().err


def _raises(err: BaseException):
    def fetch(url, timeout=5.0, wait=None):
        raise err

    return fetch


def _answers(value):
    return lambda url, timeout=5.0, wait=None: value


def _http_error():
    import email.message
    import io
    import urllib.error

    return urllib.error.HTTPError("http://127.0.0.1:9099/status", 404, "Not Found", email.message.Message(),
                                  io.BytesIO(b"{}"))


@pytest.mark.parametrize("fetch", [
    _raises(TimeoutError("timed out")),
    _raises(__import__("json").JSONDecodeError("Expecting value", "<html>", 0)),
    _raises(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")),
    _raises(RecursionError("maximum recursion depth exceeded")),
    _raises(cli.AnswerTooLarge("more than 8 MiB")),
    _raises(cli.AnswerBrokeOff("cut short")),
    _raises(ConnectionResetError(104, "Connection reset by peer")),
    _raises(_http_error()),
    _answers([1, 2]),
    _answers({"node": "n1"}),
    _answers({"node": {}}),
    _answers({"node": {"name": 5, "address": "10.0.0.5"}}),
    _answers({"node": {"name": "", "address": "10.0.0.5"}}),
    _answers({"node": {"name": "bad name!", "address": "10.0.0.5"}}),
    _answers({"node": {"name": "n1", "address": "10.0.0.500"}}),
    _answers({"node": {"name": "n1", "address": 167772165}}),
    _answers({"node": {"name": "n1", "address": "10.0.0.5", "address_v6": "10.0.0.5"}}),
    _answers({"node": {"name": "n1", "address": "fd00::zz"}}),
    _answers({"node": {"name": "n1", "address": ["10.0.0.5"]}}),
], ids=["timeout", "not-json", "not-utf8", "too-deep", "too-large", "broke-off", "reset", "http-404", "a-list",
        "node-a-string", "node-empty", "name-a-number", "name-empty", "name-bad", "address-bad", "address-a-number",
        "address_v6-ipv4", "address-bad-ipv6", "address-a-list"])
def test_check_config_for_a_reload_takes_any_failing_local_api_as_no_agent(reload_check, monkeypatch, capsys, fetch):
    """Refused, no answer in time, not JSON, not an agentd status: no traceback, the host's
    values as they are (one warning line), the check as without an agent."""
    monkeypatch.setattr(cli, "fetch_json", fetch)
    monkeypatch.setattr(Host, "route", "10.0.0.5")
    assert reload_check(PEER.format("10.0.0.5"), "--reload") == 1
    err = capsys.readouterr().err
    first, *rest = err.splitlines()
    assert first.startswith("warning: ") and first.endswith(
        ": [node] name and address checked as this host has them now, not as the running agent's reload takes them")
    assert "http://127.0.0.1:9099/status" in first and "Traceback" not in err
    assert rest and "is this node's own address" in rest[0]


def test_check_config_for_a_reload_asks_a_real_socket(reload_check, capsys):
    """Through the real fetch: a port nothing listens on, and one answering what is no JSON."""
    import socket
    import threading

    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    assert reload_check(f'[api]\nlisten = "127.0.0.1:{port}"\n', "--reload") == 0
    err = capsys.readouterr().err
    assert err.startswith(f"warning: no running agent answered at http://127.0.0.1:{port}/status (Connection refused)")

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\nConnection: close\r\n\r\n<html>")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        assert reload_check(f'[api]\nlisten = "127.0.0.1:{port}"\n', "--reload") == 0
    finally:
        thread.join(5)
        listener.close()
    err = capsys.readouterr().err
    assert err.startswith(f"warning: no running agent answered at http://127.0.0.1:{port}/status (Expecting value")
    assert "Traceback" not in err


def test_check_config_for_a_reload_leaves_token_group_to_a_start(reload_check, monkeypatch, capsys):
    """[api] token_group names a group this host no longer has: a start refuses it (the token
    file's group), a reload never applies token_group (agentd.daemon.agent's _reload: peers,
    listen ranges and [log] only) and took the file: check-config --reload failed it all the same."""
    monkeypatch.setattr(Host, "route", "10.0.0.5")
    running_agent(monkeypatch, {"name": "n1", "address": "10.0.0.5", "address_v6": None})
    text = '[api]\ntoken_group = "no-such-group-xyz"\n[log]\nlevel = "debug"\n'
    assert reload_check(text) == 1
    assert "no group named 'no-such-group-xyz' on this host" in capsys.readouterr().err
    assert reload_check(text, "--reload") == 0
    out, err = capsys.readouterr()
    assert out.endswith(": configuration OK\n")
    (line,) = err.splitlines()
    assert line.startswith("warning: a start would fail: ") and "no group named 'no-such-group-xyz'" in line, err
