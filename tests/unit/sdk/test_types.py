"""Results read from the wire: a kvbranch split that does not match the contract is an error,
never a silent ``None``."""

from __future__ import annotations

import httpx
import pytest

from sdk import NO_RETRY, APIResponseError
from sdk.contract import RESPONSE_FIELD
from sdk.types import ChatChunk, ChatResult

MESSAGES = [{"role": "user", "content": "hello"}]
SPLIT = {
    "session_id": "s",
    "branch_id": "main",
    "prompt_tokens": 30,
    "device_hit_tokens": 0,
    "host_hit_tokens": 0,
    "recomputed_tokens": 30,
}
ANSWER = {
    "id": "c1",
    "model": "m",
    "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}
    ],
}


def test_absent_split_is_none_and_a_valid_one_is_parsed():
    assert ChatResult.from_openai(ANSWER).split is None  # a plain OpenAI-compatible server
    result = ChatResult.from_openai({**ANSWER, RESPONSE_FIELD: SPLIT})
    assert result.split is not None and result.split.recomputed_tokens == 30
    chunk = ChatChunk.from_openai({"id": "c1", "model": "m", "choices": [], RESPONSE_FIELD: SPLIT})
    assert chunk.split is not None and chunk.split.prompt_tokens == 30


@pytest.mark.parametrize(
    "split",
    [
        {**SPLIT, "prompt_tokens": "many"},  # wrong type
        {k: v for k, v in SPLIT.items() if k != "recomputed_tokens"},  # a required field missing
        "30 tokens",  # not an object
    ],
)
def test_a_split_that_fails_the_contract_raises(driver, split):
    # before: the split silently became None and the caller saw "no kvbranch data"
    with pytest.raises(APIResponseError, match="PromptSourceSplit"):
        ChatResult.from_openai({**ANSWER, RESPONSE_FIELD: split})
    with pytest.raises(APIResponseError, match="PromptSourceSplit"):
        ChatChunk.from_openai({"id": "c1", "choices": [], RESPONSE_FIELD: split})
    client = driver.client(
        "http://x",
        retry=NO_RETRY,
        model="m",
        transport=httpx.MockTransport(
            lambda r: httpx.Response(200, json={**ANSWER, RESPONSE_FIELD: split})
        ),
    )
    with pytest.raises(APIResponseError, match="does not match"):
        client.chat(MESSAGES)
