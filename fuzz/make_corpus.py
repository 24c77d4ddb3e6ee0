"""(Re)generate the committed seed corpora and the known-failure reproducers.

    python fuzz/make_corpus.py

Writes fuzz/corpus/messages/, fuzz/corpus/session/ and the issue-10 reproducers under
fuzz/crashes/ from: the golden BIRD captures (tests/fixtures/bird/*.hex), messages built by
tests/unit/proto/codec_build.py, and the RFC 7606 / RFC 4271 malformed-message table of
tests/unit/proto/test_codec_malformed.py.  Files it does not make (inputs added by hand or
by a fuzzing run) are left alone; the ones it makes are rewritten with the same content.
"""

from __future__ import annotations

import json
import pathlib
import struct
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests" / "unit" / "proto"))

import codec_build as cb  # noqa: E402
import test_codec_malformed as malformed  # noqa: E402

from proto import CodecContext, Keepalive, Notification, RouteRefresh  # noqa: E402

BIRD = ROOT / "tests" / "fixtures" / "bird"
NEW, OLD, NEW_EXT = 0, 1, 2  # the messages harness's context octet
KEEPALIVE = Keepalive().encode()


def bird_fixtures() -> list[tuple[str, bool, bytes]]:
    """(name, four_octet_as, raw message) for every BIRD capture."""
    out = []
    for path in sorted(BIRD.glob("*.hex")):
        doc = json.loads(path.with_suffix(".json").read_text())
        out.append((path.stem, doc["context"]["four_octet_as"], bytes.fromhex(path.read_text().strip())))
    assert out, "no BIRD fixtures found"
    return out


def built_messages() -> dict[str, tuple[int, bytes]]:
    """Well-formed messages of every type, built octet by octet (codec_build)."""
    v6_nh = b"\x20\x01\x0d\xb8" + bytes(11) + b"\x01"
    many = b"".join(b"\x18\x0a" + struct.pack("!H", i) for i in range(1100))  # 1100 /24s
    comms = cb.attr(0xC0, 8, b"".join(struct.pack("!I", 0xFDE80000 + i) for i in range(4)))
    large = cb.attr(0xC0, 32, struct.pack("!III", 65000, 1, 2))
    unknown = cb.attr(0xE0, 99, b"opaque")
    rr = cb.attr(0x80, 9, bytes((10, 0, 0, 9))) + cb.attr(0x80, 10, bytes((10, 0, 0, 8)))
    med_lp = cb.attr(0x80, 4, b"\x00\x00\x00\x05") + cb.attr(0x40, 5, b"\x00\x00\x00\x64")
    agg = cb.attr(0x40, 6, b"") + cb.attr(0xC0, 7, struct.pack("!I", 65001) + bytes((10, 0, 0, 1)))
    as4 = cb.attr(0xC0, 17, cb.segment(2, [4200000000, 65002]))
    as_path_trans = cb.attr(0x40, 2, cb.segment(2, [23456, 65002], width=2))
    gr = cb.capability(64, b"\x00\x78\x00\x01\x01\x80\x00\x02\x01\x80")
    caps = cb.caps_param(
        cb.capability(1, b"\x00\x01\x00\x01"), cb.capability(1, b"\x00\x02\x00\x01"), cb.capability(2),
        gr, cb.capability(65, struct.pack("!I", 65001)),
    )  # fmt: skip
    return {
        "update-basic": (NEW, cb.update()),
        "update-all-attributes": (NEW, cb.update(cb.MANDATORY + med_lp + agg + comms + rr + large + unknown)),
        "update-withdraw": (NEW, cb.update(b"", b"", withdrawn=cb.NLRI)),
        "update-ipv6": (NEW, cb.update(cb.ORIGIN + cb.AS_PATH + cb.mp_reach(), b"")),
        "update-ipv6-link-local": (
            NEW, cb.update(cb.ORIGIN + cb.AS_PATH + cb.mp_reach(next_hop=v6_nh + b"\xfe\x80" + bytes(13) + b"\x01"), b"")
        ),
        "update-ipv6-withdraw": (NEW, cb.update(cb.mp_unreach(), b"")),
        "update-ipv4-in-mp-reach": (
            NEW, cb.update(cb.ORIGIN + cb.AS_PATH + cb.mp_reach(afi=1, next_hop=bytes((10, 0, 0, 1)), nlri=cb.NLRI), b"")
        ),
        "update-eor-ipv4": (NEW, cb.message(2, b"\x00\x00\x00\x00")),
        "update-eor-ipv6": (NEW, cb.update(cb.mp_unreach(withdrawn=b""), b"")),
        "update-old-as4-path": (OLD, cb.update(cb.ORIGIN + as_path_trans + cb.NEXT_HOP + as4)),
        "update-old-plain": (OLD, cb.update(cb.ORIGIN + cb.AS_PATH2 + cb.NEXT_HOP)),
        "update-extended-message": (NEW_EXT, cb.update(nlri=many)),
        "open-basic": (NEW, cb.open_msg()),
        "open-all-capabilities": (NEW, cb.open_msg(params=caps)),
        "keepalive": (NEW, KEEPALIVE),
        "notification-cease": (NEW, Notification.cease(2, "maintenance").encode()),
        "route-refresh": (NEW, RouteRefresh(1, 1).encode()),
        "stream-open-keepalive-updates": (
            NEW, cb.open_msg() + KEEPALIVE + cb.update() + cb.update(nlri=b"\x18\x0a\x00\x02") + cb.update(b"", b"", withdrawn=cb.NLRI)
        ),
    }  # fmt: skip


