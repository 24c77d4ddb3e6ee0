"""The BFD Control packet codec (RFC 5880 §4.1) and the packet checks of §6.8.6."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto.bfd import (
    AUTH_PRESENT,
    CONTROL_LEN,
    DEMAND,
    FINAL,
    MULTIPOINT,
    POLL,
    BfdDecodeError,
    ControlPacket,
    Diag,
    State,
    diag_label,
)

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Captured from BIRD 2.0.12 (`protocol bfd`, 100 ms intervals, multiplier 3) on the veth of
# tests/system/test_bfd_bird.py: a periodic Up packet.
BIRD_UP = bytes.fromhex("20c00318" "f4c95dca" "41c4badb" "000186a0" "000186a0" "00000000")


def raw(
    *,
    version=1,
    diag=0,
    state=State.UP,
    flags=0,
    mult=3,
    length=CONTROL_LEN,
    my=0x01020304,
    your=0x0A0B0C0D,
    tx=100_000,
    rx=100_000,
    echo=0,
    tail=b"",
) -> bytes:
    return struct.pack("!BBBBIIIII", (version << 5) | diag, (state << 6) | flags, mult, length, my, your, tx, rx, echo) + tail


def test_golden_bird_packet():
    p = ControlPacket.decode(BIRD_UP)
    assert p.state is State.UP and p.diag == Diag.NONE
    assert not (p.poll or p.final or p.demand or p.control_plane_independent)
    assert (p.detect_mult, p.desired_min_tx, p.required_min_rx, p.required_min_echo_rx) == (3, 100_000, 100_000, 0)
    assert p.my_discriminator == 0xF4C95DCA and p.your_discriminator == 0x41C4BADB
    assert p.encode() == BIRD_UP


def test_fields_land_where_the_rfc_draws_them():
    p = ControlPacket(
        State.DOWN, my_discriminator=0xDEADBEEF, your_discriminator=0, diag=Diag.CONTROL_DETECTION_TIME_EXPIRED,
        detect_mult=5, desired_min_tx=1_000_000, required_min_rx=300_000, final=True, demand=True,
        control_plane_independent=True,
    )
    data = p.encode()
    assert len(data) == 24
    assert data[0] == 0x21  # version 1, diag 1
    assert data[1] == 0x40 | FINAL | 0x08 | DEMAND  # state Down, F, C, D
    assert data[2:4] == b"\x05\x18"
    assert data[4:8] == bytes.fromhex("deadbeef") and data[8:12] == bytes(4)
    assert struct.unpack("!III", data[12:24]) == (1_000_000, 300_000, 0)
    assert ControlPacket.decode(data) == p


def test_reserved_diagnostics_decode_as_plain_ints():
    p = ControlPacket.decode(raw(diag=17))
    assert p.diag == 17 and not isinstance(p.diag, Diag)
    assert diag_label(17) == "reserved (17)" and diag_label(Diag.ADMINISTRATIVELY_DOWN) == "Administratively Down"
    assert ControlPacket.decode(p.encode()) == p
    with pytest.raises(ValueError):
        ControlPacket(State.UP, my_discriminator=1, your_discriminator=1, diag=32).encode()


def test_bytes_beyond_the_length_field_and_a_longer_length_are_tolerated():
    # §6.8.6 discards only a Length below the minimum or beyond the UDP payload.
    assert ControlPacket.decode(raw(tail=b"\0" * 8)) == ControlPacket.decode(raw())
    assert ControlPacket.decode(raw(length=28, tail=b"\0" * 4)) == ControlPacket.decode(raw())


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "shorter than the 24-byte header"),
        (raw()[:23], "shorter than the 24-byte header"),
        (raw(version=0), "BFD version 0"),
        (raw(version=2), "BFD version 2"),
        (raw(length=23), "Length field 23 below the minimum 24"),
        (raw(length=0), "Length field 0 below the minimum 24"),
        (raw(flags=AUTH_PRESENT, length=24, tail=b"\0" * 4), "Length field 24 below the minimum 26"),
        (raw(length=25), "exceeds the 24-byte UDP payload"),
        (raw(length=255), "exceeds the 24-byte UDP payload"),
        (raw(mult=0), "Detect Mult is zero"),
        (raw(flags=MULTIPOINT), "Multipoint"),
        (raw(flags=POLL | FINAL), "Poll (P) and Final (F)"),
        (raw(my=0), "My Discriminator is zero"),
        (raw(your=0, state=State.UP), "Your Discriminator is zero in state Up"),
        (raw(your=0, state=State.INIT), "Your Discriminator is zero in state Init"),
        (raw(flags=AUTH_PRESENT, length=33, tail=bytes([1, 9, 1]) + b"secret\0\0"), "authentication"),
    ],
)
def test_malformed_packets_are_refused_with_one_clear_error(data, message):
    with pytest.raises(BfdDecodeError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        ControlPacket.decode(data)
    assert "\n" not in str(err.value)


def test_your_discriminator_zero_is_fine_in_down_and_admin_down():
    for state in (State.DOWN, State.ADMIN_DOWN):
        assert ControlPacket.decode(raw(your=0, state=state)).your_discriminator == 0


packets = st.builds(
    ControlPacket,
    state=st.sampled_from(State),
    my_discriminator=st.integers(1, 0xFFFFFFFF),
    your_discriminator=st.integers(1, 0xFFFFFFFF),
    diag=st.integers(0, 31),
    detect_mult=st.integers(1, 255),
    desired_min_tx=st.integers(0, 0xFFFFFFFF),
    required_min_rx=st.integers(0, 0xFFFFFFFF),
    required_min_echo_rx=st.integers(0, 0xFFFFFFFF),
    poll=st.booleans(),
    final=st.just(False),
    control_plane_independent=st.booleans(),
    demand=st.booleans(),
)


@FAST
@given(packets, st.booleans())
def test_round_trip(packet, final_instead_of_poll):
    if final_instead_of_poll and packet.poll:
        packet = ControlPacket(**{**{f: getattr(packet, f) for f in packet.__dataclass_fields__}, "poll": False,
                                  "final": True})
    data = packet.encode()
    assert len(data) == CONTROL_LEN
    assert ControlPacket.decode(data) == packet
    assert ControlPacket.decode(data).encode() == data


@FAST
@given(st.binary(max_size=64))
def test_random_bytes_raise_only_bfd_decode_error(data):
    try:
        p = ControlPacket.decode(data)
    except BfdDecodeError:
        return
    assert ControlPacket.decode(p.encode()) == p


@FAST
@given(packets, st.integers(0, CONTROL_LEN - 1), st.integers(0, 255))
def test_every_single_byte_mutation_decodes_or_raises_bfd_decode_error(packet, index, value):
    data = bytearray(packet.encode())
    data[index] = value
    try:
        ControlPacket.decode(bytes(data))
    except BfdDecodeError:
        pass
