"""What `agentd lab up` refuses before building anything: labs whose pods could never all
reach each other, each in one line that says what to use instead."""

import pytest

from agentd.lab.commands import check_spec, try_hints
from agentd.lab.lab import LabError, LabSpec


def _problem(**kw) -> str | None:
    try:
        check_spec(LabSpec(name="t", **kw))
    except LabError as err:
        return str(err)
    return None


@pytest.mark.parametrize("kw", [
    {"ip_family": "dual", "backend": "ipip"},
    {"ip_family": "dual", "backend": "udp", "subnets": 2},
    {"ip_family": "dual", "backend": "vxlan", "subnets": 2},
    {"ip_family": "ipv6", "backend": "vxlan", "subnets": 2},
    {"ip_family": "ipv4", "backend": "ipip", "subnets": 2},
])  # fmt: skip
def test_labs_whose_pods_all_meet_are_built(kw):
    assert _problem(**kw) is None


def test_ipip_between_segments_carries_no_ipv6_pods():
    # ipip routes a peer's IPv6 pods directly or not at all: the matrix could never fill up,
    # and `lab up` would wait its whole timeout for routes that never come.
    for kw in ({}, {"encap": "cross-subnet"}, {"ipv4_underlay": True}):
        text = _problem(ip_family="dual", backend="ipip", subnets=2, **kw)
        assert text is not None and "ipip carries no IPv6 pods between segments" in text and "udp or vxlan" in text


@pytest.mark.parametrize("backend", ["ipip", "udp"])
def test_ipv6_only_refuses_the_ipv4_underlay_backends(backend):
    text = _problem(ip_family="ipv6", backend=backend)
    # udp carries IPv6 pods (over an IPv4 underlay): the reason is the underlay, not the pods
    assert text == (f"--backend {backend} needs an IPv4 underlay (its outer header is IPv4), which --ip-family "
                    "ipv6 has not: use vxlan or host-gw, or --ip-family dual")


def test_the_other_refusals_stay():
    assert _problem(backend="host-gw", encap="cross-subnet") is not None
    assert _problem(ip_family="ipv4", ipv4_underlay=True) == "--ipv4-underlay goes with --ip-family dual"


def test_the_hints_after_lab_up_are_commands_the_cli_takes():
    import argparse

    from agentd.lab.cli import add_lab_arguments

    text = try_hints("demo", ["node1", "node2", "node3"], [("node1-pod1", "10.244.3.2")], "172.30.0.11")
    lines = text.splitlines()
    assert lines[0] == "Lab demo is up. Try:"
    assert "  agentd lab restart --name demo node3 [--kill]  (its agent stops and starts again; --kill: a crash)" in lines
    assert lines[-1] == "  agentd lab down --name demo"
    parser = argparse.ArgumentParser(prog="agentd lab")
    add_lab_arguments(parser)
    for line in lines[1:]:
        argv = line.split("  (")[0].split()[2:]  # after "agentd lab", without the explanation
        argv = [a.strip("[]") for a in argv]
        if "--" in argv:
            argv = argv[: argv.index("--") + 2]
        args = parser.parse_args(argv)  # exits (SystemExit) on a command the CLI does not take
        assert args.name == "demo", line
    restart = parser.parse_args(["restart", "--name", "demo", "node3", "--kill"])
    assert (restart.node, restart.kill) == ("node3", True)


def test_the_hints_name_the_agentd_the_shell_can_run(monkeypatch, tmp_path):
    """After `scripts/dev lab`, agentd is .venv/bin/agentd, on no PATH: the hints print its path."""
    from agentd.lab import commands

    venv_agentd = tmp_path / "bin" / "agentd"
    monkeypatch.setattr("sys.argv", [str(venv_agentd), "lab", "up"])
    monkeypatch.setenv("PATH", "/nonexistent")
    assert commands.agentd_command() == str(venv_agentd)
    text = try_hints("demo", ["node1"], [], None, agentd=commands.agentd_command())
    assert text.splitlines()[-1] == f"  {venv_agentd} lab down --name demo"
    monkeypatch.setattr("sys.argv", ["/usr/bin/python3", "-m", "agentd"])
    assert commands.agentd_command() == "agentd"
