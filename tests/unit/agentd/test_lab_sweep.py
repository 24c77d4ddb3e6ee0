"""The ICMP echo codec of the lab's reachability sweep (agentd.lab.sweep)."""

import struct

from agentd.lab.sweep import checksum, echo_request, parse_echo_reply


def _ipv4(payload: bytes, ihl_words: int = 5) -> bytes:
    header = bytes([0x40 | ihl_words]) + bytes(ihl_words * 4 - 1)
    return header + payload


def test_echo_request_checksum_verifies_to_zero():
    packet = echo_request(0x1234, 7, b"token123" + bytes(48))
    assert packet[:2] == b"\x08\x00" and struct.unpack("!HH", packet[4:8]) == (0x1234, 7)
    assert checksum(packet) == 0  # RFC 1071: the sum over data and checksum is all ones
    assert checksum(echo_request(1, 2, b"odd")) == 0


def test_reply_is_parsed_past_the_ip_header_and_others_are_not():
    reply = bytearray(echo_request(0xBEEF, 3, b"tok"))
    reply[0] = 0  # echo reply
    assert parse_echo_reply(_ipv4(bytes(reply))) == (0xBEEF, 3, b"tok")
    assert parse_echo_reply(_ipv4(bytes(reply), ihl_words=6)) == (0xBEEF, 3, b"tok")  # IP options
    assert parse_echo_reply(_ipv4(echo_request(0xBEEF, 3, b"tok"))) is None  # a request, not a reply
    assert parse_echo_reply(_ipv4(b"\x03\x01" + bytes(6))) is None  # destination unreachable
    assert parse_echo_reply(b"\x45" + bytes(10)) is None  # truncated


def test_icmpv6_echo_request_and_reply():
    request = echo_request(0xBEEF, 3, b"tok", version=6)
    assert request[:2] == b"\x80\x00" and request[2:4] == b"\x00\x00"  # type 128; the kernel sums it
    reply = b"\x81\x00" + request[2:]  # an IPv6 raw socket gets the ICMPv6 message alone
    assert parse_echo_reply(reply, 6) == (0xBEEF, 3, b"tok")
    assert parse_echo_reply(request, 6) is None  # a request, not a reply
    assert parse_echo_reply(b"\x81", 6) is None
