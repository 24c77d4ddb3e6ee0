"""Who holds the API's port (agentd/daemon/listeners.py), from /proc/net/tcp{,6} fixture text:
the agent names a squatter on EADDRINUSE, and the CLI sends the API token to no listener owned
by anyone but root or the agent's user (the token file's owner)."""

from __future__ import annotations

import http.server
import os
import threading
from ipaddress import ip_address

import pytest

from agentd import cli
from agentd.daemon import agent as agent_module
from agentd.daemon import auth, listeners

# 127.0.0.1:9099 LISTEN by uid 1000; 0.0.0.0:179 LISTEN by root; an established one by uid 1000 on 9098.
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:238B 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1 0000000000000000 100 0 0 10 0
   1: 00000000:00B3 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 17 1 0000000000000000 100 0 0 10 0
   2: 0100007F:238A 0100007F:D431 01 00000000:00000000 00:00000000 00000000  1000        0 99 1 0000000000000000 20 4 30 10 -1
"""
# [::1]:9099 LISTEN by uid 1001; [::]:8080 LISTEN by uid 33.
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:238B 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1001        0 555 1 0000000000000000 100 0 0 10 0
   1: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000    33        0 556 1 0000000000000000 100 0 0 10 0
"""


@pytest.fixture
def proc(tmp_path, monkeypatch):
    (tmp_path / "tcp").write_text(TCP)
    (tmp_path / "tcp6").write_text(TCP6)
    monkeypatch.setattr(listeners, "PROC_NET", tmp_path)
    return tmp_path


def test_listening_sockets_and_their_owners_are_read_from_proc_net_tcp():
    assert listeners.parse_listeners(TCP) == [(ip_address("127.0.0.1"), 9099, 1000), (ip_address("0.0.0.0"), 179, 0)]
    assert listeners.parse_listeners(TCP6) == [(ip_address("::1"), 9099, 1001), (ip_address("::"), 8080, 33)]
    assert listeners.parse_listeners("header only\n") == [] and listeners.parse_listeners("h\n garbage 0A x\n") == []


def test_the_owners_of_an_address_and_port(proc):
    assert listeners.listener_owners("127.0.0.1", 9099) == {1000}
    assert listeners.listener_owners("::1", 9099) == {1001}
    assert listeners.listener_owners("127.0.0.1", 9098) is None  # established, not listening
    assert listeners.listener_owners("10.0.0.5", 179) == {0}  # the wildcard takes it
    assert listeners.listener_owners("10.0.0.5", 179, wildcards=False) is None
    assert listeners.listener_owners("127.0.0.1", 8080) == {33}  # an IPv6 wildcard takes IPv4 too
    assert listeners.listener_owners("127.0.0.1", 9099, proc / "missing") is None  # no /proc: cannot tell
    assert listeners.untrusted_owner("127.0.0.1", 9099, agent_uid=0) == 1000
    assert listeners.untrusted_owner("127.0.0.1", 9099, agent_uid=1000) is None  # the agent's own user
    assert listeners.untrusted_owner("10.0.0.5", 179, agent_uid=999) is None  # root's


def test_the_agent_names_who_holds_its_api_port(proc):
    assert "uid 1000" in agent_module.api_port_holder("127.0.0.1", 9099)
    assert agent_module.api_port_holder("127.0.0.1", 9100) == ""  # nothing known there
    assert agent_module.api_port_holder("10.0.0.5", 179) == ""  # root's: another agent, said as before


def test_agentd_leave_sends_the_token_to_no_other_users_listener(tmp_path, monkeypatch):
    """After a crash the token file is still there; a local user bound 127.0.0.1:PORT meanwhile:
    root's `agentd leave` refuses (one line naming the uid) instead of sending it the token."""
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(202)
            self.end_headers()
            self.wfile.write(b'{"leaving": true}')

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    token_file = tmp_path / "api.token"
    token_file.write_text("t0ken\n")
    net = tmp_path / "net"
    net.mkdir()
    (net / "tcp").write_text(TCP.replace(":238B ", f":{port:04X} "))  # the squatter, uid 1000, on that port
    monkeypatch.setattr(listeners, "PROC_NET", net)
    monkeypatch.setattr(listeners, "file_owner", lambda path: 0)  # the agent runs as root
    try:
        with pytest.raises(cli.LeaveRefused, match=rf"^127.0.0.1:{port} is served by a process of uid 1000.*not sending it the API token"):
            cli.leave_running_agent("127.0.0.1", port, token_file)
        assert seen == []
        monkeypatch.setattr(listeners, "file_owner", lambda path: 1000)  # an agent run as that user (User=): it is its own
        server.timeout = 5
        try:  # (an answer without a leave's id: the older agent's way, waited for up to the timeout)
            cli.leave_running_agent("127.0.0.1", port, token_file, timeout=1.0)
        except cli.LeaveRefused:
            pass
        assert seen == ["Bearer t0ken"]
    finally:
        server.shutdown()
        server.server_close()
    assert os.path.exists(token_file)


