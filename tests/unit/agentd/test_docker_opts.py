"""agentd docker-opts (the Docker daemon's options from the subnet file) and the masquerading
ruleset of [network] ip_masq, both pure."""

from __future__ import annotations

import json
import os
from ipaddress import IPv4Network, IPv6Network

from agentd.cli import main
from agentd.cni.docker_opts import docker_options, render
from agentd.cni.netconf import SubnetFile, render_subnet_file
from agentd.nft.masquerade import ruleset
from agentd.nft.ruleset import NftChain, Ruleset, plan

SF = SubnetFile(network=IPv4Network("10.244.0.0/16"), subnet=IPv4Network("10.244.3.0/24"), mtu=1450)


def test_options_follow_the_subnet_file():
    assert docker_options(SF) == {"bip": "10.244.3.1/24", "ip-masq": False, "mtu": 1450}
    assert render(docker_options(SF), "env") == 'DOCKER_OPTS="--bip=10.244.3.1/24 --ip-masq=false --mtu=1450"\n'
    assert render(docker_options(SF), "args", "X") == "--bip=10.244.3.1/24 --ip-masq=false --mtu=1450\n"
    assert json.loads(render(docker_options(SF), "json")) == {"bip": "10.244.3.1/24", "ip-masq": False, "mtu": 1450}


def test_allow_direct_routing_only_when_asked(tmp_path, capsys):
    """Docker 28 drops packets for a container's address from outside the host without it;
    dockerd 20.10 refuses it as unknown: given only with --allow-direct-routing."""
    assert "allow-direct-routing" not in docker_options(SF)
    opts = docker_options(SF, allow_direct_routing=True)
    assert render(opts, "args") == "--bip=10.244.3.1/24 --ip-masq=false --mtu=1450 --allow-direct-routing=true\n"
    assert json.loads(render(opts, "json"))["allow-direct-routing"] is True
    path = tmp_path / "subnet.env"
    path.write_text(render_subnet_file(SF))
    assert main(["docker-opts", "--subnet-file", str(path), "--allow-direct-routing"]) == 0
    assert capsys.readouterr().out == (
        'DOCKER_OPTS="--bip=10.244.3.1/24 --ip-masq=false --mtu=1450 --allow-direct-routing=true"\n')
    assert main(["docker-opts", "--subnet-file", str(path), "--format", "json"]) == 0
    assert "allow-direct-routing" not in capsys.readouterr().out


def test_dual_stack_and_ipv6_only_nodes_give_docker_their_ipv6_subnet(tmp_path, capsys):
    v6 = {"network_v6": IPv6Network("fd00:10:244::/48"), "subnet_v6": IPv6Network("fd00:10:244:3::/64")}
    dual = SubnetFile(network=SF.network, subnet=SF.subnet, mtu=1450, **v6)
    assert docker_options(dual) == {"bip": "10.244.3.1/24", "ipv6": True, "fixed-cidr-v6": "fd00:10:244:3::/64",
                                    "ip-masq": False, "mtu": 1450}
    only6 = SubnetFile(network=None, subnet=None, mtu=1430, **v6)
    assert render(docker_options(only6), "args") == "--ipv6=true --fixed-cidr-v6=fd00:10:244:3::/64 --ip-masq=false --mtu=1430\n"
    path = tmp_path / "subnet.env"
    path.write_text(render_subnet_file(only6))
    assert main(["docker-opts", "--subnet-file", str(path)]) == 0  # an IPv6-only node: no traceback
    assert capsys.readouterr().out == 'DOCKER_OPTS="--ipv6=true --fixed-cidr-v6=fd00:10:244:3::/64 --ip-masq=false --mtu=1430"\n'


