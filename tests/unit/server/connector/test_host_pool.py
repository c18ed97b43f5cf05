"""HostKVPool on CPU: whole-block copies between a paged KV cache and host slots."""

from __future__ import annotations

import pytest
import torch

from server.connector.engine.host_pool import HostKVPool, find_block_dim

NUM_BLOCKS = 6
NUM_SLOTS = 4
HEADS, BLOCK, HEAD = 2, 4, 3


def dim0_cache(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=g)


def dim1_cache(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, HEAD, generator=g)


def block(t: torch.Tensor, dim: int, i: int) -> torch.Tensor:
    return t.select(dim, i)


# --- find_block_dim ---------------------------------------------------------------------------
def test_find_block_dim_prefers_dim0_then_dim1():
    assert find_block_dim((6, 2, 4, 6), 6) == 0
    assert find_block_dim((2, 6, 4, 2, 3), 6) == 1
    assert find_block_dim((6, 6, 4), 6) == 0
    assert find_block_dim((2, 3, 6), 6) == 2


def test_find_block_dim_error_is_clear():
    with pytest.raises(ValueError, match=r"no dimension of size 7 in KV cache shape \(2, 6, 4\)"):
        find_block_dim((2, 6, 4), 7)
    with pytest.raises(ValueError):
        find_block_dim((), 1)


def test_pool_rejects_cache_without_block_dim():
    with pytest.raises(ValueError, match="no dimension of size 9"):
        HostKVPool({"l0": torch.zeros(2, 3, 4)}, num_blocks=9, num_slots=2)


# --- construction -----------------------------------------------------------------------------
@pytest.mark.parametrize("make, dim", [(dim0_cache, 0), (dim1_cache, 1)])
def test_host_tensors_shape(make, dim):
    caches = {"l0": make(0), "l1": make(1)}
    pool = HostKVPool(caches, NUM_BLOCKS, NUM_SLOTS)
    assert not pool.cuda
    assert pool.num_slots == NUM_SLOTS
    for name, tensor in caches.items():
        assert pool.block_dims[0, name] == dim
        expected = list(tensor.shape)
        expected[dim] = NUM_SLOTS
        assert list(pool.host_caches[0, name].shape) == expected
        assert pool.host_caches[0, name].dtype == tensor.dtype
        assert pool.host_caches[0, name].device.type == "cpu"
    per_layer = caches["l0"].numel() // NUM_BLOCKS * caches["l0"].element_size()
    assert pool.block_bytes == 2 * per_layer


# --- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("make, dim", [(dim0_cache, 0), (dim1_cache, 1)])
def test_save_then_load_round_trips_exact_blocks(make, dim):
    caches = {"l0": make(0), "l1": make(1)}
    originals = {n: t.clone() for n, t in caches.items()}
    pool = HostKVPool(caches, NUM_BLOCKS, NUM_SLOTS)
    pool.save([1, 4, 2], [3, 0, 2])
    for n in caches:
        host = pool.host_caches[0, n]
        assert torch.equal(block(host, dim, 3), block(originals[n], dim, 1))
        assert torch.equal(block(host, dim, 0), block(originals[n], dim, 4))
        assert torch.equal(block(host, dim, 2), block(originals[n], dim, 2))
    # the device cache changes (blocks reused), then the saved blocks come back elsewhere
    for t in caches.values():
        t.zero_()
    pool.load([3, 0, 2], [5, 0, 3])
    for n, t in caches.items():
        assert torch.equal(block(t, dim, 5), block(originals[n], dim, 1))
        assert torch.equal(block(t, dim, 0), block(originals[n], dim, 4))
        assert torch.equal(block(t, dim, 3), block(originals[n], dim, 2))
        # untouched blocks stay as they were
        for other in (1, 2, 4):
            assert torch.count_nonzero(block(t, dim, other)) == 0


@pytest.mark.parametrize("make, dim", [(dim0_cache, 0), (dim1_cache, 1)])
def test_save_does_not_modify_device_and_load_does_not_modify_host(make, dim):
    caches = {"l0": make(3)}
    before = caches["l0"].clone()
    pool = HostKVPool(caches, NUM_BLOCKS, NUM_SLOTS)
    pool.save([0, 5], [1, 2])
    assert torch.equal(caches["l0"], before)
    # unsaved slots hold uninitialised memory (maybe NaN bit patterns): compare bits
    host_before = pool.host_caches[0, "l0"].clone().view(torch.int32)
    pool.load([1], [3])
    assert torch.equal(pool.host_caches[0, "l0"].view(torch.int32), host_before)
    assert torch.equal(block(caches["l0"], dim, 3), block(before, dim, 0))


def test_dtype_preserved_bitwise():
    cache = (
        torch.arange(NUM_BLOCKS * HEADS * BLOCK * 2 * HEAD, dtype=torch.float32)
        .reshape(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
        .to(torch.bfloat16)
    )
    pool = HostKVPool({"l": cache}, NUM_BLOCKS, NUM_SLOTS)
    assert pool.host_caches[0, "l"].dtype == torch.bfloat16
    saved = cache[2].clone()
    pool.save([2], [1])
    cache.fill_(0)
    pool.load([1], [4])
    assert torch.equal(cache[4].view(torch.int16), saved.view(torch.int16))


def test_empty_save_and_load_are_noops():
    cache = dim0_cache(0)
    before = cache.clone()
    pool = HostKVPool({"l": cache}, NUM_BLOCKS, NUM_SLOTS)
    pool.save([], [])
    pool.load([], [])
    pool.fence()
    assert torch.equal(cache, before)


def test_overwriting_a_slot_replaces_its_contents():
    cache = dim0_cache(0)
    original = cache.clone()
    pool = HostKVPool({"l": cache}, NUM_BLOCKS, NUM_SLOTS)
    pool.save([0], [1])
    pool.save([3], [1])
    pool.load([1], [5])
    assert torch.equal(cache[5], original[3])


# --- shared tensors ---------------------------------------------------------------------------
def test_layers_sharing_one_tensor_are_copied_once():
    shared = dim0_cache(0)
    other = dim0_cache(1)
    caches = {"a": shared, "b": shared, "c": other}
    pool = HostKVPool(caches, NUM_BLOCKS, NUM_SLOTS)
    assert [name for _, name in pool.device_caches] == ["a", "c"]
    assert set(pool.host_caches) == {(0, "a"), (0, "c")}
    per_layer = shared.numel() // NUM_BLOCKS * shared.element_size()
    assert pool.block_bytes == 2 * per_layer
    originals = {"a": shared.clone(), "c": other.clone()}
    pool.save([2], [0])
    shared.zero_()
    other.zero_()
    pool.load([0], [4])
    assert torch.equal(shared[4], originals["a"][2])
    assert torch.equal(other[4], originals["c"][2])


def test_views_of_one_storage_at_different_offsets_are_separate():
    # two layers carved out of one allocation are distinct tensors (different data_ptr)
    backing = torch.randn(2, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
    caches = {"l0": backing[0], "l1": backing[1]}
    pool = HostKVPool(caches, NUM_BLOCKS, NUM_SLOTS)
    assert {name for _, name in pool.device_caches} == {"l0", "l1"}
    original = backing.clone()
    pool.save([1], [2])
    backing.zero_()
    pool.load([2], [0])
    assert torch.equal(backing[0, 0], original[0, 1])
    assert torch.equal(backing[1, 0], original[1, 1])