def test_agentd_flows_sends_the_tokens_key_to_no_other_users_listener(proc, tmp_path, monkeypatch, capsys):
    import argparse

    token_file = tmp_path / "api.token"
    token_file.write_text("t0ken\n")
    monkeypatch.setattr(listeners, "file_owner", lambda path: 0)
    args = argparse.Namespace(api="http://127.0.0.1:9099", last=5, follow=False, cluster=True, output="text",
                              **{f"filter_{n.replace('-', '_')}": [] for n in cli.FLOW_FILTERS})  # fmt: skip
    assert cli.flows_command(args, token_file) == 1
    assert "127.0.0.1:9099 is served by a process of uid 1000" in capsys.readouterr().err


def test_agentd_flows_sends_nothing_where_it_cannot_tell_who_listens(tmp_path, monkeypatch, capsys):
    import argparse

    token_file = tmp_path / "api.token"
    token_file.write_text("t0ken\n")
    sent = []
    monkeypatch.setattr(cli, "api_open", lambda req, timeout, deadline=None, idle=None: sent.append(req))

    def unknowable(*a, **kw):
        raise ValueError("port out of range")

    monkeypatch.setattr(listeners, "squatter", unknowable)
    args = argparse.Namespace(api="http://127.0.0.1:9099", last=5, follow=False, cluster=True, output="text",
                              **{f"filter_{n.replace('-', '_')}": [] for n in cli.FLOW_FILTERS})  # fmt: skip
    assert cli.flows_command(args, token_file) == 1
    assert sent == []
    assert capsys.readouterr().err == ("agentd flows: http://127.0.0.1:9099: cannot check who listens there (port out "
                                       "of range): not sending it the API token\n")  # fmt: skip


@pytest.mark.parametrize(("api", "port"), [("https://127.0.0.1", 443), ("http://127.0.0.1", 80),
                                           ("https://127.0.0.1:9443/", 9443)])
def test_agentd_flows_asks_who_listens_on_the_schemes_default_port(api, port, tmp_path, monkeypatch, capsys):
    """An --api without a port is checked on the port the request goes to: 443 for https."""
    import argparse

    token_file = tmp_path / "api.token"
    token_file.write_text("t0ken\n")
    asked, sent = [], []
    monkeypatch.setattr(listeners, "squatter", lambda host, p, _tf: asked.append((host, p)) or "squatted")
    monkeypatch.setattr(cli, "api_open", lambda req, timeout, deadline=None, idle=None: sent.append(req))
    args = argparse.Namespace(api=api, last=5, follow=False, cluster=True, output="text",
                              **{f"filter_{n.replace('-', '_')}": [] for n in cli.FLOW_FILTERS})  # fmt: skip
    assert cli.flows_command(args, token_file) == 1
    assert asked == [("127.0.0.1", port)] and sent == []


# ------------------------------------------------------------------ leave: "no agent" is nothing taking the connection