def malformed_cases() -> dict[str, tuple[int, bytes]]:
    """The malformed-message table, each case under its RFC clause id."""
    out = {}
    for case in malformed.CASES:
        raw = case.values[0]
        ctx = case.values[2] if len(case.values) > 2 else CodecContext()
        out[case.id] = (OLD if not ctx.four_octet_as else NEW, raw)
    assert len(out) >= 40, "the malformed table shrank"
    return out


# --------------------------------------------------------------------------- session

IBGP, OLD_A, GR_A, RR_CLIENT = 1, 2, 4, 32
HOLD_9, HOLD_0 = 1 << 3, 2 << 3


def data(raw: bytes) -> bytes:
    """A DATA record: A sends ``raw``."""
    return b"\x00" + struct.pack("!H", len(raw)) + raw


def wait(seconds: int) -> bytes:
    """A TIME record (multiples of 5 s, up to 315 s)."""
    return bytes((((seconds // 5) << 2) | 1,))


CLOSE, RECONNECT = b"\x02", b"\x03"


def session_seeds() -> dict[str, bytes]:
    seeds: dict[str, bytes] = {}
    for name, four, raw in bird_fixtures():
        if name.split("-")[0] == "ebgp6" or "update" in name or "eor" in name or "withdraw" in name:
            config = 0 if four else OLD_A
            seeds[f"bird-{name}"] = bytes((config,)) + data(raw) + wait(5) + data(KEEPALIVE)
    # A whole BIRD table in one go, then its withdrawals, for each session kind.
    for prefix, config in (("ebgp4", 0), ("ibgp4", IBGP), ("ebgp2", OLD_A)):
        msgs = [raw for name, _, raw in bird_fixtures() if name.startswith(prefix) and "-01-" not in name
                and "-02-" not in name]  # fmt: skip
        seeds[f"bird-{prefix}-all"] = bytes((config,)) + b"".join(data(m) for m in msgs)
    upd = cb.update()
    v6 = cb.update(cb.ORIGIN + cb.AS_PATH + cb.mp_reach(), b"")
    seeds.update({
        "announce-withdraw": b"\x00" + data(upd) + wait(10) + data(cb.update(b"", b"", withdrawn=cb.NLRI)),
        "announce-split-across-reads": b"\x00" + data(upd[:10]) + data(upd[10:30]) + data(upd[30:] + KEEPALIVE),
        "announce-ipv6-then-refresh": b"\x00" + data(v6) + data(RouteRefresh(2, 1).encode()),
        "announce-same-prefix-as-b": b"\x00" + data(cb.update(nlri=b"\x18\x0a\x03\x00")),
        "ibgp-announce": bytes((IBGP,)) + data(cb.update(cb.MANDATORY + cb.attr(0x40, 5, b"\x00\x00\x00\xc8"))),
        "ibgp-rr-client-announce": bytes((IBGP | RR_CLIENT,)) + data(upd) + data(v6),
        "old-speaker-announce": bytes((OLD_A,)) + data(cb.update(cb.ORIGIN + cb.AS_PATH2 + cb.NEXT_HOP)),
        "hold-timer-expires": bytes((HOLD_9,)) + data(upd) + wait(10),
        "hold-zero-long-wait": bytes((HOLD_0,)) + data(upd) + wait(315) + wait(315),
        "keepalives-keep-it-up": b"\x00" + data(upd) + b"".join(wait(60) + data(KEEPALIVE) for _ in range(4)),
        "notification-from-a": b"\x00" + data(upd) + data(Notification.cease(2, "bye").encode()),
        "malformed-update-resets": b"\x00" + data(upd) + data(cb.update(nlri=b"\x21\x0a\x00\x00\x00\x00")),
        "treat-as-withdraw": b"\x00" + data(upd) + data(cb.update(cb.attr(0x40, 1, b"\x03") + cb.AS_PATH + cb.NEXT_HOP)),
        "open-in-established": b"\x00" + data(cb.open_msg(my_as=65002)),
        "close-without-gr": b"\x00" + data(upd) + CLOSE + wait(10),
        "close-with-gr-and-return": bytes((GR_A,)) + data(upd) + CLOSE + wait(5) + RECONNECT + data(upd) +
        data(cb.message(2, b"\x00\x00\x00\x00")),
        "close-with-gr-restart-time-runs-out": bytes((GR_A,)) + data(upd) + CLOSE + wait(125),
        "gr-peer-reconnects-while-established": bytes((GR_A,)) + data(upd) + RECONNECT,
        "bad-marker": b"\x00" + data(b"\x00" * 19),
    })  # fmt: skip
    for case_id, (ctx_octet, raw) in malformed_cases().items():
        seeds[f"rfc-{case_id}"] = bytes((OLD_A if ctx_octet == OLD else 0,)) + data(cb.update()) + data(raw)
    return seeds


# --------------------------------------------------------------------------- known failures

def issue10_messages() -> dict[str, tuple[bytes, str]]:
    """Issue 10's routes that are accepted on import and cannot be exported."""
    v6_nh = b"\x20\x01\x0d\xb8" + bytes(11) + b"\x01"
    as1 = cb.attr(0x40, 2, cb.segment(2, [65001]))
    comms = cb.attr(0xD0, 8, b"".join(struct.pack("!I", 0xFDE90000 + i) for i in range(1011)))
    long_path = b"".join(cb.segment(2, [65001 + (i % 200)] * n, width=2) for i, n in enumerate((255, 255, 255, 255, 80)))
    trans_path = b"".join(cb.segment(2, [65001 + i] * 255, width=2) for i in range(3))
    short_as4 = cb.attr(0xC0, 17, cb.segment(2, [4200000000]))
    return {
        "as4-path-shorter-than-as-path-reencode": (
            bytes((OLD,)) + cb.update(cb.ORIGIN + cb.attr(0x50, 2, trans_path) + cb.NEXT_HOP + short_as4),
            "from an OLD speaker, a 765-AS AS_PATH with a 1-AS AS4_PATH (RFC 6793 §4.2.3 merge) is "
            "accepted; re-encoded for an OLD speaker AS4_PATH carries all 765 ASes and the UPDATE "
            "exceeds 4096 octets: Update.encode and encode_updates raise",
        ),
        "mp-reach-ipv4-16-octet-next-hop": (
            bytes((NEW,)) + cb.update(cb.ORIGIN + cb.AS_PATH + cb.mp_reach(afi=1, next_hop=v6_nh, nlri=cb.NLRI), b""),
            "MP_REACH_NLRI for IPv4 unicast with a 16-octet (IPv6) next hop is accepted; reflecting it to an "
            "iBGP client makes encode_updates raise (IPv4Address of an IPv6 next hop)",
        ),
        "communities-1011-fill-the-message": (
            bytes((NEW,)) + cb.update(cb.ORIGIN + as1 + cb.NEXT_HOP + comms),
            "1,011 communities make a 4,095-octet UPDATE that is accepted; exporting it (LOCAL_PREF added "
            "for iBGP, AS prepended for eBGP) leaves no room for a prefix: encode_updates raises",
        ),
        "as-path-1100-from-old-speaker": (
            bytes((OLD,)) + cb.update(cb.ORIGIN + cb.attr(0x50, 2, long_path) + cb.NEXT_HOP),
            "a 1,100-AS AS_PATH from a 2-octet (OLD) peer is accepted; exported to a 4-octet peer it "
            "doubles to 4,4xx octets: encode_updates raises",
        ),
    }


def session_crashes() -> dict[str, tuple[bytes, str]]:
    """The same routes sent by peer A of the session harness (exporting them to B raises), and
    what the session harness found in connection collisions."""
    msgs = issue10_messages()
    path_raw = msgs["as-path-1100-from-old-speaker"][0][1:]
    comms_raw = msgs["communities-1011-fill-the-message"][0][1:]
    return {
        "found-collision-with-established-orphans-it": (
            b"\x00" + RECONNECT,
            "A, established, opens a second connection (OPEN + KEEPALIVE in one read): the peer "
            "dumps the new session, then makes it the main one on its stale Established event; "
            "the established session's connection is never closed and A's routes stay (bgp/peer.py)",
        ),
        "issue10-as-path-1100-from-old-speaker": (
            bytes((OLD_A,)) + data(path_raw),
            "A (an OLD 2-octet speaker) announces a route with a 1,100-AS AS_PATH; exporting it to B "
            "(4-octet) raises ValueError out of Speaker.data_received (encode_updates in _export)",
        ),
        "issue10-communities-1011-fill-the-message": (
            b"\x00" + data(comms_raw),
            "A announces a 4,095-octet UPDATE (1,011 communities); exporting it to B with our AS "
            "prepended raises ValueError out of Speaker.data_received (encode_updates in _export)",
        ),
    }


def write(directory: pathlib.Path, files: dict[str, bytes]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (directory / name).write_bytes(content)


def main() -> None:
    messages = {f"bird-{name}": bytes((NEW if four else OLD,)) + raw for name, four, raw in bird_fixtures()}
    messages.update({f"build-{name}": bytes((ctx,)) + raw for name, (ctx, raw) in built_messages().items()})
    messages.update({f"rfc-{name}": bytes((ctx,)) + raw for name, (ctx, raw) in malformed_cases().items()})
    write(HERE / "corpus" / "messages", messages)
    write(HERE / "corpus" / "session", session_seeds())
    crashes = HERE / "crashes"
    for name, (raw, why) in issue10_messages().items():
        write(crashes / "messages", {f"issue10-{name}.bin": raw})
        (crashes / "messages" / f"issue10-{name}.txt").write_text(why + "\n")
    for name, (raw, why) in session_crashes().items():
        write(crashes / "session", {f"{name}.bin": raw})
        (crashes / "session" / f"{name}.txt").write_text(why + "\n")
    print(f"{len(messages)} messages seeds, {len(session_seeds())} session seeds, "
          f"{len(issue10_messages())} known-failure reproducers")  # fmt: skip


if __name__ == "__main__":
    main()
