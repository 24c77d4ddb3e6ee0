"""The API token (agentd/daemon/auth.py): the file `agentd run` writes and `agentd leave` reads,
and the rule the API applies to a request that changes something.  Pure: files in tmp_path,
requests built with aiohttp's own make_mocked_request (no socket)."""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path
from unittest import mock

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from blocking import unblock, within
from multidict import CIMultiDict, CIMultiDictProxy

from agentd.daemon import auth


def test_the_token_file_is_new_at_every_write_0600_and_replaced_whole(tmp_path):
    path = tmp_path / "run" / "agentd" / "api.token"
    first = auth.write_token_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == first + "\n"
    assert len(first) >= 40 and auth.read_token_file(path) == first
    inode = path.stat().st_ino
    second = auth.write_token_file(path)
    assert second != first and auth.read_token_file(path) == second
    assert path.stat().st_ino != inode  # a new file renamed over the old one, never rewritten in place
    assert sorted(p.name for p in path.parent.iterdir()) == ["api.token"]  # no temporary file left
    auth.remove_token_file(path, first)  # another agent's token: the file stays
    assert path.exists()
    auth.remove_token_file(path, second)
    assert not path.exists()


def test_a_token_group_may_read_it(tmp_path):
    group = grp.getgrgid(os.getgid()).gr_name  # a group this process may give a file to
    path = tmp_path / "api.token"
    auth.write_token_file(path, group)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 and path.stat().st_gid == os.getgid()
    with pytest.raises(auth.TokenFileError, match="no group named 'no-such-group' on this host"):
        auth.write_token_file(tmp_path / "other.token", "no-such-group")
    assert not (tmp_path / "other.token").exists()


def test_reading_says_why_it_cannot(tmp_path):
    with pytest.raises(auth.TokenFileError, match="no API token at .*is the agent running"):
        auth.read_token_file(tmp_path / "missing")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(auth.TokenFileError, match="is empty"):
        auth.read_token_file(tmp_path / "empty")
    with mock.patch("os.open", side_effect=PermissionError(13, "Permission denied")):
        with pytest.raises(auth.TokenFileError, match="permission denied \\(run as root, or as a member of"):
            auth.read_token_file(tmp_path / "empty")
    with pytest.raises(auth.TokenFileError, match="cannot create .*empty for the API token: File exists"):
        auth.write_token_file(tmp_path / "empty" / "below-a-file")


def test_a_token_file_that_is_no_regular_file_is_refused_at_once(tmp_path):
    """[api] token_file read by leave, flows, ui: a FIFO blocked the command for ever,
    /dev/zero was read until memory ran out.  Read as the configuration file is: opened
    without waiting, a regular file only, a bounded read."""
    fifo = tmp_path / "api.token"
    os.mkfifo(fifo)
    try:
        err = within(1, auth.read_token_file, fifo).error
    finally:
        unblock(fifo)
    assert isinstance(err, auth.TokenFileError) and str(err) == f"cannot read the API token {fifo}: not a regular file"
    err = within(1, auth.read_token_file, Path("/dev/zero")).error
    assert isinstance(err, auth.TokenFileError) and "not a regular file" in str(err)
    big = tmp_path / "big"
    big.write_bytes(b"x" * (auth.TOKEN_FILE_MAX + 1))
    with pytest.raises(auth.TokenFileError, match=f"over {auth.TOKEN_FILE_MAX} bytes"):
        auth.read_token_file(big)
    token = auth.write_token_file(tmp_path / "t")
    try:
        assert within(1, auth.remove_token_file, fifo, token) is None  # an agent stopping: not blocked either
    finally:
        unblock(fifo)
    assert fifo.exists()
    auth.remove_token_file(tmp_path / "t", token)
    assert not (tmp_path / "t").exists()


def _request(method: str, remote: str, headers: dict[str, str] | None = None, local: str = "127.0.0.1") -> web.Request:
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda key, default=None: {
        "peername": (remote, 40000), "sockname": (local, 9099)}.get(key, default)
    return make_mocked_request(method, "/leave", headers=headers or {}, transport=transport)