def _closed_port() -> int:
    """A port of 127.0.0.1 nothing listens on (connections to it are refused)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_connection_taken_and_closed_without_an_answer_is_no_leave_without_the_agent(tmp_path, how):
    """A running agent whose API has all its connections taken (any local user can open them)
    closed each new one as it came: urllib's RemoteDisconnected (an OSError) was read as "no
    agent answers", and `agentd leave` ran the leave without the agent under the running one
    (its node out of etcd, its routes, tables and BPF data path removed).  Only a connection
    nothing takes means no agent."""
    import socket
    import struct

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            if how == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        with pytest.raises(cli.LeaveRefused, match=r"took the connection but closed it without an answer.*try again"):
            cli.leave_running_agent("127.0.0.1", port, tmp_path / "api.token", timeout=5)
    finally:
        server.close()


def test_nothing_answering_is_no_agent_unless_roots_or_the_agents_user_listens_there(proc, tmp_path, monkeypatch):
    """Refused (nothing took the connection): no agent, the leave runs without it -- unless a
    process of root's or the agent's user listens on the port (an agent starting, or stuck
    with its listen backlog full: what /proc/net/tcp says).  Another user's listener is no agent."""
    port = _closed_port()
    token_file = tmp_path / "api.token"
    assert cli.leave_running_agent("127.0.0.1", port, token_file, timeout=5) is None
    (proc / "tcp").write_text(TCP.replace(":238B ", f":{port:04X} ").replace("  1000        0 4242", "     0        0 4242"))
    with pytest.raises(cli.LeaveRefused, match=rf"^nothing answered at http://127.0.0.1:{port}/leave \(.*\), but a "
                                               rf"process of uid 0 .*listens on 127.0.0.1:{port}.*Not leaving without it"):
        cli.leave_running_agent("127.0.0.1", port, token_file, timeout=5)
    (proc / "tcp").write_text(TCP.replace(":238B ", f":{port:04X} "))  # uid 1000's: a squatter, not an agent
    assert cli.leave_running_agent("127.0.0.1", port, token_file, timeout=5) is None
    monkeypatch.setattr(listeners, "file_owner", lambda path: 1000)  # unless the agent runs as that user
    with pytest.raises(cli.LeaveRefused, match="process of uid 1000"):
        cli.leave_running_agent("127.0.0.1", port, token_file, timeout=5)



# ------------------------------------------------------------------ [api] listen on the node's own address

# 0.0.0.0:9099 LISTEN by uid 1000: a local user's wildcard listener on the API's port.
WILD = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:238B 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 1 1 0000000000000000 100 0 0 10 0
"""


def test_a_wildcard_listener_takes_a_connection_to_the_nodes_own_address_too(tmp_path, monkeypatch):
    """[api] listen on the node's address (10.0.0.1): another user's 0.0.0.0:9099 takes the
    connection to it (nothing bound 10.0.0.1:9099 itself) as it does one to 127.0.0.1; only
    loopback's were counted, and `agentd leave` sent that listener the token."""
    net = tmp_path / "net"
    net.mkdir()
    (net / "tcp").write_text(WILD)
    (net / "tcp6").write_text(WILD.splitlines()[0] + "\n")
    token_file = tmp_path / "api.token"
    token_file.write_text("t0ken\n")
    monkeypatch.setattr(listeners, "file_owner", lambda path: 0)
    refused = "10.0.0.1:9099 is served by a process of uid 1000"
    said = listeners.squatter("10.0.0.1", 9099, token_file, net, local=True)
    assert said.startswith(refused) and said.count("not sending it the API token") == 1, said
    assert listeners.squatter("127.0.0.1", 9099, token_file, net).startswith("127.0.0.1:9099 is served")
    monkeypatch.setattr(listeners, "is_local_address", lambda address: address == "10.0.0.1")
    assert listeners.squatter("10.0.0.1", 9099, token_file, net).startswith(refused)  # told by the address
    # Not this host's: the wildcard here is not what a connection there reaches.
    assert listeners.squatter("198.51.100.7", 9099, token_file, net) is None


def test_agentd_leave_on_the_nodes_address_sends_the_token_to_no_other_users_wildcard_listener(tmp_path, monkeypatch):
    """It refuses before connecting (the fake listener would have said {"leaving": true}, and
    the CLI "leaving etcd done" with exit 0 while the node stayed in etcd)."""
    net = tmp_path / "net"
    net.mkdir()
    (net / "tcp").write_text(WILD)
    monkeypatch.setattr(listeners, "PROC_NET", net)
    monkeypatch.setattr(listeners, "file_owner", lambda path: 0)
    token_file = tmp_path / "api.token"
    token_file.write_text("t0ken\n")
    connected = []
    monkeypatch.setattr(cli, "api_open", lambda req, **kw: connected.append(req) or pytest.fail("token sent"))
    with pytest.raises(cli.LeaveRefused, match=r"^10.0.0.1:9099 is served by a process of uid 1000.*not sending it the API token"):
        cli.leave_running_agent("10.0.0.1", 9099, token_file, timeout=1)
    assert connected == []


