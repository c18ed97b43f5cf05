"""server.checks.json_body: the guard's one parse, and what it refuses (too deep, lone
surrogates) with the place named."""

from __future__ import annotations

import json

import pytest

from server.checks.json_body import MAX_JSON_DEPTH, parse, problem_of


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_plain_bodies_parse_without_a_problem():
    assert parse(b'{"a": [1, {"b": "\xc3\xa9\\ud83d\\ude00"}]}') == (
        {"a": [1, {"b": "é😀"}]},
        None,
    )
    assert parse(b"") == (None, None)
    assert parse(b"{not json") == (None, None)
    assert parse(nested(MAX_JSON_DEPTH))[1] is None


def test_many_brackets_that_are_not_deep_pass():
    """More brackets than the limit (the cheap pre-check) but shallow: the walk clears it."""
    wide = json.dumps({"messages": [{"content": [{"text": "x"}]} for _ in range(500)]})
    payload, problem = parse(wide.encode())
    assert problem is None and len(payload["messages"]) == 500
    two = b"[" + nested(60) + b"," + nested(60) + b"]"
    assert parse(two)[1] is None


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 900, 50_000])
def test_too_deep_is_named(depth):
    payload, problem = parse(b'{"tools": [{"input_schema": ' + nested(depth) + b"}]}")
    assert problem is not None and "nested too deeply" in problem[1]
    assert str(MAX_JSON_DEPTH) in problem[1]
    if payload is None:  # json.loads gave up (RecursionError): the body as a whole
        assert problem[0] == "body"
    else:
        assert problem[0].startswith("tools[0].input_schema")


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'"\\ud800"', "body"),
        (b'{"prompt_cache_key": "\\ud800"}', "prompt_cache_key"),
        (
            b'{"messages": [{"content": [{"text": "ok"}, {"text": "a\\udc00"}]}]}',
            "messages[0].content[1].text",
        ),
        (b'{"m": {"\\ud800x": 1}}', "m.\\ud800x"),
        (b'{"p": "\xed\xb0\x80"}', "p"),  # raw bytes of \udc00
        ('{"p": "\ud800"}'.encode("utf-16", "surrogatepass"), "p"),  # a UTF-16 body
    ],
)
def test_a_lone_surrogate_is_named(raw, param):
    _, problem = parse(raw)
    assert problem is not None and problem[0] == param
    assert "lone UTF-16 surrogate" in problem[1]
    problem[0].encode("utf-8")
    problem[1].encode("utf-8")  # both go into the error body as they are


def test_a_reversed_pair_is_two_lone_surrogates():
    assert parse(b'{"t": "\\ude00\\ud83d"}')[1] is not None
    assert parse(b'{"t": "\\\\ud800"}')[1] is None  # an escaped backslash: plain text


def test_problem_of_is_iterative():
    value: list = []
    for _ in range(10_000):  # deeper than Python's recursion limit
        value = [value]
    assert problem_of(value) is not None


def test_the_limit_is_exact():
    """Bodies with more brackets than the limit go through the level-by-level check."""
    at_limit = b"[" + nested(MAX_JSON_DEPTH - 1) + b",[]," + b'{"a":1}' + b"]"
    assert parse(at_limit)[1] is None
    over = b"[" + nested(MAX_JSON_DEPTH) + b",[]]"
    assert parse(over)[1] is not None and parse(over)[1][0].startswith("[0]")
    deep_object = b'{"a":' * MAX_JSON_DEPTH + b"[]" + b"}" * MAX_JSON_DEPTH
    assert parse(deep_object)[1] is not None


def test_valid_pairs_in_a_big_body_pass():
    body = json.dumps({"messages": [{"content": "\U0001f600 x"} for _ in range(300)]}).encode()
    assert b"\\ud83d" in body
    assert parse(body)[1] is None
    bad = body[:-2] + b',{"content":"\\ud83d"}]}'
    assert parse(bad)[1] == ("messages[300].content", parse(bad)[1][1])
