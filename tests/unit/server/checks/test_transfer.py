"""Where a client's transfer params hide, and what the router's edge says of each."""

from __future__ import annotations

import pytest

from sdk.contract import NESTED_XARGS_PATH
from server.checks.transfer import transfer_fields, transfer_problem

CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(
    ("payload", "path", "param"),
    [
        ({"kv_transfer_params": {"do_remote_prefill": True}}, CHAT, "kv_transfer_params"),
        ({"kv_transfer_params": None}, CHAT, "kv_transfer_params"),
        ({"vllm_xargs": {"kv_transfer_params": "x"}}, CHAT, "vllm_xargs.kv_transfer_params"),
        (
            {"sampling_params": {"extra_args": {"kv_transfer_params": {}}}},
            NESTED_XARGS_PATH,
            "sampling_params.extra_args.kv_transfer_params",
        ),
    ],
)
def test_every_place_is_refused_and_named(payload, path, param):
    problem = transfer_problem(payload, path)
    assert problem is not None and problem[0] == param and param in problem[1]


@pytest.mark.parametrize(
    ("payload", "path"),
    [
        ({"model": "m", "messages": []}, CHAT),
        ({"vllm_xargs": {"kvbranch_branch": "b"}}, CHAT),
        ({"vllm_xargs": "not an object"}, CHAT),
        ({"sampling_params": {"extra_args": {"kv_transfer_params": {}}}}, CHAT),  # not read here
    ],
)
def test_a_request_without_them_passes(payload, path):
    assert transfer_problem(payload, path) is None


def test_the_instances_gate_counts_null_as_none():
    """The guard lets ``null`` through (vLLM acts on none); only the router refuses it."""
    assert transfer_fields({"kv_transfer_params": None}, CHAT) == []