def test_nothing_answering_on_the_nodes_address_with_roots_wildcard_listener_there_is_no_leave_without_it(
        tmp_path, monkeypatch):  # fmt: skip
    """Refused on the node's address while root's 0.0.0.0:PORT listens (an agent starting with
    that listen address, a full backlog): not "no agent", as on loopback."""
    import urllib.error

    net = tmp_path / "net"
    net.mkdir()
    (net / "tcp").write_text(WILD.replace("  1000        0 1 ", "     0        0 1 "))
    monkeypatch.setattr(listeners, "PROC_NET", net)

    def refused(req, **kw):
        raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))

    monkeypatch.setattr(cli, "api_open", refused)
    with pytest.raises(cli.LeaveRefused, match=r"but a process of uid 0 .*listens on 10.0.0.1:9099"):
        cli.leave_running_agent("10.0.0.1", 9099, tmp_path / "api.token", timeout=1)


def test_this_hosts_addresses_are_told_from_others():
    import socket

    for address in ("127.0.0.1", "127.0.0.5", "::1", "[::1]", "0.0.0.0", "::"):
        assert listeners.is_local_address(address), address
    for address in ("198.51.100.7", "2001:db8::7", "not-an-address", ""):
        assert not listeners.is_local_address(address), address
    assert listeners.is_local_host("localhost") and not listeners.is_local_host("no-such-host.invalid")
    # This host's own address on the way out, if it has one: local (a bind test or the loopback
    # range would not tell it; the UDP connect sends nothing).
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.7", 9))
            mine = s.getsockname()[0]
        except OSError:  # no route out here
            mine = "127.0.0.1"
    assert listeners.is_local_address(mine) and listeners.is_local_host(mine)


def test_agentd_flows_sends_the_key_to_no_other_host(tmp_path, monkeypatch, capsys):
    """--api http://OTHER-HOST:PORT: that host's agent has a token of its own; this host's
    key went there in clear all the same.  Only to an address of this host."""
    import argparse
    import io
    import urllib.error

    token_file = tmp_path / "api.token"
    token_file.write_text("t0ken\n")
    monkeypatch.setattr(listeners, "file_owner", lambda path: 0)
    sent = []

    def api_open(req, timeout, deadline=None, idle=None):
        sent.append(dict(req.header_items()))
        raise urllib.error.HTTPError(req.full_url, 401, "Unauthorized", {}, io.BytesIO(b'{"error": "no"}'))

    monkeypatch.setattr(cli, "api_open", api_open)
    local = {"127.0.0.1", "192.0.2.7"}
    monkeypatch.setattr(listeners, "is_local_address", lambda address: address in local)
    monkeypatch.setattr(listeners, "PROC_NET", tmp_path / "none")  # who listens: cannot be told here
    args = argparse.Namespace(api="http://198.51.100.7:9099", last=5, follow=False, cluster=True, output="text",
                              **{f"filter_{n.replace('-', '_')}": [] for n in cli.FLOW_FILTERS})  # fmt: skip
    assert cli.flows_command(args, token_file) == 1
    assert sent == [{}]
    err = capsys.readouterr().err
    assert "401 other nodes' records need the API token, and 198.51.100.7 is not this host" in err, err
    assert "run agentd flows on that node" in err
    for api in ("http://127.0.0.1:9099", "http://192.0.2.7:9099"):  # loopback, the node's own address: sent
        sent.clear()
        args.api = api
        assert cli.flows_command(args, token_file) == 1
        assert sent == [{"Authorization": f"Bearer {auth.ui_key('t0ken')}"}], api


# ------------------------------------------------------------------ what a connection reaches (review s56 r10)

HEAD = TCP.splitlines()[0] + "\n"
BOB_V4 = "   0: 0100007F:238B 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 1 1\n"  # 127.0.0.1:9099
BOB_V6 = ("   0: 00000000000000000000000001000000:238B 00000000000000000000000000000000:0000 0A 00000000:00000000 "
          "00:00000000 00000000  1000 0 1 1\n")  # [::1]:9099  # fmt: skip