async def _handled(request: web.Request) -> web.StreamResponse:
    return web.json_response({"leaving": True}, status=202)


async def test_changes_need_this_host_and_the_token_reads_need_nothing():
    token = "s3cret-token"
    guard = auth.guard(lambda: token)
    assert (await guard(_request("GET", "192.0.2.7"), _handled)).status == 202  # reads stay open
    assert (await guard(_request("POST", "127.0.0.1", auth.bearer_header(token)), _handled)).status == 202
    assert (await guard(_request("POST", "::1", auth.bearer_header(token)), _handled)).status == 202
    assert (await guard(_request("POST", "::ffff:127.0.0.1", auth.bearer_header(token)), _handled)).status == 202
    assert (await guard(_request("POST", "::ffff:192.0.2.7", auth.bearer_header(token)), _handled)).status == 403
    missing = await guard(_request("POST", "127.0.0.1"), _handled)
    assert missing.status == 401 and missing.headers["WWW-Authenticate"] == 'Bearer realm="agentd"'
    wrong = await guard(_request("DELETE", "127.0.0.1", auth.bearer_header("guess")), _handled)
    assert wrong.status == 401 and 'error="invalid_token"' in wrong.headers["WWW-Authenticate"]
    assert (await guard(_request("POST", "127.0.0.1", {"Authorization": f"Basic {token}"}), _handled)).status == 401
    far = await guard(_request("POST", "192.0.2.7", auth.bearer_header(token)), _handled)
    assert far.status == 403 and b"only accepted from this host" in far.body
    # [api] listen on the node's own address: the CLI's connection has that address at both ends.
    mine = await guard(_request("POST", "192.0.2.7", auth.bearer_header(token), local="192.0.2.7"), _handled)
    assert mine.status == 202
    other = await guard(_request("POST", "192.0.2.8", auth.bearer_header(token), local="192.0.2.7"), _handled)
    assert other.status == 403
    closed = auth.guard(lambda: None)  # a process without a token (agentd speaker) takes no changes
    assert (await closed(_request("POST", "127.0.0.1", auth.bearer_header(token)), _handled)).status == 403


@pytest.mark.parametrize("host, ok", [
    ("127.0.0.1:9099", True), ("127.0.0.1", True), ("[::1]:9099", True), ("localhost:9099", True),
    ("LOCALHOST.", True), ("192.0.2.7:9099", True), ("node1.example:9099", True),  # the listen host
    ("evil.example:9099", False), ("127.0.0.1.evil.example", False), ("localhost.evil.example:9099", False),
])  # fmt: skip
async def test_the_loopback_api_answers_only_hosts_that_name_it(host, ok):
    """DNS rebinding: a page of another site whose name resolves to 127.0.0.1 sends that name."""
    guard = auth.host_guard("node1.example")
    answer = await guard(_request("GET", "127.0.0.1", {"Host": host}), _handled)
    assert answer.status == (202 if ok else 421), host
    assert auth.allowed_host(None, "127.0.0.1")  # HTTP/1.0 without a Host: no browser sends that


def test_the_cluster_view_needs_the_token_or_the_browser_key():
    token = "s3cret-token"
    key = auth.ui_key(token)
    assert key != token and key == auth.ui_key(token) and auth.ui_key("other") != key
    assert auth.may_read_cluster(f"Bearer {token}", token) and auth.may_read_cluster(f"bearer {key}", token)
    for header in ("", "Bearer", "Bearer guess", f"Basic {token}", f"Bearer {auth.ui_key('other')}"):
        assert not auth.may_read_cluster(header, token), header
    assert not auth.may_read_cluster(f"Bearer {token}", None)  # no token here (agentd speaker): nobody


