"""What flow records lose, said as it is: conntrack events the kernel could not queue for the
recorder are counted one by one (the socket's drop count), not once per overrun -- an overrun
that lost thousands of events says thousands in ``agentd_flow_events_lost_total`` and
``agentd status``; and a record of a node's stream too long to read is one record lost."""

import errno
import json
import socket

from agentd.flows.recorder import FlowRecorder, socket_drops
from agentd.kernel import netlink as nl
from agentd.kernel import netlink_ct as ct
from agentd.kernel.netlink_socket import NetlinkSocket

SENT = 2000


class _Nobody:
    def version(self) -> int:
        return 0

    def named_before(self, count):
        return 0, []

    def identity(self, ip):
        return None

    def service(self, ip, proto, port):
        return None

    def service_names(self):
        return self.service

    def drop(self, prefix):
        return None

    def pod_on(self, ifindex):
        return None


def test_lost_conntrack_events_are_counted_each(netns_factory):
    ns = netns_factory("loss")
    ns.ip("link", "set", "lo", "up")
    # Conntrack on in the namespace: a rule that looks at connection state.
    ns.exec("nft", "add", "table", "inet", "t")
    ns.exec("nft", "add", "chain", "inet", "t", "o", "{ type filter hook output priority 0; }")
    ns.exec("nft", "add", "rule", "inet", "t", "o", "ct", "state", "new", "accept")
    with ns.entered():
        sock = NetlinkSocket(rcvbuf=4096, sndbuf=1 << 16, protocol=nl.NETLINK_NETFILTER)
        sock.sock.setsockopt(nl.SOL_NETLINK, nl.NETLINK_ADD_MEMBERSHIP, ct.NFNLGRP_CONNTRACK_NEW)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    recorder = FlowRecorder("n", _Nobody(), "/nonexistent", group=143, clock=lambda: 0.0)
    recorder.ct_sock = sock
    try:
        with udp:
            for port in range(20000, 20000 + SENT):  # a connection, so a NEW event, each
                udp.sendto(b"x", ("127.0.0.1", port))
        read = 0
        while True:
            try:
                got = sock.recv_many()
            except OSError as err:  # ENOBUFS: said once for the overrun
                assert err.errno == errno.ENOBUFS
                continue
            if not got:
                break
            read += len(got)
        recorder._count_ct_drops()
        assert read < SENT // 10  # the 4 KB buffer held few
        assert socket_drops(sock.sock) == SENT - read
        assert recorder.lost["conntrack"] == SENT - read
        recorder._count_ct_drops()  # read again: nothing new lost, nothing counted twice
        assert recorder.lost["conntrack"] == SENT - read
    finally:
        recorder.ct_sock = None
        sock.close()


async def test_a_node_line_too_long_to_read_is_one_record_lost_and_the_stream_goes_on(monkeypatch):
    """A node whose stream has a line past what a gatherer reads (1 MiB: a record of pods with
    very many labels from an older agentd) is one record lost, numbered as it was, and the
    stream goes on past it -- not an error on which a follower asked for that record again,
    forever (cluster.LINE_MAX)."""
    from aiohttp import web

    from agentd.daemon import cluster
    from agentd.daemon.cluster import ClusterView

    # The stand-in node listens on loopback, which a node record may not name (the read token
    # is never sent there): let this one through.
    monkeypatch.setattr(cluster, "unsafe_address", lambda address: None)

    async def flows(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        try:
            await resp.write(b'{"ok": 1}\n' + b'{"seq": 7, "x": "' + b"y" * 4_000_000 + b'"}\n' + b'{"ok": 2}\n')
            await resp.write_eof()
        except ConnectionError:  # the reader gave up on the line, as it should
            pass
        return resp

    app = web.Application()
    app.router.add_get("/flows", flows)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    view = ClusterView("node1", lambda: {"node2": "127.0.0.1"}, port)
    view.token = "t"
    got = []
    try:
        async for line in view.lines("node2", "/flows"):
            got.append(line)
        assert len(got) == 3 and got[0] == b'{"ok": 1}\n' and got[2] == b'{"ok": 2}\n'
        lost = json.loads(got[1])
        assert (lost["seq"], lost["node"], lost["lost"]) == (7, "node2", 1) and len(got[1]) < 200
    finally:
        await view.close()
        await runner.cleanup()
