"""What the node agent keeps out of its memory: the modules of a feature that is off, and
buffers whose pages only the kernel needs to write (an idle agent's RSS goal, docs/operations.md)."""

import subprocess
import sys
from pathlib import Path

from agentd.dataplane.bpf import libbpf
from agentd.ingress import STATE_SUBDIR, remove_ingress_proxy
from agentd.kernel.netlink_socket import NetlinkSocket


def test_the_agent_does_not_import_the_ingress_controller():
    """[ingress] is off by default: its controller (haproxy, certificates, routing) is loaded
    by the agent only when enabled.  A fresh interpreter, since this one may have it already."""
    code = ("import sys, agentd.daemon.agent, agentd.daemon.views\n"
            "print(sorted(m for m in sys.modules if m.startswith('agentd.ingress.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_removing_no_ingress_proxy_loads_nothing(tmp_path: Path):
    code = ("import sys\nfrom agentd.ingress import remove_ingress_proxy\n"
            f"print(remove_ingress_proxy({str(tmp_path)!r}), 'agentd.ingress.controller' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_a_left_ingress_directory_is_removed(tmp_path: Path):
    (tmp_path / STATE_SUBDIR).mkdir()
    (tmp_path / STATE_SUBDIR / "haproxy.cfg").write_text("global\n")
    assert remove_ingress_proxy(tmp_path)
    assert not (tmp_path / STATE_SUBDIR / "haproxy.cfg").exists()


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_netlink_sockets_cost_no_resident_buffer():
    """Each socket's 1 MB receive buffer becomes resident only where the kernel writes a
    datagram (an idle agent keeps about nine sockets; zeroed by the process they were 9 MB)."""
    before = _rss_kb()
    socks = [NetlinkSocket(rcvbuf=1 << 16, sndbuf=1 << 16) for _ in range(8)]
    try:
        grown = _rss_kb() - before
    finally:
        for sock in socks:
            sock.close()
    assert grown < 2048, f"8 netlink sockets made {grown} kB resident"


def test_verifier_log_buffer_reads_as_a_c_string():
    buf = libbpf._log_buffer()
    assert len(buf) == libbpf._LOG_SIZE and buf.value == b""
    buf[0:5] = b"hello"
    assert buf.value == b"hello"


def test_a_first_sync_is_encoded_with_rule_expressions_as_kept():
    """Services' first sync (its prepared slots, both families): the transaction's text is the
    JSON of the commands with each rule's expressions spliced in as its chain keeps them --
    the same transaction as parsing them into objects first, without the MBs of objects."""
    import json

    from agentd.nft.libnftables import Nft
    from agentd.nft.ruleset import Ruleset, RuleExpr, plan
    from agentd.services import compiler

    table = compiler.Table("node1", None, (4, 6))
    commands = plan(Ruleset(), table.rs)
    rules = [c["add"]["rule"] for c in commands if "rule" in c.get("add", {})]
    assert len(rules) > 100 and all(type(r["expr"]) is RuleExpr for r in rules)
    parsed = [{"add": {"rule": {**c["add"]["rule"], "expr": c["add"]["rule"]["expr"].value()}}}
              if "rule" in c.get("add", {}) else c for c in commands]
    assert json.loads(Nft.encode(commands)) == {"nftables": [{"metainfo": {"json_schema_version": 1}}, *parsed]}
