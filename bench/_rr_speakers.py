"""The route reflectors of bench/rr_scale.py: agentd, BIRD 2 and GoBGP, one driver each.

Each reflects IPv4 unicast among N iBGP clients (AS 65000, RFC 4456 route-reflector
clients, cluster id = its address 10.1.0.1, hold time 90 s, passive, nothing installed
in the kernel).  How the clients are configured is one switch per speaker (``style``):

* ``range``: one entry for the whole client network 10.1.0.0/16, any peer from it accepted:
  agentd ``[[bgp.listen_ranges]]``, BIRD 2 ``neighbor range ... ; dynamic name``
  (BIRD 2.0.8+), GoBGP a peer group with ``[[dynamic-neighbors]]``;
* ``peers``: one entry per client: agentd ``[[bgp.peers]]`` (passive, rr_client),
  BIRD one ``protocol bgp`` per client from a template, GoBGP one ``[[neighbors]]`` each.

agentd's default is ``range`` once its configuration knows ``listen_ranges`` (the route-reflector
scale work's dynamic neighbours) and ``peers`` before; BIRD and GoBGP default to ``range`` (both take 2,000
dynamic clients without trouble on this machine; ``peers`` is there to compare).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from agentd.lab.netns import Netns
from bench._speakers import AgentdSpeaker, BenchError, Speaker, tool

RR_ADDR = "10.1.0.1"
RR_AS = 65000
CLIENT_NET = "10.1.0.0/16"
HOLD_TIME = 90
API_PORT = 9099
STYLES = ("range", "peers")


def agentd_knows_listen_ranges() -> bool:
    from agentd.config.settings import BgpConfig

    return "listen_ranges" in {f.name for f in dataclasses.fields(BgpConfig)}


def default_style(key: str) -> str:
    if key == "agentd":
        return "range" if agentd_knows_listen_ranges() else "peers"
    return "range"


class Reflector(Speaker):
    """A speaker as the route reflector of ``clients`` (their addresses)."""

    def __init__(self, ns: Netns, workdir: Path, clients: list[str], style: str) -> None:
        super().__init__(ns, workdir)
        if style not in STYLES:
            raise BenchError(f"unknown client style {style!r} (expected one of {', '.join(STYLES)})")
        self.clients = clients
        self.style = style

    def listen_backlog(self) -> int | None:
        """The accept queue of the listening socket on port 179 as the kernel has it (ss Send-Q)."""
        out = self.ns.exec("ss", "-Hltn", "sport = :179", check=False)
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "LISTEN":
                return int(parts[2])
        return None

    def listening(self) -> bool:
        return self.listen_backlog() is not None


class AgentdReflector(Reflector, AgentdSpeaker):
    key = "agentd"

    def __init__(self, ns: Netns, workdir: Path, clients: list[str], style: str) -> None:
        Reflector.__init__(self, ns, workdir, clients, style)
        self._conn = None
        self._buf = b""

    def write_config(self) -> None:
        if self.style == "range" and not agentd_knows_listen_ranges():
            raise BenchError("this agentd has no [[bgp.listen_ranges]] yet: use --clients agentd=peers")
        head = f"""[node]
name = "rr"
address = "{RR_ADDR}"
asn = {RR_AS}
route_reflector = true
cluster_id = "{RR_ADDR}"
[bgp]
listen = "{RR_ADDR}:179"
hold_time = {HOLD_TIME}
graceful_restart = false
listen_backlog = 4096
[api]
listen = "127.0.0.1:{API_PORT}"
[log]
level = "warning"
"""
        if self.style == "range":
            body = f"""
[[bgp.listen_ranges]]
prefix = "{CLIENT_NET}"
asn = {RR_AS}
rr_client = true
"""
        else:
            body = "".join(
                f'\n[[bgp.peers]]\naddress = "{a}"\nasn = {RR_AS}\npassive = true\nrr_client = true\n'
                for a in self.clients
            )
        (self.workdir / "agentd.toml").write_text(head + body)


class BirdReflector(Reflector):
    key = "bird"

    @property
    def sock(self) -> Path:
        return self.workdir / "bird.ctl"

    def write_config(self) -> None:
        # direct: the clients share the reflector's link, so next hops resolve on it
        # ("gateway direct"); the reflector keeps every client's NEXT_HOP (iBGP, RFC 4456 §10).
        common = f"""  local {RR_ADDR} as {RR_AS};
  direct;
  rr client;
  rr cluster id {RR_ADDR};
  hold time {HOLD_TIME};
  ipv4 {{ import all; export where source = RTS_BGP; gateway direct; }};
"""
        text = f"""log stderr {{ warning, error, fatal, bug }};
router id {RR_ADDR};
protocol device {{ }}
"""
        if self.style == "range":
            text += f"""protocol bgp clients {{
{common}  neighbor range {CLIENT_NET} internal;
  dynamic name "c";
}}
"""
        else:
            text += f"template bgp rrc {{\n{common}  passive on;\n}}\n"
            text += "".join(
                f"protocol bgp c{i} from rrc {{ neighbor {a} as {RR_AS}; }}\n" for i, a in enumerate(self.clients)
            )
        (self.workdir / "bird.conf").write_text(text)

    def argv(self) -> list[str]:
        return [tool("bird"), "-f", "-c", str(self.workdir / "bird.conf"), "-s", str(self.sock)]


class GobgpReflector(Reflector):
    key = "gobgp"

    def write_config(self) -> None:
        # Without a [zebra] section gobgpd installs nothing in the kernel.
        text = f"""[global.config]
  as = {RR_AS}
  router-id = "{RR_ADDR}"
  port = 179
  local-address-list = ["{RR_ADDR}"]
"""
        block = f"""  [{{kind}}.route-reflector.config]
    route-reflector-client = true
    route-reflector-cluster-id = "{RR_ADDR}"
  [{{kind}}.timers.config]
    hold-time = {HOLD_TIME}
  [{{kind}}.transport.config]
    passive-mode = true
  [[{{kind}}.afi-safis]]
    [{{kind}}.afi-safis.config]
      afi-safi-name = "ipv4-unicast"
"""
        if self.style == "range":
            text += f"""
[[peer-groups]]
  [peer-groups.config]
    peer-group-name = "clients"
    peer-as = {RR_AS}
{block.replace("{kind}", "peer-groups")}
[[dynamic-neighbors]]
  [dynamic-neighbors.config]
    prefix = "{CLIENT_NET}"
    peer-group = "clients"
"""
        else:
            per = block.replace("{kind}", "neighbors")
            text += "".join(
                f'\n[[neighbors]]\n  [neighbors.config]\n    neighbor-address = "{a}"\n    peer-as = {RR_AS}\n{per}'
                for a in self.clients
            )
        (self.workdir / "gobgpd.toml").write_text(text)

    def argv(self) -> list[str]:
        return [
            tool("gobgpd"), "-f", str(self.workdir / "gobgpd.toml"), "-t", "toml", "-l", "warn",
            "--api-hosts", f"unix://{self.workdir / 'gobgp.sock'}", "--pprof-disable",
        ]


REFLECTORS: dict[str, type[Reflector]] = {"agentd": AgentdReflector, "bird": BirdReflector, "gobgp": GobgpReflector}


def parse_styles(text: str) -> dict[str, str]:
    """``agentd=peers,bird=range`` -> {key: style}; one clear error otherwise."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(agentd|bird|gobgp)=(range|peers)", part)
        if m is None:
            raise ValueError(f"expected SPEAKER=range|peers (speakers agentd, bird, gobgp), got {part!r}")
        out[m.group(1)] = m.group(2)
    return out
