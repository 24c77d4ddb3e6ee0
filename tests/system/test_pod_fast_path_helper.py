"""The pod fast path leaves a connection a conntrack helper reads to the stack: the helper must
see its payload.  Passive FTP between pods on two nodes of the lab (host-gw, the fast path on
by default), the server pod isolated by a policy that lets in TCP 21 only: the data
connection the PASV reply announces is let in only as RELATED -- the expectation the FTP
helper makes of that reply (``ct helper set "ftp"`` on the server's node, as an operator would
assign it).  Carried past conntrack, the reply never met the helper: the data connection came
NEW and the policy dropped it.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest
import pytest_asyncio
from netpol_lab import converged, namespace, np

from agentd.lab.lab import Lab, LabSpec
from agentd.lab.netns import unique_tag
from agentd.lab.wait import auntil

pytestmark = pytest.mark.asyncio(loop_scope="module")

FTP = 21
GUARD = np("ftp-only", "f", {
    "podSelector": {"matchLabels": {"pod": "server"}},
    "ingress": [{"ports": [{"protocol": "TCP", "port": FTP}]}],
})  # fmt: skip
# The helper on the server's node, for connections to port 21 (nft's ct helper object).
HELPER = """
table inet fphelper {
  ct helper ftp-21 { type "ftp" protocol tcp; }
  chain pre { type filter hook prerouting priority 0; policy accept; tcp dport 21 ct helper set "ftp-21"; }
}
"""
SIZE = 300_000
# A passive-mode FTP server, as much of one as ftplib's retrbinary needs: a data connection
# not made within 5 s is answered 425.
SERVER = r"""
import socket, sys
size = int(sys.argv[1])
srv = socket.create_server(("0.0.0.0", 21))
while True:
    c, _ = srv.accept()
    c.settimeout(30)
    f = c.makefile("rb")
    send = lambda line: c.sendall(line.encode() + b"\r\n")
    send("220 ready")
    pasv = None
    for raw in f:
        cmd = raw.decode().strip().split(" ", 1)[0].upper()
        if cmd == "USER":
            send("331 password")
        elif cmd == "PASS":
            send("230 in")
        elif cmd == "TYPE":
            send("200 ok")
        elif cmd == "PASV":
            ip = c.getsockname()[0]
            pasv = socket.create_server((ip, 0))
            port = pasv.getsockname()[1]
            send(f"227 Entering Passive Mode ({ip.replace('.', ',')},{port >> 8},{port & 255}).")
        elif cmd == "RETR" and pasv is not None:
            send("150 sending")
            pasv.settimeout(5)
            try:
                d, _ = pasv.accept()
            except OSError:
                send("425 no data connection")
                continue
            finally:
                pasv.close()
            d.sendall(b"x" * size)
            d.close()
            send("226 done")
        elif cmd == "QUIT":
            send("221 bye")
            break
        else:
            send("502 no")
    c.close()
"""
CLIENT = """
import ftplib, sys
ftp = ftplib.FTP(timeout=4)  # passive, as ftplib is by default
ftp.connect(sys.argv[1], 21)
ftp.login("u", "p")
got = []
try:
    ftp.retrbinary("RETR file", got.append)
except (OSError, ftplib.Error) as err:
    print(f"failed: {type(err).__name__} {err}")
else:
    print(sum(map(len, got)))
ftp.quit()
"""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lab(tmp_path_factory):
    lab = Lab(LabSpec(name="fh" + unique_tag("")[:6], nodes=2, pods=0), root=tmp_path_factory.mktemp("labs"))
    try:
        await lab.up(timeout=90)
        await lab.add_pod(lab.nodes[0], "f", "server", labels={"pod": "server"})
        await lab.add_pod(lab.nodes[1], "f", "client", labels={"pod": "client"})
        res = await lab.resources()
        await converged(lab, await res.apply([namespace("f", {"ns": "f"}), GUARD]))
        yield lab
    finally:
        await lab.down(keep_files=True)


def pod(lab: Lab, name: str) -> Any:
    return next(p for p in lab.pods if p.name == f"f/{name}")


def fast_path(node: Any) -> dict[str, Any]:
    return node.api("/status")["policy"]["fast_path"]


async def passive_ftp(lab: Lab) -> str:
    """One passive FTP transfer from f/server (node1) to f/client (node2): the bytes got, or why not."""
    server = pod(lab, "server")
    proc = server.ns.popen([sys.executable, "-c", SERVER, str(SIZE)], stdout=asyncio.subprocess.DEVNULL,
                           stderr=asyncio.subprocess.DEVNULL)
    try:
        await auntil(lambda: server.ns.exec("ss", "-Hltn", f"sport = :{FTP}").strip(), 10, in_thread=True,
                     what="the FTP server listening in f/server",
                     abort=lambda: proc.poll() is not None and f"the FTP server exited with status {proc.returncode}")
        _rc, out, err = await pod(lab, "client").ns.aexec(sys.executable, "-c", CLIENT, server.ip, check=False,
                                                           timeout=60)
        return out.decode().strip() or err.decode().strip()
    finally:
        proc.kill()
        proc.wait()


async def test_the_fast_path_is_on_between_the_nodes(lab: Lab):
    for node in lab.nodes:
        view = await asyncio.to_thread(fast_path, node)
        assert view["on"] and view["between_nodes"]["on"], view


async def test_without_a_helper_the_policy_drops_the_data_connection(lab: Lab):
    # The control connection is let in (port 21); the data connection, NEW to another port,
    # is not: what the transfer with the helper gets, it gets by the helper's expectation.
    assert (await passive_ftp(lab)).startswith("failed: ")


async def test_a_passive_ftp_transfer_through_the_ftp_helper_succeeds_with_the_fast_path_on(lab: Lab):
    node1 = lab.nodes[0]
    await asyncio.to_thread(node1.ns.exec, "nft", "-f", "-", input=HELPER.encode())
    try:
        def nat() -> int:  # the verdict the helper's connections are counted under
            return fast_path(node1)["packets"].get("nat", 0)

        before = await asyncio.to_thread(nat)
        assert await passive_ftp(lab) == str(SIZE)
        # The control connection's established segments were left to the stack (the helper
        # read the PASV reply), counted with the translated ones.
        await auntil(lambda: nat() > before, 10, interval=0.3, in_thread=True,
                     what="the fast path to count the helper's connection as left to the stack")
    finally:
        await asyncio.to_thread(node1.ns.exec, "nft", "delete", "table", "inet", "fphelper")
