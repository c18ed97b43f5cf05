"""The SSE rewrite the plugin's middleware and the router's relay share."""

from __future__ import annotations

from server.common.sse import EventSplitter, encode_event, json_event, rewrite_events


def test_events_cut_across_reads():
    splitter = EventSplitter()
    assert splitter.feed(b'data: {"a"') == []
    assert splitter.feed(b": 1}\n\ndata: [DO") == [b'data: {"a": 1}']
    assert splitter.feed(b"NE]\n\n") == [b"data: [DONE]"]
    assert splitter.feed(b"partial") == [] and splitter.rest() == b"partial"
    assert splitter.rest() == b""


def test_only_marked_json_events_are_parsed():
    event = b'data: {"usage": {"prompt_tokens": 3}, "choices": []}'
    assert json_event(event, b'"usage"') == {"usage": {"prompt_tokens": 3}, "choices": []}
    assert json_event(event, b'"kv_transfer_params"') is None
    assert json_event(b"data: [DONE]") is None
    assert json_event(b"data: {not json") is None
    assert json_event(b": comment") is None


def test_encode_is_compact_and_rewrite_drops_none():
    assert encode_event({"a": [1, 2]}) == b'data: {"a":[1,2]}'
    out = rewrite_events([b"data: 1", b"data: 2"], lambda e: None if e.endswith(b"2") else e)
    assert out == b"data: 1\n\n"