async def test_a_credential_that_is_not_utf8_is_just_wrong():
    """aiohttp hands header values over as UTF-8 with surrogateescape: a header of other bytes
    is refused (401) like any wrong token, on every listener, never a 500."""
    token = "s3cret-token"
    odd = b"Bearer \xff\xfe".decode("utf-8", "surrogateescape")
    assert not auth.may_read_cluster(odd, token)
    def presenting(method: str, remote: str) -> web.Request:
        request = _request(method, remote)
        request._headers = CIMultiDictProxy(CIMultiDict({"Authorization": odd}))  # as the parser leaves it
        return request

    assert (await auth.guard(lambda: token)(presenting("POST", "127.0.0.1"), _handled)).status == 401
    assert (await auth.read_guard(lambda: token)(presenting("GET", "192.0.2.7"), _handled)).status == 401


# -- the cluster view sends its read token only to a node's underlay address ---------------------

async def test_the_cluster_view_never_sends_the_token_to_a_loopback_or_link_local_node():
    from agentd.daemon.cluster import ClusterView, unsafe_address

    for bad in ("127.0.0.1", "::1", "169.254.169.254", "fe80::1", "0.0.0.0", "::", "224.0.0.1", "ff02::1",
                "255.255.255.255", "::ffff:127.0.0.1", "not-an-address"):
        assert unsafe_address(bad) is not None, bad
    for good in ("10.0.0.2", "172.30.0.11", "2001:db8::2", "fd00::2"):
        assert unsafe_address(good) is None, good
    addresses = {"n1": "10.0.0.1", "evil": "127.0.0.1", "meta": "169.254.169.254"}
    view = ClusterView("n1", lambda: addresses, 9098)
    view.token = "secret"
    answers = await view.gather("/status", lambda: {"me": True})
    assert answers["n1"] == {"me": True}
    assert answers["evil"] == {"error": "evil not asked: its address 127.0.0.1 is loopback, "
                                        "not a node's underlay address"}
    assert "link-local" in answers["meta"]["error"]
    assert view._session is None  # no connection was even prepared
    try:
        async for _ in view.lines("evil", "/flows", follow=True):
            raise AssertionError("nothing is read")
    except OSError as err:
        assert "loopback" in str(err)
    assert view._session is None


# ------------------------------------------------------------------ [api] read_token_file


def test_a_read_token_file_others_may_read_is_refused_and_warned_of(tmp_path):
    """[api] read_token_file was taken whatever its mode: a 0644 file handed every local user
    the cluster read token (every node's flows, routes and status).  Refused unless only its
    owner, root or the agent's user, may read it -- the cluster view stays off, the agent says
    why -- and `agentd check-config` (config_warnings) says so before the agent runs."""
    from agentd.config.settings import config_warnings, load_config, read_token_problem

    path = tmp_path / "read.token"
    path.write_text("s3cret\n")
    cfg = load_config(env={"AGENTD_API_READ_TOKEN_FILE": str(path), "AGENTD_NODE_NAME": "n1",
                           "AGENTD_NODE_ADDRESS": "192.0.2.1"})
    for mode in (0o644, 0o640, 0o604, 0o620):
        path.chmod(mode)
        with pytest.raises(auth.TokenFileError, match=rf"^\[api\] read_token_file {path} has mode {mode:04o}: .*chmod 600"):
            auth.read_line_token(path)
        (warning,) = config_warnings(cfg)
        assert warning.startswith(f"[api] read_token_file {path} has mode {mode:04o}") and "refuses" in warning
    for mode in (0o600, 0o400):
        path.chmod(mode)
        assert auth.read_line_token(path) == "s3cret" and config_warnings(cfg) == []
    # Another user's file: whoever owns it can change the token.
    st = path.stat()
    assert read_token_problem(st, path, agent_uid=st.st_uid) is None
    other = os.stat_result((st.st_mode, *st[1:4], 4242, *st[5:]))
    assert "owned by uid 4242, neither root nor the agent's user" in read_token_problem(other, path, agent_uid=1000)
    assert read_token_problem(os.stat_result((st.st_mode, *st[1:4], 0, *st[5:])), path, agent_uid=1000) is None
    assert "not a regular file" in read_token_problem(os.stat(tmp_path), tmp_path)
    path.write_text("one\ntwo\n")
    with pytest.raises(ValueError, match="one non-empty line"):
        auth.read_line_token(path)
