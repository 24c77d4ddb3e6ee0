"""Golden fixtures: bytes BIRD 2 really sent (tests/fixtures/bird, captured by capture.py).

Each ``<name>.hex`` is decoded and compared with ``<name>.json``; where our encoding is
canonical for the message the re-encoding must give the same bytes, otherwise the
fixture names the variant BIRD used and that variant must reproduce them.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

from proto import CodecContext, MessageReader, Update, decode_message

FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "bird"
HEX_FILES = sorted(FIXTURES.glob("*.hex"))

_spec = importlib.util.spec_from_file_location("bird_fixture_render", FIXTURES / "render.py")
assert _spec is not None and _spec.loader is not None
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)


def test_fixture_glob_matched() -> None:
    # An empty glob would make the parametrized test below pass vacuously.
    assert len(HEX_FILES) >= 1
    kinds = {path.stem.split("-", 2)[2] for path in HEX_FILES}
    for needed in ("open", "keepalive", "update-ipv4", "update-ipv6", "eor-ipv4", "eor-ipv6",
                   "withdraw-ipv4", "withdraw-ipv6", "notification", "borr", "eorr"):
        assert needed in kinds, f"no {needed} fixture"


@pytest.mark.parametrize("path", HEX_FILES, ids=[p.stem for p in HEX_FILES])
def test_bird_fixture(path: pathlib.Path) -> None:
    raw = bytes.fromhex(path.read_text().strip())
    expected = json.loads(path.with_suffix(".json").read_text())
    ctx = CodecContext(four_octet_as=expected["context"]["four_octet_as"])

    reader = MessageReader()
    reader.feed(raw)
    msg_type, body = reader.next_message()  # type: ignore[misc]
    assert reader.buffered == 0
    msg = decode_message(msg_type, body, ctx)
    assert render.render(msg) == expected["message"]

    if expected["canonical"]:
        assert msg.encode(ctx) == raw
    else:
        assert expected["variant"] == "mp-extended-length" and isinstance(msg, Update)
        assert render.encode_mp_extended(msg, ctx) == raw
        assert decode_message(msg_type, msg.encode(ctx)[19:], ctx) == msg


def test_bird_fixtures_cover_every_attribute_and_capability_we_decode() -> None:
    """Communities, large communities, MED, LOCAL_PREF, prepends, 4-octet AS, AS4_PATH,
    graceful restart and route refresh capabilities all appear in what BIRD sent."""
    seen: set[str] = set()
    for path in HEX_FILES:
        doc = json.loads(path.with_suffix(".json").read_text())
        m = doc["message"]
        attrs = m.get("attributes", {})
        seen |= {f"attr{code}" for code in attrs}
        if m["type"] == "OPEN":
            seen |= {f"cap{c['code']}" for c in m["capabilities"]}
        if any(len(seg[1]) > 1 and len(set(seg[1])) == 1 for seg in attrs.get("2", [])):
            seen.add("prepend")
        raw = bytes.fromhex(path.read_text().strip())
        if not doc["context"]["four_octet_as"] and b"\xc0\x11" in raw:
            seen.add("as4_path")
    for needed in ("attr4", "attr5", "attr8", "attr32", "attr7", "attr6", "attr9", "attr10", "attr99",
                   "cap1", "cap2", "cap64", "cap65", "prepend", "as4_path"):
        assert needed in seen, needed
