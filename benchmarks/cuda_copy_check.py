"""CUDA checks and timings of the host store's block copies (``server/connector/host_pool.py``).

Torch only (no vLLM import), so it runs on any CUDA machine with torch:

    python benchmarks/cuda_copy_check.py [--quick]

Checks, on both paged layouts vLLM uses (blocks first, and ``[2, blocks, ...]``):

* ``round_trip``: device blocks -> pinned slot-major host slots -> other device blocks, bitwise;
* ``save_fence``: a save of block b, then the next step overwrites b on the compute stream
  right away (block zeroing, the forward): the host copy must hold the old content. The pool's
  copy stream is held up first so that, without the fence, the overwrite would win;
* ``load_after_zeroing``: this step zeroes a fresh block on the compute stream (held up), then
  loads into it: the loaded content must survive;
* ``host_fence``: after ``fence()`` the host copy is complete without any device sync (what a
  peer connector's pull, outside CUDA streams, relies on);
* ``no_host_stall``: ``save`` returns while its copies are still queued (the host is not
  blocked, so async scheduling keeps overlapping).

Then it times saves and loads of 1..N blocks of a model-sized cache and prints one JSON object.
Exit status 1 when a check fails, 2 without CUDA. tests/unit/test_host_pool_cuda.py runs the
same checks under pytest.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from server.connector.host_pool import HostKVPool  # noqa: E402  (torch only)

LAYOUTS = ("blocks_first", "kv_first")  # [blocks, 2, bs, heads, hd] and [2, blocks, bs, ...]


def make_caches(layout: str, num_blocks: int, layers: int = 2, block_size: int = 16,
                heads: int = 2, head_dim: int = 64, dtype: torch.dtype = torch.float16,
                seed: int = 0) -> tuple[dict[str, torch.Tensor], int]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = ([num_blocks, 2, block_size, heads, head_dim] if layout == "blocks_first"
             else [2, num_blocks, block_size, heads, head_dim])
    caches = {f"layer.{i}": torch.randn(shape, generator=g, device="cuda", dtype=torch.float32
                                        ).to(dtype) for i in range(layers)}
    return caches, (0 if layout == "blocks_first" else 1)


def block(t: torch.Tensor, dim: int, b: int) -> torch.Tensor:
    return t.select(dim, b)


def _sleep_cycles_for(seconds: float) -> int:
    """GPU clock cycles for ``torch.cuda._sleep`` to keep a stream busy about ``seconds``."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    per_second = probe / max(start.elapsed_time(end) / 1000, 1e-6)
    return int(per_second * seconds)


def hold_stream(stream: torch.cuda.Stream, seconds: float = 0.2) -> None:
    with torch.cuda.stream(stream):
        torch.cuda._sleep(_sleep_cycles_for(seconds))


# --- checks (each raises AssertionError on failure) -------------------------------------------
def check_round_trip(layout: str) -> None:
    caches, dim = make_caches(layout, num_blocks=8)
    expected = {n: [block(t, dim, b).clone() for b in (1, 4, 6)] for n, t in caches.items()}
    pool = HostKVPool(caches, num_blocks=8, num_slots=5)
    for host in pool.host_caches.values():
        assert host.is_pinned(), "host store must be pinned for async copies"
        assert host.shape[0] == 5 and host[0].is_contiguous(), "host store must be slot-major"
    pool.save([1, 4, 6], [3, 0, 2])
    pool.load([3, 0, 2], [7, 0, 5])
    torch.cuda.synchronize()
    for name, t in caches.items():
        for got_block, want in zip((7, 0, 5), expected[name]):
            assert torch.equal(block(t, dim, got_block), want), f"{name} block {got_block}"


def check_save_fence(layout: str) -> None:
    caches, dim = make_caches(layout, num_blocks=4)
    pool = HostKVPool(caches, num_blocks=4, num_slots=2)
    old = {n: block(t, dim, 2).clone() for n, t in caches.items()}
    torch.cuda.synchronize()
    assert pool._stream is not None
    hold_stream(pool._stream)            # the save's copies start late
    pool.save([2], [1])                  # step N: save block 2
    for t in caches.values():            # step N+1, compute stream: block 2 is rewritten
        block(t, dim, 2).fill_(7.0)
    torch.cuda.synchronize()
    for name, host in pool.host_caches.items():
        assert torch.equal(host[1], old[name].cpu()), (
            f"{name}: the host copy of block 2 holds the next step's write (no save fence)")


