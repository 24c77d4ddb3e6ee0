"""The agent's own reactions: a subnet lost to another node stops it (exit status 1), a reload
applies the whole [log] section."""

import asyncio
from ipaddress import IPv4Address, IPv4Network

from agentd.config.settings import load_config
from agentd.daemon.agent import Agent
from agentd.datastore.store import SubnetLease

CFG = load_config(None, env={}, overrides={"node.address": "10.1.1.1", "node.name": "n1"})


def test_a_subnet_taken_by_another_node_stops_the_agent_with_status_1():
    async def main():
        agent = Agent(CFG)
        agent._subnet_lost(SubnetLease(IPv4Network("10.244.7.0/24"), "n1", IPv4Address("10.1.1.1"), "host-gw"))
        assert agent._stop.is_set() and agent.exit_status == 1
        ready, reasons = agent.readiness()
        assert not ready and any("10.244.7.0/24 was taken by another node" in r for r in reasons)

    asyncio.run(main())


def test_a_reload_applies_the_log_format_too(tmp_path):
    conf = tmp_path / "agentd.toml"
    conf.write_text('[node]\nname = "n1"\naddress = "10.1.1.1"\n[log]\nlevel = "debug"\nformat = "json"\n')
    applied = []

    async def main():
        agent = Agent(CFG, config_path=str(conf), set_logging=lambda level, fmt: applied.append((level, fmt)))
        agent._reload()
        assert agent.cfg.log.format == "json"

    asyncio.run(main())
    assert applied == [("debug", "json")]
