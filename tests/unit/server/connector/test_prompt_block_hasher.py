"""``vllm_compat.prompt_block_hasher``: a prompt's block hashes as vLLM's own scheduler computes
them for a request of plain token ids with a cache salt (what a block-run revive is checked
against, and what the cluster index's block entries are keyed by)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from server.connector.vllm_compat import prompt_block_hasher

BS = 16


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("salt", [None, "tenant.0123abcd"])
def test_the_hashes_are_vllms_own_for_the_same_request(algo, salt):
    init_none_hash(get_hash_fn_by_name(algo))
    tokens = [(i * 7919) % 32000 for i in range(5 * BS + 3)]
    request = Request(
        "r1",
        tokens,
        SamplingParams(max_tokens=1),
        None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(BS, get_hash_fn_by_name(algo)),
    )
    config = SimpleNamespace(cache_config=SimpleNamespace(prefix_caching_hash_algo=algo))
    ours = prompt_block_hasher(config, BS)(tokens, salt)  # type: ignore[arg-type]
    assert len(ours) == 5
    assert ours == [bytes(h) for h in request.block_hashes]
    other = prompt_block_hasher(config, BS)(tokens, "another")  # type: ignore[arg-type]
    assert other[0] != ours[0]
