"""CUDA checks and timings of the host store's block copies
(``server/connector/engine/host_pool.py``): a correctness check, run on a GPU machine as one
script or under pytest (``tests/gpu/test_cuda_copy.py``, marked ``gpu``, skipped without CUDA).

Torch only (no vLLM import), so it runs on any CUDA machine with torch:

    python -m tests.gpu.cuda_copy_check [--quick]        # prints its JSON; exit 1 if a check fails
    python -m pytest tests/gpu -q -n 0                   # the same checks as tests

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

Then it times saves and loads of 1..N blocks of a model-sized cache and reports each as GB/s and
as a fraction of the host link's limit, measured on the same machine as the best of large
contiguous pinned<->device copies (``link``; the bus's nominal rate from ``nvidia-smi`` is added
when it can be read). The pool's paged copies move one block-sized piece per layer, so the
fraction says how much of the link the block layout leaves on the table.

Without CUDA (``--dry-run``, or automatically on a machine with no GPU) the same timing code runs
on CPU tensors so the script itself is checked; the CUDA-only checks are reported as skipped and
the numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from server.connector.engine.host_pool import HostKVPool  # noqa: E402  (torch only)

LAYOUTS = ("blocks_first", "kv_first")  # [blocks, 2, bs, heads, hd] and [2, blocks, bs, ...]


def make_caches(
    layout: str,
    num_blocks: int,
    layers: int = 2,
    block_size: int = 16,
    heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
    device: str = "cuda",
) -> tuple[dict[str, torch.Tensor], int]:
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (
        [num_blocks, 2, block_size, heads, head_dim]
        if layout == "blocks_first"
        else [2, num_blocks, block_size, heads, head_dim]
    )
    caches = {
        f"layer.{i}": torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)
        for i in range(layers)
    }
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
        for got_block, want in zip((7, 0, 5), expected[name], strict=True):
            assert torch.equal(block(t, dim, got_block), want), f"{name} block {got_block}"


def check_save_fence(layout: str) -> None:
    caches, dim = make_caches(layout, num_blocks=4)
    pool = HostKVPool(caches, num_blocks=4, num_slots=2)
    old = {n: block(t, dim, 2).clone() for n, t in caches.items()}
    torch.cuda.synchronize()
    assert pool._stream is not None
    hold_stream(pool._stream)  # the save's copies start late
    pool.save([2], [1])  # step N: save block 2
    for t in caches.values():  # step N+1, compute stream: block 2 is rewritten
        block(t, dim, 2).fill_(7.0)
    torch.cuda.synchronize()
    for name, host in pool.host_caches.items():
        assert torch.equal(host[1], old[name].cpu()), (
            f"{name}: the host copy of block 2 holds the next step's write (no save fence)"
        )


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
            f"{name}: block zeroing landed after the load"
        )


def check_host_fence(layout: str) -> None:
    caches, dim = make_caches(layout, num_blocks=4)
    pool = HostKVPool(caches, num_blocks=4, num_slots=2)
    want = {n: block(t, dim, 0).cpu() for n, t in caches.items()}
    assert pool._stream is not None
    hold_stream(pool._stream)
    pool.save([0], [1])
    pool.fence()  # host wait only: no device synchronize
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
def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def link_limit(device: str, mib: int, repeats: int) -> dict:
    """The host link's practical limit: best GB/s of one large contiguous copy each way.

    This is the ceiling the block copies are judged against (same machine, same pinned memory,
    same driver), which a nominal bus rate is not: PCIe/NVLink-C2C overheads differ per system.
    """
    n = mib << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=device == "cuda")
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    out: dict = {"bytes": n}
    for direction, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        best = float("inf")
        for _ in range(repeats):
            _sync(device)
            started = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            _sync(device)
            best = min(best, time.perf_counter() - started)
        out[f"{direction}_GBps"] = round(n / best / 1e9, 2)
    if device == "cuda":
        try:
            q = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=pcie.link.gen.current,pcie.link.width.current",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=10,
            )
            gen, width = (int(x) for x in q.stdout.splitlines()[0].split(","))
            per_lane = {3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}.get(gen)
            if per_lane:
                out["pcie_nominal"] = f"gen{gen} x{width}"
                out["pcie_nominal_GBps"] = round(per_lane * width, 1)
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            pass  # the measured limit above is what the fractions use
    return out


def time_copies(
    layout: str,
    layers: int,
    block_size: int,
    heads: int,
    head_dim: int,
    sizes: list[int],
    repeats: int,
    device: str = "cuda",
    link: dict | None = None,
) -> list[dict]:
    num_blocks = max(sizes) * 2
    caches, _ = make_caches(
        layout, num_blocks, layers, block_size, heads, head_dim, torch.bfloat16, device=device
    )
    pool = HostKVPool(caches, num_blocks=num_blocks, num_slots=max(sizes))
    rows = []
    for n in sizes:
        blocks, slots = list(range(n)), list(range(n))
        for direction in ("save", "load"):
            enqueue, total = [], []
            for _ in range(repeats):
                _sync(device)
                started = time.perf_counter()
                if direction == "save":
                    pool.save(blocks, slots)
                else:
                    pool.load(slots, [b + n for b in blocks])
                enqueue.append(time.perf_counter() - started)
                _sync(device)
                pool.fence()
                total.append(time.perf_counter() - started)
            best = min(total)
            gbps = n * pool.block_bytes / best / 1e9
            row = {
                "layout": layout,
                "direction": direction,
                "blocks": n,
                "bytes": n * pool.block_bytes,
                "enqueue_ms": round(1000 * min(enqueue), 3),
                "total_ms": round(1000 * best, 3),
                "GBps": round(gbps, 2),
            }
            limit = (link or {}).get("d2h_GBps" if direction == "save" else "h2d_GBps")
            if limit:
                row["of_link"] = round(gbps / limit, 3)
            rows.append(row)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tests.gpu.cuda_copy_check", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    for flag, default in (("--layers", 28), ("--block-size", 16), ("--kv-heads", 8)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument(
        "--link-mib",
        type=int,
        default=1024,
        help="size of the contiguous copy that measures the link's limit",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="run the timing code on CPU tensors (automatic without CUDA)",
    )
    return ap.parse_args(argv)


def run_checks(cuda: bool) -> dict[str, str]:
    """Each check on each layout: ``ok``, ``FAIL: why``, or skipped without CUDA."""
    out: dict[str, str] = {}
    for name, check in CHECKS.items():
        for layout in LAYOUTS:
            key = f"{name}[{layout}]"
            if not cuda:
                out[key] = "skipped (needs CUDA)"
                continue
            try:
                check(layout)
                out[key] = "ok"
            except AssertionError as exc:
                out[key] = f"FAIL: {exc}"
    return out


def run(args: argparse.Namespace) -> dict:
    """The checks, the link's limit and the paged copies' timings, as one JSON-able dict."""
    cuda = torch.cuda.is_available() and not args.dry_run
    device = "cuda" if cuda else "cpu"
    results: dict = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)",
        "torch": torch.__version__,
        "checks": run_checks(cuda),
        "timings": [],
    }
    if not cuda:
        results["note"] = "dry run on CPU: checks the script, says nothing about a GPU"
    repeats = 2 if args.quick else 5
    results["link"] = link_limit(device, args.link_mib if cuda else min(args.link_mib, 64), repeats)
    sizes = [1, 16] if args.quick else [1, 4, 16, 64]
    shape = (args.layers, args.block_size, args.kv_heads, args.head_dim)
    for layout in LAYOUTS:
        results["timings"] += time_copies(layout, *shape, sizes, repeats, device, results["link"])
    return results


def main(argv: list[str] | None = None) -> int:
    results = run(parse_args(argv))
    print(json.dumps(results, indent=1))
    failed = [k for k, v in results["checks"].items() if v.startswith("FAIL")]
    if failed:
        print(f"copy checks FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
