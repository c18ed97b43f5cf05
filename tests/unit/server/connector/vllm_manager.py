"""vLLM's real KV cache manager, as the connector meets it: the block table it gives a request
whose first blocks come from the connector (what the loads rely on, per group)."""

from __future__ import annotations

from typing import Any

from server.connector.core.metadata import DeviceBlock, device_blocks

#: Tokens per block of the managers built here.
BS = 16


def positions_after_external_hit(
    groups: list[tuple[str, Any]], *, prompt_blocks: int = 10, external_blocks: int = 8
) -> list[DeviceBlock]:
    """The request's device block per position (null blocks as ``SKIPPED``) after vLLM's
    manager over ``groups`` (``(layer name, spec)`` each) allocated a prompt of
    ``prompt_blocks`` blocks and 3 tokens whose first ``external_blocks`` come from a connector
    (nothing from the device cache)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    from server.connector import vllm_compat

    config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([name], spec) for name, spec in groups],
    )
    init_none_hash(sha256)
    manager = KVCacheManager(
        config, max_model_len=1024, scheduler_block_size=BS, hash_block_size=BS
    )
    prompt = prompt_blocks * BS + 3
    request = Request(
        "r",
        prompt_token_ids=list(range(prompt)),
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BS, sha256),
    )
    computed, hit, _ = manager.get_computed_blocks(request)
    assert hit == 0
    external = external_blocks * BS
    assert manager.allocate_slots(
        request,
        prompt - external,
        num_new_computed_tokens=hit,
        new_computed_blocks=computed,
        num_external_computed_tokens=external,
    )
    null = vllm_compat.null_block_id(manager)
    return device_blocks(manager.get_blocks("r").get_block_ids(), null)
