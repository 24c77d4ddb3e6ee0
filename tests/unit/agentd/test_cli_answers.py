"""What `agentd status`, `flows` and `leave` read of whatever answers at --api (review r8): an
answer is read to a bound in bytes and in time, its text reaches the terminal as one line, and
a stream cut short is said to be.  A loopback server of the test's own (one thread, closed at
the end of each test) plays the agent, or something that is not one."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentd import cli

RECORD = json.dumps({"time": 1700000000.0, "verdict": "FORWARDED", "src": {"ip": "10.244.1.2"},
                     "dst": {"ip": "10.244.2.3"}, "protocol": "tcp"}).encode() + b"\n"
ESCAPES = "line1\nline2\x1b[31mRED\x1b]0;pwned\x07"  # what a terminal would act on


def _request(conn: socket.socket) -> None:
    """Read the request's head (the commands send no body that matters)."""
    data = b""
    while b"\r\n\r\n" not in data:
        got = conn.recv(65536)
        if not got:
            return
        data += got


@contextlib.contextmanager
def server(answer: Callable[[socket.socket], None], tls: ssl.SSLContext | None = None) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a server that answers each connection with ``answer``
    (after reading the request), one at a time; stopped and joined on the way out.  With
    ``tls`` (a server's context), ``https://``: each connection is TLS first."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)  # the loop looks at `stop` between accepts
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with contextlib.ExitStack() as open_:
                open_.enter_context(conn)
                conn.settimeout(5)
                try:
                    if tls is not None:  # (the plain socket handed over to the TLS one)
                        conn = open_.enter_context(tls.wrap_socket(conn, server_side=True))
                    _request(conn)
                    answer(conn)
                except OSError:  # the command closed its end (or refused the certificate): done with it
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(10)
        listener.close()
        assert not thread.is_alive()


def endless(conn: socket.socket) -> None:
    """A 200 whose JSON never ends (64 MiB at most: the test's own bound, far over the CLI's)."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n[")
    for _ in range(64 * 16):
        conn.sendall(b"1," * 32768)


def dripping(conn: socket.socket) -> None:
    """A 200 whose body comes a byte at a time, each well within any read timeout (5 s at most)."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
    for _ in range(100):
        conn.sendall(b" ")
        time.sleep(0.05)


def error_with(text: str) -> Callable[[socket.socket], None]:
    def answer(conn: socket.socket) -> None:
        body = json.dumps({"error": text}).encode()
        conn.sendall(b"HTTP/1.1 500 X\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    return answer


def bad_status_line(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 \x1b[31mRED\x1b]0;pwned\x07\n\r\n\r\n")


def chunked_cut(conn: socket.socket) -> None:
    """A /flows stream whose agent died after a record: no last (empty) chunk."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n")
    conn.sendall(b"%x\r\n" % len(RECORD) + RECORD + b"\r\n")


def length_cut(conn: socket.socket) -> None:
    """A body shorter than its Content-Length."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nContent-Length: %d\r\n\r\n"
                 % (len(RECORD) * 3) + RECORD)


def chunked_whole(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n")
    conn.sendall(b"%x\r\n" % len(RECORD) + RECORD + b"\r\n0\r\n\r\n")


def status_cut(conn: socket.socket) -> None:
    body = json.dumps({"node": {"name": "n"}}).encode()
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (len(body) + 50) + body)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


@pytest.fixture(autouse=True)
def _no_agentd_environment(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")})
    token = tmp_path / "api.token"  # none: flows asks without a key
    monkeypatch.setattr(cli, "load_config", lambda *a, **kw: type("C", (), {"api": type("A", (), {"token_file": token})})())


def one_line(text: str) -> str:
    assert text.count("\n") == 1 and text.endswith("\n") and "\x1b" not in text and "\x07" not in text, repr(text)
    return text


# -- bounds: bytes and time ---------------------------------------------------------------------


def test_status_refuses_an_answer_that_never_ends(capsys):
    """`agentd status` against a server streaming JSON grew to 4.5 GB: at most API_BODY_MAX read."""
    with server(endless) as api:
        code, out, err = run(capsys, "status", "--api", api)
    assert (code, out) == (1, "")
    assert one_line(err) == f"agentd status: {api}/status answered with more than {cli.API_BODY_MAX} bytes: is that an agentd API?\n"


def test_status_has_a_deadline_for_the_whole_answer(capsys, monkeypatch):
    """A byte every 50 ms is within every read's timeout: the whole answer has its own bound."""
    monkeypatch.setattr(cli, "STATUS_WAIT", 0.5, raising=False)
    with server(dripping) as api:
        start = time.monotonic()
        code, out, err = run(capsys, "status", "--api", api)
        took = time.monotonic() - start
    assert (code, out) == (1, "") and took < 3, took
    assert one_line(err) == f"agentd status: {api}/status did not answer whole within 0.5 s\n"


def test_leave_honours_its_timeout_and_refuses_an_endless_answer():
    """`leave --timeout 5` ran past 15 s (5.1 GB read) against a streaming answer to POST /leave."""
    with server(dripping) as api:
        port = int(api.rsplit(":", 1)[1])
        start = time.monotonic()
        with pytest.raises(cli.LeaveRefused, match=r"took the request but did not answer within 1 s"):
            cli.leave_running_agent("127.0.0.1", port, Path("/nonexistent/api.token"), timeout=1)
        assert time.monotonic() - start < 3
    with server(endless) as api:
        port = int(api.rsplit(":", 1)[1])
        with pytest.raises(cli.LeaveRefused, match=rf"not as an agent taking a leave: more than {cli.API_BODY_MAX} bytes"):
            cli.leave_running_agent("127.0.0.1", port, Path("/nonexistent/api.token"), timeout=60)


def test_flows_has_a_deadline_and_a_bound_on_its_lines(capsys, monkeypatch):
    monkeypatch.setattr(cli, "FLOWS_WAIT", 0.5, raising=False)
    with server(dripping) as api:
        start = time.monotonic()
        code, out, err = run(capsys, "flows", "--api", api)
        assert (code, out) == (1, "") and time.monotonic() - start < 3
    assert one_line(err) == f"agentd flows: the stream from {api} broke: not whole within 0.5 s\n"
    with server(endless) as api:
        code, out, err = run(capsys, "flows", "--api", api)
    assert (code, out) == (1, "")
    assert one_line(err).endswith(f"answered with a line of more than {cli.FLOW_LINE_MAX} bytes: is that an agentd API?\n")


def gone_silent(keepalives: int) -> Callable[[socket.socket], None]:
    """A followed stream: its head and ``keepalives`` empty lines, then nothing (the agent's host
    vanished, a partition: no keep-alive, no FIN), until the command goes."""
    def answer(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(keepalives):
            conn.sendall(b"1\r\n\n\r\n")
        conn.settimeout(10)
        conn.recv(1)  # until the command closes its end (the test's bound: 10 s)
    return answer


@pytest.mark.parametrize("over", ["http", "https"])
def test_a_followed_stream_gone_silent_ends(capsys, monkeypatch, request, over):
    """`agentd flows -f` waited forever on a stream that went silent: the agent sends an empty
    line every 10 s, so 2.5 intervals without one (FOLLOW_IDLE, what the agent's own gatherer
    waits) is a stream gone.  Before its first line, FLOWS_WAIT (-A gathers the last N first)."""
    from agentd.daemon import cluster

    assert cli.FOLLOW_IDLE == cluster.FOLLOW_IDLE
    monkeypatch.setattr(cli, "FOLLOW_IDLE", 0.2)
    tls = request.getfixturevalue("tls") if over == "https" else None
    with server(gone_silent(1), tls) as api:
        start = time.monotonic()
        code, out, err = run(capsys, "flows", "-f", "--api", api)
        assert (code, out) == (1, "") and time.monotonic() - start < 1
    assert one_line(err) == f"agentd flows: the stream from {api} broke: no keep-alive within 0.2 s: the stream is gone\n"
    monkeypatch.setattr(cli, "FLOWS_WAIT", 0.3)
    with server(gone_silent(0), tls) as api:
        start = time.monotonic()
        code, out, err = run(capsys, "flows", "-f", "--api", api)
        assert (code, out) == (1, "") and 0.3 <= time.monotonic() - start < 1.5
    assert one_line(err) == f"agentd flows: the stream from {api} broke: no line within 0.3 s\n"


def flows_with(body: bytes) -> Callable[[socket.socket], None]:
    """A whole /flows answer of ``body`` (its lines)."""
    def answer(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nContent-Length: %d\r\n\r\n"
                     % len(body) + body)
    return answer


@pytest.mark.parametrize("body, says", [
    (b"[1, 2]", "answered, but not with flow records: is that an agentd API?"),
    (b"null", "answered, but not with flow records: is that an agentd API?"),
    (b'"str"', "answered, but not with flow records: is that an agentd API?"),
    (b'{"src": "x"}', "answered with a record that is not an agentd flow record (AttributeError: "),
    (b'{"service": "shop/web"}', "answered with a record that is not an agentd flow record (AttributeError: "),
], ids=["list", "null", "string", "src-string", "service-string"])
def test_flows_refuses_lines_that_are_no_flow_records_in_one_line(capsys, body, says):
    """A JSON line that is not a well-formed flow record was a traceback (AttributeError from
    render.line): one line, exit 1, after what came before it.  (A time no clock shows, 1e300,
    is rendered ``-`` by render.line itself: tests/unit/agentd/test_flows.py.)"""
    with server(flows_with(RECORD + body + b"\n" + RECORD)) as api:
        code, out, err = run(capsys, "flows", "--api", api)
    assert code == 1 and len(out.splitlines()) == 1 and "10.244.1.2" in out, (out, err)
    assert one_line(err).startswith(f"agentd flows: {api}/flows?last=20 {says}"), err


def test_status_json_refuses_an_answer_that_is_no_agentd_status(capsys):
    """Served [1]: `agentd status` said so (exit 1), `agentd status --json` printed it, exit 0."""
    def answer(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 3\r\n\r\n[1]")

    with server(answer) as api:
        for extra in ([], ["--json"]):
            code, out, err = run(capsys, "status", *extra, "--api", api)
            assert (code, out) == (1, ""), extra
            assert one_line(err) == f"agentd status: {api}/status did not answer with an agentd status (no 'node' object)\n"


def test_an_error_answer_is_read_to_a_bound(capsys):
    def huge_error(conn):
        conn.sendall(b"HTTP/1.1 500 X\r\nContent-Type: application/json\r\n\r\n{\"error\": \"")
        endless(conn)

    with server(huge_error) as api:
        code, _, err = run(capsys, "status", "--api", api)
        assert code == 1 and one_line(err) == f"agentd status: {api}/status: HTTP 500 X\n"
        code, _, err = run(capsys, "flows", "--api", api)
        assert code == 1 and one_line(err).startswith(f"agentd flows: {api}/flows?last=20: 500 ")


@pytest.fixture
def tls(tmp_path, monkeypatch) -> ssl.SSLContext:
    """A server's TLS context with a throwaway self-signed certificate for 127.0.0.1, which the
    CLI's https connections trust (the default context urllib makes, given that certificate)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "api.crt", tmp_path / "api.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    monkeypatch.setattr(ssl, "_create_default_https_context", lambda: ssl.create_default_context(cafile=cert_file))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    return context


def test_https_answers_have_the_same_bounds(capsys, monkeypatch, tls):
    """An https:// --api had only the per-read timeout: a byte every 50 ms kept `status`,
    `flows` and `leave` waiting past their bounds.  The whole answer, over TLS too, within
    the wait; and read to :data:`API_BODY_MAX` bytes."""
    monkeypatch.setattr(cli, "STATUS_WAIT", 0.5, raising=False)
    monkeypatch.setattr(cli, "FLOWS_WAIT", 0.5, raising=False)
    with server(dripping, tls) as api:
        assert api.startswith("https://")
        start = time.monotonic()
        code, out, err = run(capsys, "status", "--api", api)
        assert (code, out) == (1, "") and time.monotonic() - start < 3
        assert one_line(err) == f"agentd status: {api}/status did not answer whole within 0.5 s\n"
        start = time.monotonic()
        code, out, err = run(capsys, "flows", "--api", api)
        assert (code, out) == (1, "") and time.monotonic() - start < 3
        assert one_line(err) == f"agentd flows: the stream from {api} broke: not whole within 0.5 s\n"
    with server(endless, tls) as api:
        code, out, err = run(capsys, "status", "--api", api)
    assert (code, out) == (1, "")
    assert one_line(err) == f"agentd status: {api}/status answered with more than {cli.API_BODY_MAX} bytes: is that an agentd API?\n"
    with server(dripping, tls) as api:
        start = time.monotonic()
        with pytest.raises(TimeoutError), cli.api_open(api + "/leave", timeout=5,
                                                       deadline=time.monotonic() + 0.5) as resp:
            cli.read_answer(resp)
        assert time.monotonic() - start < 3


def test_https_is_still_checked(capsys):
    """The bounded https connection still checks the server's certificate (none trusted here)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with server(endless, context) as api:
        code, _, err = run(capsys, "status", "--api", api)
    assert code == 1 and one_line(err).startswith(f"agentd status: cannot reach the agent at {api}/status: ")


# -- server text: one line, no escape sequences -------------------------------------------------


def test_an_error_answers_text_is_one_line(capsys, tmp_path):
    token = tmp_path / "leave.token"
    token.write_text("t0ken\n")
    token.chmod(0o600)
    with server(error_with(ESCAPES)) as api:
        code, _, err = run(capsys, "status", "--api", api)
        assert code == 1 and one_line(err) == (f"agentd status: {api}/status: "
                                               "line1\\nline2\\x1b[31mRED\\x1b]0;pwned\\x07\n")
        code, _, err = run(capsys, "flows", "--api", api)
        assert code == 1 and one_line(err).endswith(": 500 line1\\nline2\\x1b[31mRED\\x1b]0;pwned\\x07\n")
        port = int(api.rsplit(":", 1)[1])
        with pytest.raises(cli.LeaveRefused) as refused:
            cli.leave_running_agent("127.0.0.1", port, token, timeout=5)
        assert str(refused.value) == (f"the agent at {api}/leave refused: "
                                      "line1\\nline2\\x1b[31mRED\\x1b]0;pwned\\x07")
    with server(error_with("x" * 100_000)) as api:
        code, _, err = run(capsys, "status", "--api", api)
        assert code == 1 and len(one_line(err)) < 500


def test_a_bad_status_lines_text_is_one_line(capsys):
    with server(bad_status_line) as api:
        code, _, err = run(capsys, "status", "--api", api)
        assert code == 1 and one_line(err).startswith(f"agentd status: cannot reach the agent at {api}/status: HTTP/1.1 \\x1b[31mRED")
        code, _, err = run(capsys, "flows", "--api", api)
        assert code == 1 and one_line(err).startswith(f"agentd flows: cannot reach the agent at {api}: HTTP/1.1 \\x1b[31mRED")


def test_every_field_of_the_status_is_shown_on_its_own_line(capsys, monkeypatch):
    """The node's name, address, AS, backend and the datastore's endpoint went to the terminal
    as sent; any string of the answer, shortened."""
    evil = "n\n\x1b[2J\x1b]0;pwned\x07"
    reply = {"node": {"name": evil, "address": evil, "asn": evil, "backend": evil, "subnet": evil},
             "datastore": {"connected": True, "endpoint": evil, "endpoints": [evil, "b"]},
             "routes": {"programmed": evil}, "policy": {"policies": evil, "local_pods": evil},
             "ingress": {"running": True, "pid": evil, "worker": evil, "http_port": evil},
             "bgp": {"peers": [{"address": "10.0.0.2", "state": evil, "description": "x" * 5000}]}}
    monkeypatch.setattr(cli, "fetch_json", lambda url, timeout=5.0: reply)
    code, out, err = run(capsys, "status")
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out
    shown = "n\\n\\x1b[2J\\x1b]0;pwned\\x07"
    lines = out.splitlines()
    assert f"Node {shown}  address {shown}  AS {shown}" in lines
    assert f"Subnet {shown}  backend {shown}" in lines
    assert any(line.startswith(f"Routes programmed {shown}  ") and line.endswith(f"({shown})") for line in lines)
    assert max(map(len, lines)) < 1000


# -- streams cut short --------------------------------------------------------------------------


@pytest.mark.parametrize("answer, how", [(chunked_cut, "it ended before its last chunk"),
                                         (length_cut, f"it ended {len(RECORD) * 2} bytes short of its Content-Length")])
def test_a_flows_stream_cut_short_is_no_success(capsys, answer, how):
    """A stream whose agent died before its last chunk (or short of its Content-Length) exited 0
    with what had come: the records are printed, and the exit status says they are not all."""
    with server(answer) as api:
        code, out, err = run(capsys, "flows", "--api", api)
    assert code == 1 and len(out.splitlines()) == 1 and "10.244.1.2" in out
    assert one_line(err) == f"agentd flows: the stream from {api} broke: {how}\n"
    with server(chunked_whole) as api:
        assert run(capsys, "flows", "--api", api)[0] == 0


def test_a_status_answer_cut_short_is_said(capsys):
    with server(status_cut) as api:
        code, out, err = run(capsys, "status", "--api", api)
    assert (code, out) == (1, "")
    assert one_line(err) == (f"agentd status: the answer from {api}/status broke off: it ended 50 bytes short of "
                             "its Content-Length (23 bytes read)\n")


# -- the API's address --------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["status", "flows"])
def test_a_bad_url_from_the_environment_names_the_variable(capsys, monkeypatch, command):
    monkeypatch.setitem(os.environ, "AGENTD_STATUS_URL", "http://127.0.0.1:99999")
    code, _, err = run(capsys, command)
    assert code == 2 and one_line(err).startswith(f"agentd {command}: AGENTD_STATUS_URL 'http://127.0.0.1:99999': the port")
    code, _, err = run(capsys, command, "--api", "ftp://x")
    assert code == 2 and err.startswith(f"agentd {command}: --api 'ftp://x': expected http://")
