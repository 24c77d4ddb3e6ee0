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
    conf = tmp_path / "agentd.toml"
    conf.write_text('[bgp]\n[[bgp.peers]]\naddress = "10.0.0.9"\nasn = 65000\n')
    # A start would fail: check-config says so, as before.
    assert cli.main(["check-config", "--config", str(conf)]) == 1
    assert "[node] address: not set and this host has no IPv4 default route" in capsys.readouterr().err
    # A reload would not.
    assert cli.main(["check-config", "--reload", "--config", str(conf)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{conf}: configuration OK\n"
    (line,) = err.splitlines()
    assert line.startswith("warning: a start would fail: ") and "[node] address: not set" in line, err
    assert cli.main(["check-config", "--reload", "--show", "--config", str(conf)]) == 0
    assert '"address": null' in capsys.readouterr().out
    # What a reload refuses all the same still fails it.
    conf.write_text('[bgp]\nhold_time = 2\n')
    assert cli.main(["check-config", "--reload", "--config", str(conf)]) == 1
    assert "[bgp] hold_time = 2" in capsys.readouterr().err