def test_the_command_reads_the_file_and_refuses_bad_input(tmp_path, capsys):
    path = tmp_path / "subnet.env"
    path.write_text(render_subnet_file(SF))
    out = tmp_path / "docker_opts.env"
    assert main(["docker-opts", "--subnet-file", str(path), "--key", "DOCKER_NETWORK_OPTIONS", "-o", str(out)]) == 0
    assert out.read_text() == 'DOCKER_NETWORK_OPTIONS="--bip=10.244.3.1/24 --ip-masq=false --mtu=1450"\n'
    assert main(["docker-opts", "--subnet-file", str(tmp_path / "missing")]) == 1
    assert "no subnet file at" in capsys.readouterr().err
    path.write_text("AGENTD_NETWORK=10.244.0.0/16\nAGENTD_SUBNET=10.244.3.1/24\nAGENTD_MTU=big\n")
    assert main(["docker-opts", "--subnet-file", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "AGENTD_MTU 'big' is not an integer" in err


def test_a_subnet_file_that_is_no_regular_file_is_refused_at_once(tmp_path, capsys):
    """A FIFO blocked the command for ever, /dev/zero was read until memory ran out: the
    subnet file is read as the configuration file is (no waiting, a regular file, bounded)."""
    from blocking import unblock, within

    fifo = tmp_path / "subnet.env"
    os.mkfifo(fifo)
    try:
        assert within(1, main, ["docker-opts", "--subnet-file", str(fifo)]) == 1
    finally:
        unblock(fifo)
    assert capsys.readouterr().err == f"agentd docker-opts: cannot read subnet file {fifo}: not a regular file\n"
    assert main(["docker-opts", "--subnet-file", "/dev/zero"]) == 1
    assert capsys.readouterr().err == "agentd docker-opts: cannot read subnet file /dev/zero: not a regular file\n"
    big = tmp_path / "big.env"
    big.write_text(render_subnet_file(SF) + "#" * 70_000 + "\n")
    assert main(["docker-opts", "--subnet-file", str(big)]) == 1
    assert "over 65536 bytes" in capsys.readouterr().err


def test_the_subnet_file_is_the_configurations_by_default(tmp_path, capsys, monkeypatch):
    """No --subnet-file: [cni] subnet_file of the configuration, found by the one rule
    (--config, $AGENTD_CONFIG, the default file) and the AGENTD_CNI_SUBNET_FILE variable."""
    for name in [k for k in os.environ if k.startswith("AGENTD_")]:
        monkeypatch.delenv(name)
    path = tmp_path / "subnet.env"
    path.write_text(render_subnet_file(SF))
    config = tmp_path / "agentd.toml"
    config.write_text(f'[cni]\nsubnet_file = "{path}"\nwrite_conflist = false\n')  # a Docker host
    assert main(["docker-opts", "--config", str(config), "--format", "args"]) == 0
    out, err = capsys.readouterr()
    assert out == "--bip=10.244.3.1/24 --ip-masq=false --mtu=1450\n"
    # [network] ip_masq is off (the default): nothing would masquerade what the containers send
    # out of the cluster, and the command says so, on stderr only.
    assert err.count("\n") == 1 and "ip_masq is off" in err
    monkeypatch.setenv("AGENTD_CONFIG", str(config))
    assert main(["docker-opts", "--format", "args"]) == 0
    assert capsys.readouterr().out == "--bip=10.244.3.1/24 --ip-masq=false --mtu=1450\n"
    # The configuration read has [network] ip_masq off (the default): nothing would masquerade
    # the containers' traffic leaving the cluster, and the command says so (stderr only).
    config.write_text(f'[cni]\nsubnet_file = "{path}"\nwrite_conflist = false\n[network]\nip_masq = true\n')
    assert main(["docker-opts", "--format", "args"]) == 0
    assert capsys.readouterr() == ("--bip=10.244.3.1/24 --ip-masq=false --mtu=1450\n", "")
    monkeypatch.setenv("AGENTD_CNI_SUBNET_FILE", str(tmp_path / "elsewhere.env"))
    assert main(["docker-opts"]) == 1
    assert f"no subnet file at {tmp_path / 'elsewhere.env'}" in capsys.readouterr().err


def test_a_node_of_agentd_cni_is_refused(tmp_path, capsys, monkeypatch):
    """Docker's bridge and agentd-cni's would both take the node's whole subnet (the gateway
    on two bridges, two allocators handing out the same addresses): one or the other."""
    for name in [k for k in os.environ if k.startswith("AGENTD_")]:
        monkeypatch.delenv(name)
    path = tmp_path / "subnet.env"
    path.write_text(render_subnet_file(SF))
    data = tmp_path / "cni"
    config = tmp_path / "agentd.toml"
    config.write_text(f'[cni]\nsubnet_file = "{path}"\ndata_dir = "{data}"\n')  # write_conflist: on by default
    assert main(["docker-opts", "--config", str(config)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "[cni] write_conflist = true" in err and "cannot share a node's subnet" in err
    assert "write_conflist = false" in err
    # The conflist no longer written, but pods agentd-cni attached are still there.
    config.write_text(f'[cni]\nsubnet_file = "{path}"\ndata_dir = "{data}"\nwrite_conflist = false\n')
    (data / "endpoints").mkdir(parents=True)
    (data / "endpoints" / "c0ffee.json").write_text("{}")
    assert main(["docker-opts", "--config", str(config)]) == 1
    assert "1 CNI pod(s) are attached" in capsys.readouterr().err
    (data / "endpoints" / "c0ffee.json").unlink()
    assert main(["docker-opts", "--config", str(config), "--format", "args"]) == 0
    assert capsys.readouterr().out == "--bip=10.244.3.1/24 --ip-masq=false --mtu=1450\n"


def test_masquerading_never_touches_pod_to_pod_traffic():
    rs = ruleset({4: (IPv4Network("10.244.0.0/16"), IPv4Network("10.244.3.0/24"))})
    chain = next(c for c in rs.chains() if c.name == "postrouting")  # (and the forward chain that guards members)
    assert rs.tables == {("ip", "agentd-masq")} and chain.hook == ("nat", "postrouting", 110, "accept")
    rules = [json.loads(r) for r in chain.rules]
    # (First what kube-proxy's mark leaves to the Services table: tests/unit/agentd/test_masquerade_guard.py.)
    assert rules.pop(0)[-1] == {"return": None}

    def match(expr):
        return [(m["match"]["left"]["payload"]["field"], m["match"]["op"],
                 f"{m['match']['right']['prefix']['addr']}/{m['match']['right']['prefix']['len']}")
                for m in expr if "match" in m]  # fmt: skip

    def verdict(expr):
        return "masquerade" if any("masquerade" in e for e in expr) else "return"

    assert [(match(r), verdict(r)) for r in rules] == [
        ([("saddr", "==", "10.244.0.0/16"), ("daddr", "==", "10.244.0.0/16")], "return"),
        ([("saddr", "==", "10.244.0.0/16"), ("daddr", "!=", "224.0.0.0/4")], "masquerade"),
        ([("saddr", "!=", "10.244.0.0/16"), ("daddr", "==", "10.244.3.0/24")], "return"),
        ([("saddr", "!=", "10.244.0.0/16"), ("daddr", "==", "10.244.0.0/16")], "masquerade"),
    ]
    # From nothing: one transaction that makes the table, its chain and the rules.
    def shape(commands):
        return [(verb, next(iter(body))) for c in commands for verb, body in c.items()]

    made = shape(plan(Ruleset(), rs))
    assert made[0] == ("add", "table") and made.count(("add", "chain")) == 2 and made.count(("add", "rule")) == 5 + 3
    # Over a previous run's table (adopted: contents unknown): flushed and refilled in the same one.
    adopted = Ruleset(rs.tables, {chain.key: NftChain("ip", "agentd-masq", "postrouting", hook=chain.hook,
                                                      contents_known=False)})
    refilled = shape(plan(adopted, rs))  # (a previous version's table: the guard's set and chain added in it too)
    assert refilled.count(("flush", "chain")) == 1 and refilled.count(("add", "rule")) == 5 + 3
    assert not any(verb == "delete" for verb, _ in refilled)


def _rules(chain) -> list[tuple[list[tuple[str, str, str, str]], str]]:
    """(matches as (family, field, op, network), verdict) of each rule of ``chain`` but the
    first (kube-proxy's mark: tests/unit/agentd/test_masquerade_guard.py)."""
    out = []
    for expr in (json.loads(r) for r in chain.rules[1:]):
        matches = [(m["match"]["left"]["payload"]["protocol"], m["match"]["left"]["payload"]["field"], m["match"]["op"],
                    f"{m['match']['right']['prefix']['addr']}/{m['match']['right']['prefix']['len']}")
                   for m in expr if "match" in m]  # fmt: skip
        out.append((matches, "masquerade" if any("masquerade" in e for e in expr) else "return"))
    return out


def test_masquerading_covers_the_ipv6_pod_network_too():
    v4 = (IPv4Network("10.244.0.0/16"), IPv4Network("10.244.3.0/24"))
    v6 = (IPv6Network("fd00:10:244::/48"), IPv6Network("fd00:10:244:3::/64"))
    dual = ruleset({4: v4, 6: v6})
    assert dual.tables == {("ip", "agentd-masq"), ("ip6", "agentd-masq")}
    chains = {c.family: c for c in dual.chains() if c.name == "postrouting"}
    assert chains["ip6"].hook == chains["ip"].hook == ("nat", "postrouting", 110, "accept")
    # flannel's MasqIP6Rules: the same four rules over ip6 addresses, multicast ff00::/8 (RFC 4291 §2.7).
    assert _rules(chains["ip6"]) == [
        ([("ip6", "saddr", "==", "fd00:10:244::/48"), ("ip6", "daddr", "==", "fd00:10:244::/48")], "return"),
        ([("ip6", "saddr", "==", "fd00:10:244::/48"), ("ip6", "daddr", "!=", "ff00::/8")], "masquerade"),
        ([("ip6", "saddr", "!=", "fd00:10:244::/48"), ("ip6", "daddr", "==", "fd00:10:244:3::/64")], "return"),
        ([("ip6", "saddr", "!=", "fd00:10:244::/48"), ("ip6", "daddr", "==", "fd00:10:244::/48")], "masquerade"),
    ]
    assert _rules(chains["ip"]) == _rules(next(c for c in ruleset({4: v4}).chains() if c.name == "postrouting"))
    # IPv6-only: the ip6 table alone.  A node whose pods lost a family loses that table in the
    # same transaction that rewrites the other (adopted from the previous run).
    assert ruleset({6: v6}).tables == {("ip6", "agentd-masq")}
    commands = plan(Ruleset(dual.tables, dict(dual.objects)), ruleset({6: v6}))
    assert commands == [{"delete": {"table": {"family": "ip", "name": "agentd-masq"}}}]


def test_what_the_agent_runs_with_decides_not_the_configuration_file(tmp_path, capsys, monkeypatch):
    """operations.md sets AGENTD_CNI_WRITE_CONFLIST=false in the agent's unit (Environment=);
    docker.service's ExecStartPre= has no such variable, read the file's default (true) and
    refused: Docker did not start.  The subnet file says what the agent runs with now."""
    from agentd.config.settings import load_config
    from agentd.daemon import node_files
    from agentd.datastore.records import ClusterConfig, SubnetLease

    for name in [k for k in os.environ if k.startswith("AGENTD_")]:
        monkeypatch.delenv(name)
    path = tmp_path / "subnet.env"
    config = tmp_path / "agentd.toml"
    config.write_text(f'[node]\nname = "n1"\naddress = "10.1.1.1"\n[cni]\nsubnet_file = "{path}"\n'
                      f'data_dir = "{tmp_path}/cni"\nconf_dir = "{tmp_path}/net.d"\n'
                      f'[agent]\nstate_dir = "{tmp_path}/state"\n')  # write_conflist, ip_masq: the defaults

    def agent_writes(**env):  # the agent, started with its unit's environment
        cfg = load_config(config, env=env, check_files=False)
        node_files.write_cni_files(cfg, ClusterConfig(SF.network, 24, "host-gw", "always"),
                                   {4: SubnetLease(SF.subnet, "n1", "10.1.1.1", "host-gw")}, 1450)

    agent_writes(AGENTD_CNI_WRITE_CONFLIST="false", AGENTD_NETWORK_IP_MASQ="true")
    assert main(["docker-opts", "--config", str(config), "--format", "args"]) == 0
    assert capsys.readouterr() == ("--bip=10.244.3.1/24 --ip-masq=false --mtu=1450\n", "")  # no ip_masq warning
    agent_writes()  # the defaults: agentd-cni's conflist, nothing masquerades
    assert main(["docker-opts", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"AGENTD_WRITE_CONFLIST=true in {path}" in err
    config.write_text(config.read_text().replace("[agent]", "write_conflist = false\n[agent]"))  # a Docker host's
    agent_writes(AGENTD_CNI_WRITE_CONFLIST="false")
    assert main(["docker-opts", "--config", str(config)]) == 1  # the conflist the run before wrote is there
    assert "10-agentd.conflist is still there" in capsys.readouterr().err
    (tmp_path / "net.d" / "10-agentd.conflist").unlink()
    assert main(["docker-opts", "--config", str(config), "--format", "args"]) == 0
    assert "ip_masq is off" in capsys.readouterr().err
    path.write_text(path.read_text().replace("AGENTD_MASQUERADE=false", "AGENTD_MASQUERADE=maybe"))
    assert main(["docker-opts", "--config", str(config)]) == 1
    assert "AGENTD_MASQUERADE 'maybe' is not true or false" in capsys.readouterr().err


def test_a_key_a_shell_cannot_take_or_an_empty_output_is_refused(tmp_path, capsys):
    """--key took any Python identifier (é: no shell sources DOCKER_OPTé=...); -o "" wrote to
    standard output without a word."""
    path = tmp_path / "subnet.env"
    path.write_text(render_subnet_file(SF))
    for key in ("DOCKER_OPTé", "1X", "A-B", "", "ＡＢ"):
        assert main(["docker-opts", "--subnet-file", str(path), "--key", key]) == 2, key
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"agentd docker-opts: --key {key!r} is not a variable name"), err
    assert main(["docker-opts", "--subnet-file", str(path), "-o", ""]) == 2
    assert capsys.readouterr() == ("", "agentd docker-opts: --output: empty path (leave it out for standard output)\n")
    assert main(["docker-opts", "--subnet-file", str(path), "--key", "_docker_opts2"]) == 0
    assert capsys.readouterr().out.startswith('_docker_opts2="--bip=10.244.3.1/24 ')


def test_the_subnet_files_word_counts_with_subnet_file_too(tmp_path, capsys, monkeypatch):
    """With --subnet-file the file's AGENTD_WRITE_CONFLIST=true and AGENTD_MASQUERADE=false
    were ignored (only read where the configuration was): Docker got the subnet of a node
    whose agent writes agentd-cni's conflist, without a word."""
    for name in [k for k in os.environ if k.startswith("AGENTD_")]:
        monkeypatch.delenv(name)
    path = tmp_path / "subnet.env"
    path.write_text(render_subnet_file(SF) + "AGENTD_WRITE_CONFLIST=true\nAGENTD_MASQUERADE=false\n")
    assert main(["docker-opts", "--subnet-file", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert f"AGENTD_WRITE_CONFLIST=true in {path}" in err and "cannot share a node's subnet" in err
    path.write_text(render_subnet_file(SF) + "AGENTD_WRITE_CONFLIST=false\nAGENTD_MASQUERADE=false\n")
    assert main(["docker-opts", "--subnet-file", str(path), "--format", "args"]) == 0
    out, err = capsys.readouterr()
    assert out == "--bip=10.244.3.1/24 --ip-masq=false --mtu=1450\n" and "ip_masq is off" in err
    path.write_text(render_subnet_file(SF) + "AGENTD_WRITE_CONFLIST=false\nAGENTD_MASQUERADE=true\n")
    assert main(["docker-opts", "--subnet-file", str(path), "--format", "args"]) == 0
    assert capsys.readouterr().err == ""


def test_agentds_conflist_left_from_a_cni_node_is_refused(tmp_path, capsys, monkeypatch):
    """A CNI node turned Docker host (write_conflist true -> false, restarted) keeps
    10-agentd.conflist: container runtimes go on running agentd-cni on the subnet Docker
    would be given.  An operator's own file of that name is not agentd's and does not count."""
    from agentd.cni.netconf import write_conflist

    for name in [k for k in os.environ if k.startswith("AGENTD_")]:
        monkeypatch.delenv(name)
    path = tmp_path / "subnet.env"
    path.write_text(render_subnet_file(SF) + "AGENTD_WRITE_CONFLIST=false\nAGENTD_MASQUERADE=true\n")
    conf, data = tmp_path / "net.d", tmp_path / "cni"
    write_conflist(str(conf), mtu=1450, subnet_file=str(path), data_dir=str(data),
                   ipam_data_dir=str(tmp_path / "ipam"), bin_dir="/opt/cni/bin")
    config = tmp_path / "agentd.toml"
    config.write_text(f'[cni]\nsubnet_file = "{path}"\ndata_dir = "{data}"\nconf_dir = "{conf}"\n'
                      f'write_conflist = false\n[network]\nip_masq = true\n')
    assert main(["docker-opts", "--config", str(config)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert f"conflist {conf / '10-agentd.conflist'} is still there" in err and "cannot share" in err
    (conf / "10-agentd.conflist").write_text(json.dumps({"plugins": [{"type": "bridge"}]}))  # the operator's
    assert main(["docker-opts", "--config", str(config), "--format", "args"]) == 0
    assert capsys.readouterr() == ("--bip=10.244.3.1/24 --ip-masq=false --mtu=1450\n", "")


def test_individual_variables_as_mk_docker_opts_i_writes_them(tmp_path, capsys):
    """flannel's mk-docker-opts.sh -i: a variable per option, for units that compose dockerd's
    command line from some of them."""
    path = tmp_path / "subnet.env"
    path.write_text(render_subnet_file(SF))
    assert main(["docker-opts", "--subnet-file", str(path), "-i"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        'DOCKER_OPT_BIP="--bip=10.244.3.1/24"', 'DOCKER_OPT_IPMASQ="--ip-masq=false"', 'DOCKER_OPT_MTU="--mtu=1450"']
    v6 = SubnetFile(network=SF.network, subnet=SF.subnet, mtu=1450, network_v6=IPv6Network("fd00:10:244::/48"),
                    subnet_v6=IPv6Network("fd00:10:244:3::/64"))
    path.write_text(render_subnet_file(v6))
    out = tmp_path / "docker_opts.env"
    assert main(["docker-opts", "--subnet-file", str(path), "--individual", "--allow-direct-routing", "-o", str(out)]) == 0
    assert out.read_text().splitlines() == [
        'DOCKER_OPT_BIP="--bip=10.244.3.1/24"', 'DOCKER_OPT_IPV6="--ipv6=true"',
        'DOCKER_OPT_FIXED_CIDR_V6="--fixed-cidr-v6=fd00:10:244:3::/64"', 'DOCKER_OPT_IPMASQ="--ip-masq=false"',
        'DOCKER_OPT_MTU="--mtu=1450"', 'DOCKER_OPT_ALLOW_DIRECT_ROUTING="--allow-direct-routing=true"']
    for fmt in ("args", "json"):
        assert main(["docker-opts", "--subnet-file", str(path), "-i", "--format", fmt]) == 2
        assert "--individual writes variables" in capsys.readouterr().err


def test_a_cluster_network_in_dockers_default_pools_is_warned_of_and_json_gives_pools_outside_it(tmp_path, capsys):
    """192.168.0.0/16 (Calico's default pod CIDR) lies in Docker's default pools: a network
    `docker network create` or docker-compose makes on a Docker host (a 192.168.x.0/20) held
    other nodes' pod addresses, and nothing said so."""
    from agentd.cni.docker_opts import pools_outside

    calico = SubnetFile(network=IPv4Network("192.168.0.0/16"), subnet=IPv4Network("192.168.3.0/24"), mtu=1450)
    path = tmp_path / "subnet.env"
    path.write_text(render_subnet_file(calico))
    assert main(["docker-opts", "--subnet-file", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out == 'DOCKER_OPTS="--bip=192.168.3.1/24 --ip-masq=false --mtu=1450"\n'  # env, args: a warning only
    assert err.count("\n") == 1 and "warning: the cluster network 192.168.0.0/16 overlaps Docker's default" in err
    assert "default-address-pools" in err
    assert main(["docker-opts", "--subnet-file", str(path), "--format", "json"]) == 0
    out, err = capsys.readouterr()
    pools = json.loads(out)["default-address-pools"]
    assert pools == [{"base": f"172.{n}.0.0/16", "size": 16} for n in range(17, 32)]
    assert "--format json adds them as default-address-pools" in err
    # A network inside a pool: the pieces around it that hold the pool's networks.
    assert pools_outside(IPv4Network("192.168.64.0/18"))[0][-2:] == [{"base": "192.168.0.0/18", "size": 20},
                                                                      {"base": "192.168.128.0/17", "size": 20}]
    assert pools_outside(IPv4Network("172.20.1.0/24"))[0] == [
        *({"base": f"172.{n}.0.0/16", "size": 16} for n in range(17, 32) if n != 20),
        {"base": "192.168.0.0/16", "size": 20}]  # fmt: skip
    # A piece of exactly the pool's size is kept: one /20 holds one of the pool's networks.
    assert pools_outside(IPv4Network("192.168.0.0/20"))[0][-4:] == [
        {"base": f"192.168.{third}.0/{length}", "size": 20} for third, length in ((16, 20), (32, 19), (64, 18), (128, 17))]
    # Outside the pools (the lab's 10.244.0.0/16): no warning, no pools.
    path.write_text(render_subnet_file(SF))
    assert main(["docker-opts", "--subnet-file", str(path), "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert "default-address-pools" not in out and err == ""
    # Every pool the cluster's: the warning, no empty list (Docker would take it for its defaults).
    huge = SubnetFile(network=IPv4Network("128.0.0.0/1"), subnet=IPv4Network("172.17.0.0/24"), mtu=1450)
    path.write_text(render_subnet_file(huge))
    assert main(["docker-opts", "--subnet-file", str(path), "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert "default-address-pools" not in out and "give dockerd default-address-pools outside it (docs" in err
