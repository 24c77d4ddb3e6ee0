"""The executables as an operator runs them, against one lab built with `agentd lab up`
(2 nodes, a pod each): every check runs the real `agentd` / `agentd-cni` in a subprocess.

* A closed stdout (`agentd ... | head`) ends every command quietly, exit status 141
  (128 + SIGPIPE), and Ctrl-C (SIGINT to the process group, as a terminal sends it) with
  130: no traceback, no "Exception ignored" -- agentd, agentd lab, agentd flows, agentd-cni.
* A lab pod resolves docs/services.md's `web.shop.svc.cluster.local` through glibc (its
  resolv.conf: the node-local DNS, kubelet's search list, ndots:5) and reaches the Service by
  name with curl; a hostPort given with `agentd lab pod add --host-port` answers on the node.
* Service DNS over UDP: a headless Service with 40 endpoints is too big for 512 octets; the
  answer comes truncated (TC) and whole over TCP (dnspython), and glibc's `getent` gets all 40.
* `agentd lab restart node2` (graceful, then --kill) returns with the agent ready, its routes
  unchanged and the pods talking.
* POST /leave needs the node's API token: refused without it, `agentd leave` as a user who
  cannot read the token says so in one line, a second `agentd run` on the node stops without
  touching the token, and as root `agentd leave` decommissions the node (last).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import agentd
from agentd.lab.lab import Lab
from agentd.lab.netns import ETC_NETNS, list_names, unique_tag
from agentd.lab.wait import until

BIN = Path(sys.executable).parent
AGENTD, AGENTD_CNI = str(BIN / "agentd"), str(BIN / "agentd-cni")
DNS = "169.254.20.10"


class CliLab:
    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.env = dict(os.environ, AGENTD_LAB_ROOT=str(root))
        self.root = root

    def agentd(self, *args: str, input: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([AGENTD, *args], input=input, capture_output=True, text=True, env=self.env, timeout=timeout)

    def lab(self, *args: str, **kw) -> subprocess.CompletedProcess[str]:
        """``agentd lab COMMAND --name NAME ARGS`` (``agentd lab pod add --name NAME ...``)."""
        n = 2 if args[0] == "pod" else 1
        return self.agentd("lab", *args[:n], "--name", self.name, *args[n:], **kw)

    def exec(self, target: str, *argv: str, **kw) -> subprocess.CompletedProcess[str]:
        return self.lab("exec", target, "--", *argv, **kw)

    def state(self) -> Lab:
        return Lab.load(self.name, self.root)


@pytest.fixture(scope="module")
def cli_lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("labs")
    lab = CliLab("cl" + unique_tag("")[:6], root)
    try:
        up = lab.lab("up", "--nodes", "2", "--pods", "1", timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        yield lab
    finally:
        down = lab.lab("down", timeout=120)
        assert down.returncode == 0, down.stderr
        assert list_names(f"ad-{lab.name}-") == []
        leftovers = os.listdir(ETC_NETNS) if os.path.isdir(ETC_NETNS) else []
        assert not [n for n in leftovers if n.startswith(f"ad-{lab.name}-")], leftovers  # the pods' resolv.conf


def test_lab_pods_reach_a_service_by_name_and_a_host_port_from_the_cli(cli_lab: CliLab):
    """docs/services.md's walk-through: a pod added with `--port http=8080/TCP --host-port
    http=18080`, a Service applied with `agentd apply`, and from another node's pod
    `curl http://web.shop.svc.cluster.local/` (glibc's resolver, the lab pod's resolv.conf)."""
    add = cli_lab.lab("pod", "add", "node1", "shop/web", "--labels", "app=web", "--port", "http=8080/TCP",
                      "--host-port", "http=18080")  # fmt: skip
    assert add.returncode == 0 and ":18080/tcp -> 8080" in add.stdout, add.stdout + add.stderr
    web = cli_lab.state().pod("shop/web")
    server = web.ns.popen([sys.executable, "-m", "http.server", "8080"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        manifest = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\n" \
                   "spec: {selector: {app: web}, ports: [{name: http, port: 80, targetPort: http}]}\n"  # fmt: skip
        applied = cli_lab.exec("node1", "agentd", "apply", "-f", "-", input=manifest)
        assert applied.returncode == 0 and "service/web created" in applied.stdout, applied.stderr
        resolv = cli_lab.exec("node2-pod1", "cat", "/etc/resolv.conf")
        assert resolv.stdout.splitlines() == [
            f"nameserver {DNS}", "search default.svc.cluster.local svc.cluster.local cluster.local", "options ndots:5",
        ], resolv.stdout  # fmt: skip

        def by_name() -> bool:
            r = cli_lab.exec("node2-pod1", "curl", "-s", "-m", "5", "-o", "/dev/null", "-w", "%{http_code}",
                             "http://web.shop.svc.cluster.local/", timeout=30)  # fmt: skip
            return r.stdout == "200"

        until(by_name, 60, what="curl http://web.shop.svc.cluster.local/ from node2-pod1 to answer 200", interval=0.5)
        node1 = cli_lab.state().node("node1")
        r = cli_lab.exec("node2", "curl", "-s", "-m", "5", "-o", "/dev/null", "-w", "%{http_code}", f"http://{node1.address}:18080/")
        assert r.stdout == "200", (r.stdout, r.stderr)  # the hostPort, from another node
    finally:
        server.kill()
        server.wait(10)
    removed = cli_lab.lab("pod", "del", "shop/web")
    assert removed.returncode == 0 and not os.path.exists(web.ns.etc), removed.stderr  # its resolv.conf went too


BIG = 40  # endpoints: 40 A records are 656 octets of answer, over the 512 of a query without EDNS

ASK = """
import json, sys
import dns.flags, dns.message, dns.query
name, server = sys.argv[1], sys.argv[2]
plain = dns.message.make_query(name, "A")  # no EDNS, as glibc asks
udp = dns.query.udp(plain, server, timeout=3)
tcp = dns.query.tcp(plain, server, timeout=3)
edns = dns.query.udp(dns.message.make_query(name, "A", use_edns=0, payload=1232), server, timeout=3)
count = lambda m: sum(len(rrset) for rrset in m.answer)
print(json.dumps({"udp": [count(udp), bool(udp.flags & dns.flags.TC)], "tcp": [count(tcp), bool(tcp.flags & dns.flags.TC)],
                  "edns": [count(edns), bool(edns.flags & dns.flags.TC)]}))
"""


def test_a_dns_answer_too_big_for_udp_comes_truncated_and_whole_over_tcp(cli_lab: CliLab):
    addresses = [f"10.244.250.{i}" for i in range(1, BIG + 1)]  # answers only: nothing is sent to them
    docs = [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "big", "namespace": "shop"},
         "spec": {"clusterIP": "None", "ports": [{"name": "http", "port": 80}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "big-1", "namespace": "shop", "labels": {"kubernetes.io/service-name": "big"}},
         "addressType": "IPv4", "ports": [{"name": "http", "port": 80}],
         "endpoints": [{"addresses": [a], "conditions": {"ready": True}} for a in addresses]},
    ]  # fmt: skip
    applied = cli_lab.exec("node1", "agentd", "apply", "-f", "-", input="\n---\n".join(json.dumps(d) for d in docs))
    assert applied.returncode == 0, applied.stderr
    name = "big.shop.svc.cluster.local"

    def answered() -> dict | None:
        r = cli_lab.exec("node1-pod1", sys.executable, "-c", ASK, name, DNS, timeout=30)
        if r.returncode != 0:
            raise AssertionError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}")
        answer = json.loads(r.stdout)
        return answer if answer["tcp"][0] == BIG else None

    answer = until(answered, 60, what=f"{name} to have {BIG} records over TCP", interval=0.5, ignore=(AssertionError,))
    # Over UDP without EDNS: as many records as 512 octets hold, TC set (as CoreDNS cuts it).
    assert 0 < answer["udp"][0] < BIG and answer["udp"][1] is True, answer
    assert answer["tcp"] == [BIG, False] and answer["edns"] == [BIG, False], answer
    # glibc's stub resolver (no EDNS): TC over UDP, then the whole answer over TCP.
    r = cli_lab.exec("node1-pod1", "getent", "ahostsv4", name, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert sorted({line.split()[0] for line in r.stdout.splitlines()}) == sorted(addresses), r.stdout


def _closed_pipe_run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``argv`` writing into a pipe whose reader has already gone (`... | head` after head quit)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(argv, stdout=write, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env, timeout=60)
    finally:
        os.close(write)


def test_a_closed_stdout_ends_every_command_quietly(cli_lab: CliLab):
    node1 = cli_lab.state().node("node1")
    commands = {
        "agentd lab status": [AGENTD, "lab", "status", "--name", cli_lab.name],
        "agentd lab pod list": [AGENTD, "lab", "pod", "list", "--name", cli_lab.name],
        "agentd get pods -o yaml": ["ip", "netns", "exec", node1.ns.name, AGENTD, "get", "pods", "-o", "yaml",
                                    "--config", str(node1.config_path)],
        "agentd status --json": ["ip", "netns", "exec", node1.ns.name, AGENTD, "status", "--json"],
        "agentd check-config --show": [AGENTD, "check-config", "--show", "--config", str(node1.config_path)],
        "agentd-cni VERSION": [AGENTD_CNI],
        "agentd flows -f": ["ip", "netns", "exec", node1.ns.name, AGENTD, "flows", "-f", "--last", "1",
                            "--config", str(node1.config_path)],  # each line flushed: the first meets the closed pipe
    }  # fmt: skip
    env = dict(cli_lab.env, CNI_COMMAND="VERSION")
    # Something for `agentd flows` to print: a connection from node1's pod to node2's.
    pod1, pod2 = cli_lab.state().pod("node1-pod1"), cli_lab.state().pod("node2-pod1")
    until(lambda: cli_lab.exec("node1-pod1", "ping", "-c", "1", "-W", "1", pod2.ip).returncode == 0, 30,
          what=f"{pod1.name} reaching {pod2.name}")  # fmt: skip
    until(lambda: node1.api_or_none("/flows?last=1"), 30, what="a flow record on node1")
    for what, argv in commands.items():
        r = _closed_pipe_run(argv, env)
        assert (r.returncode, r.stderr) == (128 + signal.SIGPIPE, ""), (what, r.returncode, r.stderr)


def _interrupted(argv: list[str], env: dict[str, str], waiting, **kw) -> subprocess.CompletedProcess[str]:
    """Start ``argv`` in its own process group, wait until ``waiting(proc)``, then Ctrl-C it (SIGINT
    to the group, as a terminal does).

    It starts as a terminal's foreground job does, with SIGINT at its default action.  The test run
    may have inherited SIGINT ignored -- a shell without job control ignores SIGINT in what it
    starts in the background (``scripts/dev test &``, POSIX "Asynchronous Lists") -- and a
    command that starts with SIGINT ignored rightly keeps ignoring it, as Python does: it would
    sit out ``agentd status``'s own 5 s timeout instead.  ``env`` execs the command: same pid."""
    argv = ["env", "--default-signal=INT", *argv]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, **kw)  # fmt: skip
    try:
        until(lambda: waiting(proc), 30, what=f"{argv[:4]} to be waiting", abort=lambda: proc.poll() is not None and "it exited")
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):  # a failed wait left them open: a
            if pipe is not None:                             # ResourceWarning in a later test
                pipe.close()


