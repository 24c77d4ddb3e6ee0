"""An agent's configuration for unit tests that build an Agent: node n1 at 10.1.1.1, every file
it writes under ``tmp_path`` (shared by test_agent_stop.py and test_leave_report.py)."""

from agentd.config.settings import Config, load_config


def agent_cfg(tmp_path, **overrides) -> Config:
    return load_config(None, env={}, overrides={
        "node.address": "10.1.1.1", "node.name": "n1", "cni.subnet_file": str(tmp_path / "subnet.env"),
        "cni.conf_dir": str(tmp_path / "net.d"), "cni.data_dir": str(tmp_path / "cni"),
        "api.token_file": str(tmp_path / "api.token"), "agent.state_dir": str(tmp_path / "state"),
        "agent.bpf_dir": str(tmp_path / "bpf"), **overrides})
