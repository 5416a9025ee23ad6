"""HostPort: HOST:PORT read and written one way (elastic.hostport)."""

from __future__ import annotations

import pytest

from elastic.hostport import HostPort, is_port


@pytest.mark.parametrize("text, host, port", [
    ("10.0.0.11:29401", "10.0.0.11", 29401),
    ("node-1.example:0", "node-1.example", 0),
    ("[::1]:2379", "::1", 2379),
    ("[fe80::1%eth0]:65535", "fe80::1%eth0", 65535),
    ("fe80::1:80", "fe80::1", 80),  # unbracketed: the port follows the last colon
])
def test_parse_takes_a_host_and_the_port_after_the_last_colon(text, host, port):
    assert HostPort.parse(text) == HostPort(host, port)


@pytest.mark.parametrize("host, port, text", [
    ("10.0.0.11", 29401, "10.0.0.11:29401"),
    ("::1", 0, "[::1]:0"),
    ("[::1]", 0, "[::1]:0"),  # given in brackets: not bracketed twice
    ("fe80::1%eth0", 1, "[fe80::1%eth0]:1"),
])
def test_str_writes_an_ipv6_host_in_brackets(host, port, text):
    assert str(HostPort(host, port)) == text


@pytest.mark.parametrize("text", ["[::1]:2379", "10.0.0.1:1", "h:65535"])
def test_str_of_parse_is_the_text_for_a_written_address(text):
    assert str(HostPort.parse(text)) == text


@pytest.mark.parametrize("text, why", [
    ("10.0.0.11", "after the last colon"),
    ("host:", "after the last colon"),
    ("host:65536", "after the last colon"),
    ("host:123456", "after the last colon"),
    ("host:８０", "after the last colon"),  # non-ASCII digits
    ("host:-1", "after the last colon"),
    (":29401", "no host before the port"),
])
def test_parse_refuses_what_is_not_host_port_saying_what_is_missing(text, why):
    with pytest.raises(ValueError) as info:
        HostPort.parse(text)

    assert repr(text) in str(info.value) and why in str(info.value)


def test_a_host_may_be_left_out_where_the_caller_fills_it_in():
    assert HostPort.parse(":29401", host_optional=True) == HostPort("", 29401)


def test_a_port_out_of_range_is_refused_when_built():
    with pytest.raises(ValueError):
        HostPort("h", 65536)


@pytest.mark.parametrize("text, expected", [
    ("0", True), ("65535", True), ("65536", False), ("00080", True), ("000080", False),
    ("", False), ("8a", False), ("٣", False),
])
def test_is_port(text, expected):
    assert is_port(text) is expected
