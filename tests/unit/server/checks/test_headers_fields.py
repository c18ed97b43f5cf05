"""server.checks.headers and server.checks.fields: the rules the router applies before any leg,
pinned against what vLLM's own request models and sampling params refuse."""

from __future__ import annotations

import pytest

from server.checks.fields import field_problem
from server.checks.headers import header_problem


def test_a_header_the_cluster_reads_is_sent_once():
    assert header_problem([(b"Authorization", b"Bearer a"), (b"authorization", b"Bearer b")])
    assert header_problem([(b"x-session-id", b"a"), (b"X-Session-ID", b"b")])
    assert header_problem([(b"accept", b"a"), (b"accept", b"b")]) is None  # not ours to judge


@pytest.mark.parametrize(
    "name", [b"authorization", b"x-session-id", b"x-kvbranch-branch", b"content-type"]
)
@pytest.mark.parametrize("value", [b"\xe9t\xe9", b"a\x00b", b"a\x7fb", b"\xff"])
def test_a_header_the_cluster_reads_or_forwards_is_printable_ascii(name, value):
    problem = header_problem([(name, value)])
    assert problem is not None and problem[0] == name.decode()


def test_ordinary_headers_pass():
    assert (
        header_problem(
            [
                (b"authorization", b"Bearer sk-abc_123.x"),
                (b"content-type", b"application/json; charset=utf-8"),
                (b"user-agent", "caf\u00e9".encode()),  # not read or forwarded
            ]
        )
        is None
    )


BAD_FIELDS = [
    ({"stream": 1}, "stream"),
    ({"stream": "true"}, "stream"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"n": 0}, "n"),
    ({"n": "2"}, "n"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"min_tokens": 5, "max_completion_tokens": 2, "max_tokens": 10}, "min_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": []}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
]


@pytest.mark.parametrize(("payload", "param"), BAD_FIELDS)
def test_a_field_the_router_reads_has_its_type_and_vllms_range(payload, param):
    problem = field_problem(payload)
    assert problem is not None and problem[0] == param


GOOD_FIELDS = [
    {},
    {"stream": None, "max_tokens": None, "n": None, "stream_options": None},
    {"stream": True, "stream_options": {"include_usage": True}},
    {"stream": False, "stream_options": {}},  # vLLM's own rule lets an empty one pass
    {"max_tokens": 2, "min_tokens": 2},
    {"max_completion_tokens": 8, "max_tokens": 2, "min_tokens": 5},  # the first one counts
    {"n": 2, "max_tokens": 16},
]


@pytest.mark.parametrize("payload", GOOD_FIELDS)
def test_what_vllm_accepts_passes(payload):
    assert field_problem(payload) is None


def _vllm_refuses(payload: dict) -> bool:
    """Whether vLLM 0.32's own chat request model (and the sampling params it makes) refuse
    ``payload`` — the reference the rules above follow where vLLM is strict."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **payload}
    try:
        request = ChatCompletionRequest.model_validate(body)
        limit = request.max_completion_tokens
        limit = request.max_tokens if limit is None else limit
        # as vLLM's chat serving computes it: a 10-token prompt, a 2048-token model
        max_tokens = get_max_tokens(2048, limit, 10, {})
        request.to_sampling_params(max_tokens=max_tokens, default_sampling_params={})
    except Exception:  # noqa: BLE001 - pydantic's ValidationError or vLLM's own
        return True
    return False


@pytest.mark.parametrize(
    "payload",
    [
        {"max_tokens": 0},
        {"min_tokens": -1},
        {"min_tokens": 5, "max_tokens": 2},
        {"min_tokens": 5, "max_completion_tokens": 2},
        {"stream_options": {"include_usage": True}},
        {"stream": False, "stream_options": {"include_usage": True}},
    ],
)
def test_where_the_router_refuses_a_value_vllm_refuses_it_too(payload):
    assert field_problem(payload) is not None
    assert _vllm_refuses(payload)


@pytest.mark.parametrize("payload", GOOD_FIELDS)
def test_what_passes_the_router_vllm_accepts(payload):
    assert not _vllm_refuses(payload)