def _reading_stdin(proc: subprocess.Popen) -> bool:
    """The process sits in read(0, ...) (its /proc syscall line: number 0, first argument 0)."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{proc.pid}/syscall").read_text().split()[:2] == ["0", "0x0"]
    return False


def _receiving(proc: subprocess.Popen) -> bool:
    """The process sits in recvfrom(2) or poll(2) (x86-64's numbers 45 and 7): reading an
    answer from a socket, or waiting for one under a timeout (`agentd flows -f` reads with
    one: a silent stream ends after FOLLOW_IDLE) (`ip netns exec` execs its command, so the
    pid is the command's)."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{proc.pid}/syscall").read_text().split()[:1] in (["45"], ["7"])
    return False


def test_ctrl_c_ends_every_command_with_130_and_no_traceback(cli_lab: CliLab):
    silent = socket.socket()  # an "agent" that takes the connection and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    silent.settimeout(30)
    accepted: list[socket.socket] = []
    try:
        def connected(_proc) -> bool:
            with contextlib.suppress(TimeoutError):
                silent.settimeout(0.05)
                accepted.append(silent.accept()[0])
            return bool(accepted)

        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        r = _interrupted([AGENTD, "status", "--api", url], cli_lab.env, connected)
        assert (r.returncode, r.stderr) == (130, ""), r
    finally:
        for s in (silent, *accepted):
            s.close()
    r = _interrupted([AGENTD_CNI], dict(cli_lab.env, CNI_COMMAND="ADD"), _reading_stdin, stdin=subprocess.PIPE)
    assert (r.returncode, r.stderr) == (130, ""), r
    node1 = cli_lab.state().node("node1")

    def sleeping(_proc) -> bool:
        return any(Path(f"/proc/{pid}/comm").read_text().strip() == "sleep" for pid in node1.ns.pids())

    r = _interrupted([AGENTD, "lab", "exec", "--name", cli_lab.name, "node1", "--", "sleep", "60"], cli_lab.env, sleeping)
    assert (r.returncode, r.stderr) == (130, ""), r

    r = _interrupted(["ip", "netns", "exec", node1.ns.name, AGENTD, "flows", "-f", "--last", "0",
                      "--config", str(node1.config_path)], cli_lab.env, _receiving)  # fmt: skip
    assert (r.returncode, r.stderr) == (130, ""), r


def test_lab_restart_brings_one_agent_back_with_its_routes(cli_lab: CliLab):
    """`agentd lab restart NODE` stops the node's agent (SIGTERM, or SIGKILL with --kill) and
    starts it again; it returns once the agent is ready, its routes unchanged, the pods talking."""
    lab = cli_lab.state()
    node2 = lab.node("node2")
    pod1, pod2 = (p for p in lab.pods)
    for extra in ((), ("--kill",)):
        old_pid = node2.agent_pid()
        r = cli_lab.lab("restart", "node2", *extra, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        how = "killed with SIGKILL" if extra else "stopped with SIGTERM"
        assert f"node2: agent (pid {old_pid}) {how}; started again as pid " in r.stdout, r.stdout
        new_pid = node2.agent_pid()
        assert new_pid not in (None, old_pid) and f"as pid {new_pid}, ready in " in r.stdout, r.stdout
        assert node2.api("/status")["ready"] is True
        routes = len(node2.kernel_routes())
        assert routes >= 1 and f"kernel routes (proto 143): {routes} before, {routes} after, {routes} unchanged" in r.stdout
        pod1.ns.exec("ping", "-c", "1", "-W", "2", pod2.ip)
    r = cli_lab.lab("restart", "node9")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"agentd lab restart: no node 'node9' in lab {cli_lab.name} (nodes: node1, node2)"], r.stderr


def test_leave_needs_the_api_token_last(cli_lab: CliLab):
    """node2 leaves: only with its API token, which only root reads."""
    node2 = cli_lab.state().node("node2")
    token_file = node2.token_path
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and token_file.stat().st_uid == 0
    post = "curl -s -o /dev/null -w %{http_code} -X POST http://127.0.0.1:9099/leave"
    assert cli_lab.exec("node2", *post.split()).stdout == "401"
    assert cli_lab.exec("node2", *post.split(), "-H", "Authorization: Bearer guess").stdout == "401"
    # Someone who cannot read the token file: told why, in one line; nothing happens.  (This
    # venv's interpreter may live where another user cannot go -- pyenv under /root -- so the
    # same `agentd` code runs on Debian's python3 with the checkout and the venv's packages.)
    path = f"{Path(agentd.__file__).parents[1]}:{sysconfig.get_paths()['purelib']}"
    nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "env", "-u", "AGENTD_CONFIG",
              f"PYTHONPATH={path}", f"AGENTD_NODE_NAME={node2.name}", f"AGENTD_NODE_ADDRESS={node2.address}",
              f"AGENTD_API_TOKEN_FILE={token_file}", "/usr/bin/python3", "-c",
              "import sys; from agentd.cli import main; sys.exit(main())", "leave"]  # fmt: skip
    r = subprocess.run(["ip", "netns", "exec", node2.ns.name, *nobody], capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "permission denied (run as root" in lines[0], r.stderr
    assert node2.api_or_none("/healthz") == {"healthy": True, "problems": []}
    # A second agent on the host: it cannot have the API, so it stops -- before it touches the
    # running one's token.
    token = token_file.read_text()
    r = cli_lab.exec("node2", "agentd", "run", timeout=60)
    assert r.returncode == 1 and "cannot serve the API on 127.0.0.1:9099" in r.stderr, r.stderr
    assert token_file.read_text() == token
    # Root, through the lab: the agent leaves and exits, and its token goes with it.
    r = cli_lab.exec("node2", "agentd", "leave", timeout=90)
    assert r.returncode == 0, r.stderr
    until(lambda: node2.agent_pid() is None, 30, what="node2's agent to exit after agentd leave")
    assert not token_file.exists()