def check_load_after_zeroing(layout: str) -> None:
    caches, dim = make_caches(layout, num_blocks=4)
    pool = HostKVPool(caches, num_blocks=4, num_slots=2)
    pool.save([1], [0])
    torch.cuda.synchronize()
    want = {n: block(t, dim, 1).clone() for n, t in caches.items()}
    hold_stream(torch.cuda.current_stream())  # this step's zeroing of block 3 runs late
    for t in caches.values():
        block(t, dim, 3).zero_()
    pool.load([0], [3])
    torch.cuda.synchronize()
    for name, t in caches.items():
        assert torch.equal(block(t, dim, 3), want[name]), (
            f"{name}: block zeroing landed after the load")


def check_host_fence(layout: str) -> None:
    caches, dim = make_caches(layout, num_blocks=4)
    pool = HostKVPool(caches, num_blocks=4, num_slots=2)
    want = {n: block(t, dim, 0).cpu() for n, t in caches.items()}
    assert pool._stream is not None
    hold_stream(pool._stream)
    pool.save([0], [1])
    pool.fence()                         # host wait only: no device synchronize
    for name, host in pool.host_caches.items():
        assert torch.equal(host[1], want[name]), f"{name}: fence returned before the copy"


def check_no_host_stall(layout: str) -> None:
    caches, _ = make_caches(layout, num_blocks=4)
    pool = HostKVPool(caches, num_blocks=4, num_slots=2)
    torch.cuda.synchronize()
    assert pool._stream is not None
    hold_stream(pool._stream, seconds=0.5)
    started = time.perf_counter()
    pool.save([0, 1], [0, 1])
    took = time.perf_counter() - started
    torch.cuda.synchronize()
    assert took < 0.25, f"save blocked the host for {took:.3f} s"


CHECKS = {
    "round_trip": check_round_trip,
    "save_fence": check_save_fence,
    "load_after_zeroing": check_load_after_zeroing,
    "host_fence": check_host_fence,
    "no_host_stall": check_no_host_stall,
}


# --- timings ----------------------------------------------------------------------------------
def time_copies(layout: str, layers: int, block_size: int, heads: int, head_dim: int,
                sizes: list[int], repeats: int) -> list[dict]:
    num_blocks = max(sizes) * 2
    caches, _ = make_caches(layout, num_blocks, layers, block_size, heads, head_dim,
                            torch.bfloat16)
    pool = HostKVPool(caches, num_blocks=num_blocks, num_slots=max(sizes))
    rows = []
    for n in sizes:
        blocks, slots = list(range(n)), list(range(n))
        for direction in ("save", "load"):
            enqueue, total = [], []
            for _ in range(repeats):
                torch.cuda.synchronize()
                started = time.perf_counter()
                if direction == "save":
                    pool.save(blocks, slots)
                else:
                    pool.load(slots, [b + n for b in blocks])
                enqueue.append(time.perf_counter() - started)
                torch.cuda.synchronize()
                total.append(time.perf_counter() - started)
            best = min(total)
            rows.append({
                "layout": layout, "direction": direction, "blocks": n,
                "bytes": n * pool.block_bytes,
                "enqueue_ms": round(1000 * min(enqueue), 3),
                "total_ms": round(1000 * best, 3),
                "GBps": round(n * pool.block_bytes / best / 1e9, 2),
            })
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 2
    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                     "checks": {}, "timings": []}
    failed = False
    for name, check in CHECKS.items():
        for layout in LAYOUTS:
            key = f"{name}[{layout}]"
            try:
                check(layout)
                results["checks"][key] = "ok"
            except AssertionError as exc:
                results["checks"][key] = f"FAIL: {exc}"
                failed = True
    sizes = [1, 16] if args.quick else [1, 4, 16, 64]
    for layout in LAYOUTS:
        results["timings"] += time_copies(layout, args.layers, args.block_size, args.kv_heads,
                                          args.head_dim, sizes, 2 if args.quick else 5)
    print(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