def _net(tmp_path, tcp: str = "", tcp6: str = ""):
    net = tmp_path / "net"
    net.mkdir(exist_ok=True)
    (net / "tcp").write_text(HEAD + tcp)
    (net / "tcp6").write_text(HEAD + tcp6)
    return net


@pytest.mark.parametrize(("listen", "bob"), [("0.0.0.0", "v4"), ("::", "v6"), ("[::]", "v6"), ("::ffff:0.0.0.0", "v4")])
def test_a_wildcard_api_listen_address_is_checked_at_loopback_where_a_connection_to_it_goes(
        listen, bob, tmp_path, monkeypatch):  # fmt: skip
    """[api] listen = 0.0.0.0 (or ::): `agentd leave` connects to it, which Linux takes as
    127.0.0.1 (::1); only listeners bound to the wildcard itself were counted, and another
    user's 127.0.0.1:9099 got the API token."""
    net = _net(tmp_path, BOB_V4 if bob == "v4" else "", BOB_V6 if bob == "v6" else "")
    token_file = tmp_path / "api.token"
    token_file.write_text("t0ken\n")
    monkeypatch.setattr(listeners, "file_owner", lambda path: 0)
    said = listeners.squatter(listen, 9099, token_file, net, local=True)
    assert said is not None and "is served by a process of uid 1000" in said, said
    if listen in ("0.0.0.0", "::", "[::]"):  # told this host's without a socket
        assert listeners.squatter(listen, 9099, token_file, net) is not None  # told local by the address
    assert listeners.squatter(listen, 9098, token_file, net, local=True) is None  # nothing on that port
    monkeypatch.setattr(listeners, "PROC_NET", net)
    connected = []
    monkeypatch.setattr(cli, "api_open", lambda req, **kw: connected.append(req) or pytest.fail("token sent"))
    with pytest.raises(cli.LeaveRefused, match="is served by a process of uid 1000.*not sending it the API token"):
        cli.leave_running_agent(listen.strip("[]"), 9099, token_file, timeout=1)
    assert connected == []


@pytest.mark.parametrize("listen", ["0.0.0.0", "::"])
def test_nothing_answering_on_a_wildcard_listen_address_with_roots_loopback_listener_is_no_leave_without_it(
        listen, tmp_path, monkeypatch):  # fmt: skip
    import urllib.error

    root = lambda line: line.replace("  1000 ", "     0 ")
    net = _net(tmp_path, root(BOB_V4) if listen == "0.0.0.0" else "", root(BOB_V6) if listen == "::" else "")
    monkeypatch.setattr(listeners, "PROC_NET", net)

    def refused(req, **kw):
        raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))

    monkeypatch.setattr(cli, "api_open", refused)
    with pytest.raises(cli.LeaveRefused, match=rf"but a process of uid 0 .*listens on {listen}:9099"):
        cli.leave_running_agent(listen, 9099, tmp_path / "api.token", timeout=1)


def _two_addresses(monkeypatch, name: str, *found: str) -> None:
    """getaddrinfo gives ``name`` these addresses, in this order (Debian's localhost: ::1 first)."""
    import socket

    real = socket.getaddrinfo

    def getaddrinfo(host, port, *a, **kw):
        if host != name:
            return real(host, port, *a, **kw)
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", (a, port or 0, 0, 0)) if ":" in a
                else (socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port or 0)) for a in found]  # fmt: skip

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_a_name_is_checked_at_each_of_its_addresses_the_client_may_fall_back_to(tmp_path, monkeypatch):
    """localhost is ::1 then 127.0.0.1: nothing on ::1:9099, another user's 127.0.0.1:9099.
    Only the first was checked; urllib, refused on ::1, sent the key to 127.0.0.1."""
    net = _net(tmp_path, BOB_V4)
    token_file = tmp_path / "api.token"
    token_file.write_text("t0ken\n")
    monkeypatch.setattr(listeners, "file_owner", lambda path: 0)
    _two_addresses(monkeypatch, "localhost", "::1", "127.0.0.1")
    said = listeners.squatter("localhost", 9099, token_file, net)
    assert said is not None and said.startswith("localhost:9099 is served by a process of uid 1000"), said
    assert listeners.squatter("localhost", 9098, token_file, net) is None
    # leave without the agent: root's listener on the second address is an agent all the same
    monkeypatch.setattr(listeners, "PROC_NET", _net(tmp_path, BOB_V4.replace("  1000 ", "     0 ")))
    assert "a process of uid 0" in cli._agent_listens("localhost", 9099, token_file)
    assert cli._agent_listens("localhost", 9098, token_file) is None


