"""SSE parsing: events split anywhere, line endings, comments, [DONE], malformed lines."""

from __future__ import annotations

import asyncio

import pytest

from sdk.sse import ServerSentEvent, SSEDecoder, aiter_sse, iter_sse

STREAM = (
    b": keep-alive comment\n"
    b'data: {"a": 1}\n\n'
    b"event: update\nid: 7\nretry: 1500\ndata: line one\ndata: line two\n\n"
    b"data: caf\xc3\xa9 \xe2\x82\xac\n\n"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    ServerSentEvent(data='{"a": 1}'),
    ServerSentEvent(data="line one\nline two", event="update", id="7", retry=1500),
    ServerSentEvent(data="café €", id="7", retry=1500),
    ServerSentEvent(data="[DONE]", id="7", retry=1500),
]


def test_whole_stream():
    assert list(iter_sse([STREAM])) == EXPECTED


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 64])
def test_any_split_gives_the_same_events(size):
    # splits inside lines, inside "\n\n" and inside multi-byte UTF-8 characters
    pieces = [STREAM[i : i + size] for i in range(0, len(STREAM), size)]
    assert list(iter_sse(pieces)) == EXPECTED


@pytest.mark.parametrize("newline", [b"\r\n", b"\r", b"\n"])
def test_line_endings(newline):
    raw = STREAM.replace(b"\n", newline)
    assert list(iter_sse([raw])) == EXPECTED
    # and byte by byte, where a "\r" may be the first half of "\r\n"
    assert list(iter_sse([raw[i : i + 1] for i in range(len(raw))])) == EXPECTED


def test_malformed_lines_are_ignored():
    raw = (
        b"garbage without colon\n"  # a field named "garbage..." with no value
        b"retry: soon\n"  # non-numeric retry: ignored
        b"unknown: field\n"
        b"data:no-space\n"  # the space after the colon is optional
        b"data:  two spaces\n\n"  # only one leading space is stripped
        b"\n\n"  # blank lines without data dispatch nothing
        b":only a comment\n\n"
    )
    assert list(iter_sse([raw])) == [ServerSentEvent(data="no-space\n two spaces")]


def test_last_event_without_blank_line_is_kept_at_eof():
    assert list(iter_sse([b"data: a\n\ndata: b"])) == [
        ServerSentEvent(data="a"),
        ServerSentEvent(data="b"),
    ]
    assert list(iter_sse([b"data: a\n\ndata: b\n"])) == [
        ServerSentEvent(data="a"),
        ServerSentEvent(data="b"),
    ]


def test_empty_data_line_is_an_event():
    assert list(iter_sse([b"data:\n\n"])) == [ServerSentEvent(data="")]


def test_decoder_is_incremental():
    decoder = SSEDecoder()
    assert decoder.feed(b"data: par") == []
    assert decoder.feed(b"tial\n") == []
    assert decoder.feed(b"\n") == [ServerSentEvent(data="partial")]
    assert decoder.close() == []


def test_async_iteration():
    async def chunks():
        for i in range(0, len(STREAM), 3):
            yield STREAM[i : i + 3]

    async def collect():
        return [e async for e in aiter_sse(chunks())]

    assert asyncio.run(collect()) == EXPECTED


def test_leading_byte_order_mark_is_ignored():
    # before: the BOM became part of the first field name and the first event was lost
    assert list(iter_sse([b"\xef\xbb\xbfdata: x\n\n"])) == [ServerSentEvent(data="x")]
    assert list(iter_sse([b"\xef", b"\xbb", b"\xbfdata: x\n\n"])) == [ServerSentEvent(data="x")]
    # only a leading one: later U+FEFF characters are data
    assert list(iter_sse(["data: \ufeffx\n\n".encode()])) == [ServerSentEvent(data="\ufeffx")]


@pytest.mark.parametrize("value", ["²", "١٢", "-5", "+5", " 5", "1_000", "5s"])
def test_retry_takes_ascii_digits_only(value):
    # before: "²".isdigit() let int() raise ValueError out of the parser
    raw = f"retry: {value}\ndata: a\n\n".encode()
    assert list(iter_sse([raw])) == [ServerSentEvent(data="a")]


def test_fields_without_data_dispatch_nothing():
    raw = b"event: ping\n\nid: 3\n\nretry: 10\n\n\n\ndata: a\n\n"
    assert list(iter_sse([raw])) == [ServerSentEvent(data="a", id="3", retry=10)]


def test_a_long_line_in_many_small_chunks():
    value = "x" * 100_000
    raw = f"data: {value}\r\n\r\n".encode()
    pieces = [raw[i : i + 7] for i in range(0, len(raw), 7)]
    assert list(iter_sse(pieces)) == [ServerSentEvent(data=value)]