def test_a_name_with_a_remote_address_besides_a_local_one_is_not_this_host():
    """The key goes only where every address of the name is this host's: a connection may
    try any of them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(listeners, "is_local_address", lambda address: address == "127.0.0.1")
        _two_addresses(mp, "mixed.example", "127.0.0.1", "192.0.2.99")
        assert not listeners.is_local_host("mixed.example")
        _two_addresses(mp, "mixed.example", "127.0.0.1")
        assert listeners.is_local_host("mixed.example")


def test_an_ipv4_mapped_address_reaches_the_ipv4_listeners(tmp_path, monkeypatch):
    """An AF_INET6 connect to ::ffff:127.0.0.1 reaches 127.0.0.1:9099 (or 0.0.0.0:9099)."""
    token_file = tmp_path / "api.token"
    token_file.write_text("t0ken\n")
    monkeypatch.setattr(listeners, "file_owner", lambda path: 0)
    bob = [(ip_address("127.0.0.1"), 9099, 1000)]
    assert listeners.owners(bob, "::ffff:127.0.0.1", 9099) == {1000}
    assert listeners.owners(bob, "[::ffff:127.0.0.1]", 9099) == {1000}
    assert listeners.owners([(ip_address("0.0.0.0"), 9099, 1000)], "::ffff:127.0.0.1", 9099) == {1000}
    assert listeners.owners([(ip_address("::"), 9099, 1000)], "::ffff:127.0.0.1", 9099) == {1000}  # not v6only
    assert listeners.owners([(ip_address("::ffff:127.0.0.1"), 9099, 1000)], "127.0.0.1", 9099) == {1000}
    assert listeners.owners([(ip_address("0.0.0.0"), 9099, 1000)], "::ffff:127.0.0.1", 9099, wildcards=False) == set()
    said = listeners.squatter("::ffff:127.0.0.1", 9099, token_file, _net(tmp_path, BOB_V4), local=True)
    assert said is not None and said.startswith("::ffff:127.0.0.1:9099 is served by a process of uid 1000"), said
    wild = WILD.splitlines()[1] + "\n"  # 0.0.0.0:9099, uid 1000
    assert listeners.squatter("::ffff:127.0.0.1", 9099, token_file, _net(tmp_path, wild), local=True) is not None


def test_a_scoped_link_local_address_reaches_the_listener_bound_to_it(tmp_path, monkeypatch):
    """fe80::fc:ff:fe00:1%eth0 (as HostPort and --api take it) is the listener on
    fe80::fc:ff:fe00:1: /proc/net/tcp6 gives no scope, and a scoped address compared unequal."""
    import socket
    import sys

    raw = socket.inet_pton(socket.AF_INET6, "fe80::fc:ff:fe00:1")
    hexa = "".join(int.from_bytes(raw[i:i + 4], sys.byteorder).to_bytes(4, "big").hex().upper() for i in range(0, 16, 4))
    bob = BOB_V6.replace("00000000000000000000000001000000:238B", f"{hexa}:238B")
    token_file = tmp_path / "api.token"
    token_file.write_text("t0ken\n")
    monkeypatch.setattr(listeners, "file_owner", lambda path: 0)
    link_local = [(ip_address("fe80::fc:ff:fe00:1"), 9099, 1000)]
    for host in ("fe80::fc:ff:fe00:1%eth0", "[fe80::fc:ff:fe00:1%eth0]", "fe80::fc:ff:fe00:1%2"):
        assert listeners.owners(link_local, host, 9099, wildcards=False) == {1000}, host
    net = _net(tmp_path, "", bob)
    for local in (True, False):  # the exact listener, whether or not the address is told this host's
        said = listeners.squatter("fe80::fc:ff:fe00:1%eth0", 9099, token_file, net, local=local)
        assert said is not None and "is served by a process of uid 1000" in said, said
