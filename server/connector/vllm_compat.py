"""The one module of ``server/connector`` that touches vLLM: every vLLM class, enum and module
the connector uses is imported here, and every write or read of a vLLM *private* attribute is a
function here, so a vLLM upgrade is checked (and fixed) in one place.

The pin is written once, :data:`PINNED_VLLM` (``tests/unit/server/connector/test_layers.py``
checks it against ``pyproject.toml``'s ``vllm==`` pin and that no other connector module
imports ``vllm``). Another vLLM fails at import with an error naming both versions: these hooks
and private attributes are 0.32's; on another release they may silently do nothing or worse.

NIXL's pieces (``NixlConnector``, its ``base_worker`` module) and the hooks' annotation types
are resolved on first use (PEP 562), so an engine without P/D does not import vLLM's NIXL
connector.
"""

from __future__ import annotations

import contextlib
import importlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import msgspec
import vllm
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from server.connector.core.kv_groups import (
    CHUNKED_LOCAL,
    FULL_ATTENTION,
    SLIDING_WINDOW,
    GroupWindow,
)
from server.connector.nixl_threads import (
    lower_all,
    native_threads,
    python_threads,
    watch_for_spin,
)

if TYPE_CHECKING:
    from types import ModuleType

    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    nixl_base_worker: ModuleType

#: The vLLM release this connector is written against (``pyproject.toml``: ``vllm==``).
PINNED_VLLM = "0.32.0"

__all__ = [
    "MEDIUM_CPU",
    "PINNED_VLLM",
    "AllBlocksCleared",
    "ClearedOnMedium",
    "AttentionMetadata",
    "BlockRemoved",
    "BlockStored",
    "CacheHitSource",
    "ForwardContext",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheEvent",
    "KVConnectorBase_V1",
    "KVConnectorFactory",
    "KVConnectorMetadata",
    "KVConnectorWorkerMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVEventBatch",
    "MediumEventBatch",
    "MultiConnector",
    "NixlConnector",
    "Request",
    "RequestStatus",
    "SchedulerOutput",
    "SupportsHMA",
    "VllmConfig",
    "architecture_traits",
    "group_block_bytes",
    "group_windows",
    "install_nixl_side_channel",
    "kv_group_block_sizes",
    "states_at_boundaries",
    "cached_state_blocks",
    "kv_group_kinds",
    "kv_group_layers",
    "null_block_id",
    "prefix_reuse_off_reason",
    "kv_events_enabled",
    "maybe_convert_block_hash",
    "nixl_base_worker",
    "nixl_zmq_path",
]


class ClearedOnMedium(AllBlocksCleared, tag="AllBlocksCleared"):  # type: ignore[call-arg]
    """vLLM's ``AllBlocksCleared`` with the medium that was cleared. vLLM's own event has no
    medium (its device pool); the connector's host store sends this one with ``"CPU"``, so
    the cluster index can hide only that tier's entries. On the wire it is an
    ``AllBlocksCleared`` with one more field, which vLLM's own decoder ignores."""

    medium: str | None = None


class MediumEventBatch(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
):
    """``KVEventBatch`` as the cluster index decodes it: the same wire format, with a clear's
    medium read (:class:`ClearedOnMedium`) instead of dropped."""

    ts: float
    events: list[BlockStored | BlockRemoved | ClearedOnMedium]
    data_parallel_rank: int | None = None


class VllmVersionError(ImportError):
    """The installed vLLM is not the one this connector is pinned to."""


def release_of(version: str) -> str:
    """``0.32.0+cpu`` (the CPU wheel's local label) -> ``0.32.0``."""
    return version.split("+", 1)[0]


def check_version(installed: str | None = None) -> None:
    installed = vllm.__version__ if installed is None else installed
    if release_of(installed) != PINNED_VLLM:
        raise VllmVersionError(
            f"the kvbranch connector is pinned to vllm=={PINNED_VLLM} (it overrides that "
            f"release's connector hooks and private scheduler/NIXL state), but vllm "
            f"{installed} is installed: install vllm=={PINNED_VLLM} "
            f"(pyproject.toml), or port server/connector/vllm_compat.py"
        )


check_version()

_LAZY: dict[str, tuple[str, str | None]] = {
    "NixlConnector": (
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector",
        "NixlConnector",
    ),
    "nixl_base_worker": ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker", None),
    # Types the connector's hooks are annotated with (imported under TYPE_CHECKING there;
    # resolvable here at run time too, e.g. for ``typing.get_type_hints``).
    "AttentionMetadata": ("vllm.v1.attention.backend", "AttentionMetadata"),
    "ForwardContext": ("vllm.forward_context", "ForwardContext"),
    "KVCacheBlocks": ("vllm.v1.core.kv_cache_manager", "KVCacheBlocks"),
    "KVCacheConfig": ("vllm.v1.kv_cache_interface", "KVCacheConfig"),
    "Request": ("vllm.v1.request", "Request"),
    "SchedulerOutput": ("vllm.v1.core.sched.output", "SchedulerOutput"),
    "VllmConfig": ("vllm.config", "VllmConfig"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attr is None else getattr(module, attr)


# --- the connector base: the facade (a ``KVConnectorBase_V1`` subclass) reads
# ``self._kv_transfer_config``, ``self._kv_cache_config`` and ``self._connector_metadata``
# directly: the base sets them in its ``__init__``/``bind_connector_metadata`` for its
# subclasses (upstream's own connectors read them the same way).


# --- the connector factory ------------------------------------------------------------------
def register_connector_by_name(name: str, module: str) -> None:
    """Register ``module``'s class ``name`` with vLLM's factory unless registered already
    (``register_connector`` raises on a second registration)."""
    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module, name)


# --- KV events ------------------------------------------------------------------------------
def kv_events_enabled(vllm_config: Any) -> bool:
    """vLLM publishes KV cache events (``--kv-events-config`` with ``enable_kv_cache_events``):
    the scheduler then also publishes what ``KVConnectorBase_V1.take_events`` yields."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events)


# --- KV cache groups: what kind of KV each group holds ----------------------------------------
def spec_kind(spec: Any) -> str:
    """One KV cache spec's kind: ``full_attention`` (blocks hold every token's K and V for the
    whole request: full attention, MLA's latent included; subclasses with their own block life,
    such as R-SWA's dropped gap blocks, attention sinks or hidden states, are not this kind),
    ``sliding_window``, ``chunked_local``, ``mamba``, ``mixed`` (a uniform-type group of
    several kinds), else the spec's class name (``core/kv_groups.py`` decides from these)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        kinds = {spec_kind(inner) for inner in spec.kv_cache_specs.values()}
        return kinds.pop() if len(kinds) == 1 else "mixed"
    if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
        return FULL_ATTENTION
    if isinstance(spec, SlidingWindowSpec):
        return "sliding_window"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return "chunked_local"
    if isinstance(spec, MambaSpec):
        return "mamba"
    return type(spec).__name__


def kv_group_kinds(kv_cache_config: Any) -> list[str]:
    """The kind of each of the engine's KV cache groups (one group unless vLLM's hybrid KV
    cache manager is on; none for an attention-free model)."""
    if kv_cache_config is None:
        return []
    return [spec_kind(group.kv_cache_spec) for group in kv_cache_config.kv_cache_groups]


def group_windows(kv_cache_config: Any) -> dict[int, GroupWindow]:
    """How far back each windowed KV cache group reads (sliding window, chunked local), by
    group index: the parameters of vLLM's own ``get_num_skipped_tokens`` for that group."""
    if kv_cache_config is None:
        return {}
    out: dict[int, GroupWindow] = {}
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        inner = (
            list(spec.kv_cache_specs.values())
            if isinstance(spec, UniformTypeKVCacheSpecs)
            else [spec]
        )
        if inner and all(isinstance(s, SlidingWindowSpec) for s in inner):
            # Layers of one group with different windows: the widest decides what is read.
            out[i] = GroupWindow(
                SLIDING_WINDOW,
                max(int(s.sliding_window) for s in inner),
                max(int(getattr(s, "extra_retained_tokens", 0) or 0) for s in inner),
            )
        elif inner and all(isinstance(s, ChunkedLocalAttentionSpec) for s in inner):
            out[i] = GroupWindow(CHUNKED_LOCAL, max(int(s.attention_chunk_size) for s in inner))
    return out


def transfer_group_kinds(kv_cache_config: Any) -> tuple[str, ...]:
    """The kind of each group NIXL transfers, in the order of a handle's block lists
    (``KVCacheConfig.transfer_groups``: the groups that take part in external transfer)."""
    if kv_cache_config is None:
        return (FULL_ATTENTION,)
    groups = getattr(kv_cache_config, "transfer_groups", None)
    if groups is None:
        groups = kv_cache_config.kv_cache_groups
    return tuple(spec_kind(group.kv_cache_spec) for group in groups) or (FULL_ATTENTION,)


def prefix_reuse_off_reason(vllm_config: Any) -> str | None:
    """Why this engine cannot continue a prefill from KV it did not compute in the same pass,
    or ``None``. vLLM's CPU platform runs MLA without chunked prefill and prefix caching (its
    MLA backend computes a prompt from token 0), and turns both off for such a model: a
    prefix loaded from the host store would be ignored by the attention, and the answer wrong.
    """
    from vllm.platforms import current_platform

    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    if (
        model is not None
        and getattr(model, "use_mla", False)
        and current_platform.is_cpu()
        and cache is not None
        and not cache.enable_prefix_caching
    ):
        return (
            "vLLM runs MLA on the CPU without prefix caching or chunked prefill: its attention "
            "cannot continue from a loaded prefix (a GPU backend can)"
        )
    return None


def states_at_boundaries(kv_cache_config: Any) -> bool:
    """Whether vLLM keeps every state group's states at block boundaries and hands them to a
    connector: its prefix caching's ``align`` mode (``MambaSpec.mamba_cache_mode``)."""
    if kv_cache_config is None:
        return False
    specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
    states = [spec for spec in specs if isinstance(spec, MambaSpec)]
    return bool(states) and all(spec.mamba_cache_mode == "align" for spec in states)


def cached_state_blocks(
    kv_cache_manager: Any, block_hash: bytes, groups: frozenset[int]
) -> dict[int, int] | None:
    """The device block of each state group that vLLM's prefix cache keeps under
    ``block_hash`` — the recurrent state after that block's last token, which ``align`` mode
    writes at block boundaries (a chunk's end, a prefill checkpoint, decode crossing a block) —
    or ``None`` where some group keeps none. A block registered this step is written by this
    step's forward, before the connector's save reads it."""
    pool = getattr(kv_cache_manager, "block_pool", None)
    if pool is None or not groups:
        return None
    order = sorted(groups)
    blocks = pool.get_cached_block(block_hash, order)
    if blocks is None:
        return None
    return {g: int(block.block_id) for g, block in zip(order, blocks, strict=True)}


def kv_group_block_sizes(kv_cache_config: Any) -> list[int]:
    """Tokens per block of each KV cache group (several sizes only with SSM groups)."""
    if kv_cache_config is None:
        return []
    return [int(group.kv_cache_spec.block_size) for group in kv_cache_config.kv_cache_groups]


def kv_group_layers(kv_cache_config: Any) -> list[list[str]]:
    """The attention layers of each KV cache group, by the names ``register_kv_caches`` uses."""
    if kv_cache_config is None:
        return []
    return [list(group.layer_names) for group in kv_cache_config.kv_cache_groups]


def null_block_id(kv_cache_manager: Any) -> int:
    """The block id vLLM puts in a request's block table where a group keeps no block (a
    sliding-window group's blocks left behind by the window): the block pool's null block."""
    pool = getattr(kv_cache_manager, "block_pool", None)
    null = getattr(pool, "null_block", None)
    return int(null.block_id) if null is not None else 0


def group_block_bytes(group: Any) -> int:
    """Bytes of one block of a KV cache group, all its layers: a uniform-type group's spec
    already sums its layers' pages (full-attention layers of different shapes)."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return int(spec.page_size_bytes)
    return int(spec.page_size_bytes) * len(group.layer_names)


# --- the model registry: what vLLM knows of an architecture ---------------------------------
def architecture_traits(architectures: list[str]) -> tuple[bool, bool] | None:
    """``(is_hybrid, is_attention_free)`` of the first of ``architectures`` vLLM implements
    (as its own ``ModelConfig.is_hybrid``/``is_attention_free`` read them, before the
    ``layer_types`` refinement), or ``None`` when vLLM has none of them natively."""
    from vllm.model_executor.models.registry import ModelRegistry

    for arch in architectures:
        info = ModelRegistry._try_inspect_model_cls(arch)
        if info is not None:
            return bool(info.is_hybrid), bool(info.is_attention_free)
    return None


def hybrid_attention_block_size(vllm_args: Any) -> int | None:
    """The attention block size vLLM's worker gives a hybrid attention/state model (one page
    must hold a state: ``Platform.update_block_size_for_backend``), computed from the parsed
    ``vllm serve`` arguments before the engine starts; ``None`` when it keeps the size asked
    for, or when the engine's config cannot be built here (vLLM then reports it itself).

    Why before: vLLM 0.32 applies it in the worker, after the engine core copied its config,
    so the scheduler keeps splitting prompts at the old size and keeps few states at the new
    block ends (plain vLLM's own prefix cache misses too; docs/models.md)."""
    from vllm.config.vllm import set_current_vllm_config
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import get_attn_backend

    try:
        config = AsyncEngineArgs.from_cli_args(vllm_args).create_engine_config()
        model = config.model_config
        if model is None or not model.is_hybrid:
            return None
        before = config.cache_config.block_size
        # The worker reads the backend off the loaded model's layers; before loading, it is
        # the platform's choice for the model's attention (one backend on CPU).
        with set_current_vllm_config(config):
            backend = get_attn_backend(
                model.get_head_size(),
                model.dtype,
                config.cache_config.cache_dtype,
                use_mla=model.use_mla,
            )
        current_platform._align_hybrid_block_size(config, backend)
        after = int(config.cache_config.block_size)
    except Exception:  # noqa: BLE001 - vLLM's own start reports a config it cannot build
        return None
    return after if after != before else None


# --- MultiConnector's children --------------------------------------------------------------
def children_of(multi: MultiConnector) -> list[KVConnectorBase_V1]:
    return list(multi._connectors)


def child_index_of(multi: MultiConnector, request_id: str) -> int | None:
    """Which child the MultiConnector gave ``request_id``'s external tokens to."""
    index: int | None = multi._requests_to_connector.get(request_id)
    return index


# --- NIXL: the scheduler's request sets, the worker's reads in flight -------------------------
def waits_for_read(sched: Any, request_id: str) -> bool:
    """NIXL's scheduler queued a read for ``request_id``."""
    return request_id in sched._reqs_need_recv


def announce_in_batch(sched: Any, request_id: str) -> None:
    """Tell NIXL's worker that ``request_id`` is in the batch (it then sets and reaps the
    lease of the request's blocks once it finishes)."""
    sched._reqs_in_batch.add(request_id)


def forget_unprocessed(sched: Any, request_id: str) -> None:
    """Have NIXL's worker drop ``request_id`` from its tracking (upstream does it only for
    aborted requests)."""
    sched._reqs_not_processed.add(request_id)


def set_send_deadline(sched: Any, request_id: str, deadline: float) -> None:
    """Set when NIXL's worker stops waiting for P to read ``request_id``'s blocks (a
    ``time.perf_counter()`` value; the worker rebases it onto its clock and reaps it then)."""
    sched._reqs_need_send[request_id] = deadline


def lease_duration_s(sched: Any, default: float = 60.0) -> float:
    """P's lease of a finished prefill's blocks (NIXL's scheduler; ``default`` when absent)."""
    return float(getattr(sched, "_kv_lease_duration", default) or default)


def reads_in_flight(worker: Any) -> dict[str, list[int]]:
    """NIXL's worker: request id -> its transfer handles still in flight (the live dict)."""
    transfers: dict[str, list[int]] = worker._recving_transfers
    return transfers


def read_failed(worker: Any, request_id: str) -> bool:
    return request_id in worker._recv_failures


def detach_read(worker: Any, request_id: str) -> list[int]:
    """Give ``request_id``'s read up without releasing its transfers: they leave upstream's reads
    in flight (returned, for the caller to poll and release once they end) and upstream reports
    the request failed with its next results (vLLM recomputes its blocks). Releasing a transfer
    in flight does not stop it (``server/connector/pd/late_reads.py``)."""
    handles = list(worker._recving_transfers.pop(request_id, None) or ())
    worker._recv_failures.add(request_id)
    return handles


def transfers_ended(worker: Any, handles: list[int]) -> bool:
    """No transfer of ``handles`` is still in flight (each done, failed, or unknown to NIXL)."""
    for handle in handles:
        try:
            if worker.nixl_wrapper.check_xfer_state(handle) == "PROC":
                return False
        except Exception:
            continue  # NIXL no longer knows it: nothing of it can still be written
    return True


def release_transfers(worker: Any, handles: list[int]) -> None:
    """Release ended transfers (best effort: an ended transfer writes nothing more)."""
    for handle in handles:
        with contextlib.suppress(Exception):
            worker.nixl_wrapper.release_xfer_handle(handle)


def pin_blocks(block_pool: Any, block_ids: list[int]) -> list[Any]:
    """One more reference on each of ``block_ids`` in vLLM's block pool (not the null block),
    so that neither their request's end nor its preemption returns them to the free queue.
    Returns the blocks pinned, for :func:`unpin_blocks`."""
    blocks = block_pool.blocks
    pinned = [blocks[i] for i in dict.fromkeys(block_ids) if 0 <= i < len(blocks)]
    pinned = [b for b in pinned if not b.is_null]
    block_pool.touch(pinned)
    return pinned


def unpin_blocks(block_pool: Any, pinned: list[Any]) -> None:
    """Drop :func:`pin_blocks`' references: a block nobody else holds goes back to the free
    queue (cached blocks stay findable by their hash until evicted)."""
    block_pool.free_blocks(pinned)


# --- NIXL: a read the forward waits for (a synchronous pull) ----------------------------------
#: :func:`read_state`'s answers.
READ_PENDING, READ_DONE, READ_FAILED = "pending", "done", "failed"


def make_read_synchronous(
    sched: Any, request_id: str, block_ids: list[list[int]], local_blocks: tuple[int, ...]
) -> bool:
    """Point NIXL's queued read of ``request_id`` at ``block_ids`` (per group: the blocks of
    the pulled range) and mark it not parked. Upstream takes the blocks to read into from the
    *unhashed* ones, which a load the scheduler does not wait for has already hashed (cached
    at allocation). False when no read is queued."""
    entry = sched._reqs_need_recv.get(request_id)
    if entry is None:
        return False
    sched._reqs_need_recv[request_id] = (entry[0], block_ids, local_blocks, False)
    return True


def host_buffer_reads(sched_or_worker: Any) -> bool:
    """NIXL reads into a host buffer first (copied to the device after the step's forward)."""
    return bool(getattr(sched_or_worker, "use_host_buffer", False))


def reads_need_post_processing(worker: Any) -> bool:
    """NIXL's worker rewrites received blocks after the step's forward (another peer layout,
    a host buffer): a read the forward waits for would be used before that."""
    return bool(
        getattr(worker, "use_host_buffer", False)
        or getattr(worker, "enable_permute_local_kv", False)
        or getattr(worker, "enable_heterogeneous_attn_post_process", False)
    )


def start_ready_reads(worker: Any) -> None:
    """Start the reads whose peer handshake finished since (upstream does it once per step,
    at ``start_load_kv``)."""
    ready = worker._ready_requests
    while True:
        try:
            entry = ready.get_nowait()
        except queue.Empty:
            return
        worker._read_blocks_for_req(*entry)


def read_state(worker: Any, request_id: str) -> str:
    """Where ``request_id``'s read stands, without taking it from upstream's bookkeeping (the
    step's ``get_transfer_results`` still reports and releases it): :data:`READ_DONE` (every
    transfer complete), :data:`READ_FAILED`, or :data:`READ_PENDING` (in flight, or not
    started: its peer's handshake runs)."""
    if request_id in worker._recv_failures or request_id in list(worker._failed_recv_reqs.queue):
        return READ_FAILED
    handles = worker._recving_transfers.get(request_id)
    if handles is None:
        return READ_PENDING
    states = [worker.nixl_wrapper.check_xfer_state(h) for h in handles]
    if any(s not in ("DONE", "PROC") for s in states):
        return READ_FAILED
    return READ_DONE if all(s == "DONE" for s in states) else READ_PENDING


def read_tracked(worker: Any, request_id: str) -> bool:
    """NIXL's worker still tracks ``request_id``'s read: it will report it, received or failed."""
    return request_id in worker._recving_metadata


def read_in_flight(worker: Any, request_id: str) -> bool:
    """NIXL has transfers posted for ``request_id``'s read (it started; it may still write)."""
    return bool(worker._recving_transfers.get(request_id))


def skip_unstarted_read(worker: Any, request_id: str, meta: Any) -> None:
    """``request_id``'s read, not started yet (its handshake still runs), will not be waited
    for: it reads nothing when it starts (only the peer's notification, which frees its
    hold)."""
    meta.local_block_ids = [[] for _ in meta.local_block_ids]
    meta.local_physical_block_ids = []  # upstream's "full local hit": notify only
    worker._recving_metadata.pop(request_id, None)


def block_ids_of(meta: Any) -> list[int]:
    """The blocks a read (NIXL's per-request metadata) writes, every KV cache group's."""
    groups = getattr(meta, "local_block_ids", None) or ()
    return [block for group in groups for block in group]


def read_block_ids(worker: Any, request_id: str) -> list[int]:
    """The blocks ``request_id``'s read writes, every KV cache group's."""
    return block_ids_of(worker._recving_metadata.get(request_id))


@contextlib.contextmanager
def nixl_progress_thread(delay_us: int | None, lowered: bool = False) -> Iterator[None]:
    """Within: NIXL agents are built with their UCX progress thread off (``delay_us`` ``None``)
    or on, waiting ``delay_us`` between polls instead of busy-spinning. vLLM builds the agent
    config inside the worker's ``__init__`` and offers no switch, and NIXL's Python binding
    hard-codes ``pthrDelay = 0``. NIXL's threads are then watched for spinning, or ``lowered``
    at once (``server/connector/nixl_threads.py``)."""
    module = importlib.import_module(_LAZY["nixl_base_worker"][0])
    original = module.nixl_agent_config
    if original is None:  # NIXL not installed: nothing to patch
        yield
        return

    paced = delay_us is not None

    def make(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_prog_thread"] = paced
        return original(*args, **kwargs)

    module.nixl_agent_config = make
    if paced:
        before = native_threads()
        bind = importlib.import_module("nixl._api").nixlBind
        agent_class = bind.nixlAgent

        def agent(name: str, config: Any) -> Any:
            config.pthrDelay = delay_us
            return agent_class(name, config)

        bind.nixlAgent = agent
    try:
        yield
    finally:
        module.nixl_agent_config = original
        if paced:
            bind.nixlAgent = agent_class
            started = native_threads() - before - python_threads()
            if lowered:
                lower_all(started)
            else:
                watch_for_spin(started)


# --- NIXL: the handshake side channel ---------------------------------------------------------
# Upstream's scheduler starts ``self._nixl_handshake_listener(encoded_data, ready_event,
# stop_event, host, port)`` in a thread (``set_xfer_handshake_metadata``), and its worker runs
# ``self._nixl_handshake(...)`` on an executor, opening its REQ socket with ``base_worker``'s
# module-level ``zmq_ctx``. Both are looked up on the instance at call time, so an instance
# attribute replaces them for our connectors only; the REQ socket is wrapped only on a thread
# inside our ``_nixl_handshake`` (a thread-local), any other use of ``zmq_ctx`` is untouched.
_handshake_wrap = threading.local()


def nixl_zmq_path(host: str, port: int) -> str:
    """The side channel's ZMQ address, as upstream writes it (IPv6 hosts bracketed)."""
    from vllm.utils.network_utils import make_zmq_path

    return make_zmq_path("tcp", host, port)


def _wrapping_zmq_ctx(original: Any) -> Any:
    import zmq

    @contextlib.contextmanager
    def zmq_ctx(socket_type: Any, addr: str) -> Iterator[Any]:
        with original(socket_type, addr) as sock:
            wrap = getattr(_handshake_wrap, "wrap", None)
            yield wrap(sock) if wrap is not None and socket_type == zmq.REQ else sock

    zmq_ctx.kvbranch_original = original  # type: ignore[attr-defined]
    return zmq_ctx


def install_nixl_side_channel(
    sched: Any,
    worker: Any,
    listener: Callable[..., None],
    wrap_requester: Callable[[Any], Any],
) -> None:
    """Replace NIXL's handshake side channel on one connector: the scheduler's listener thread
    body becomes ``listener`` (upstream's arguments: ``encoded_data, ready_event, stop_event,
    host, port``), and the REQ socket the worker's ``_nixl_handshake`` asks a peer with is
    ``wrap_requester(sock)`` (it must offer ``setsockopt``, ``send`` and ``recv_multipart``).
    ``sched``/``worker``: the connector's, either may be None. Call it before vLLM hands the
    scheduler its handshake metadata (vLLM does so after the connector is built)."""
    if sched is not None:
        sched._nixl_handshake_listener = listener
    if worker is not None:
        module = importlib.import_module(_LAZY["nixl_base_worker"][0])
        if not hasattr(module.zmq_ctx, "kvbranch_original"):
            module.zmq_ctx = _wrapping_zmq_ctx(module.zmq_ctx)
        upstream = type(worker)._nixl_handshake

        def nixl_handshake(*args: Any, **kwargs: Any) -> Any:
            _handshake_wrap.wrap = wrap_requester
            try:
                return upstream(worker, *args, **kwargs)
            finally:
                _handshake_wrap.wrap = None

        worker._nixl_handshake = nixl_handshake


# --- an internal request of the API server ----------------------------------------------------
def prompt_block_hasher(
    vllm_config: VllmConfig, block_size: int
) -> Callable[[list[int], str | None], list[bytes]]:
    """The chained block hashes vLLM gives a prompt of plain token ids with ``cache_salt`` (no
    adapter, no media, no embeddings) at ``block_size``, full blocks only: what this engine's
    scheduler computes for such a request, and what its host store and KV events are keyed by.
    Run in the engine core, where vLLM has seeded its hash chain."""
    from types import SimpleNamespace

    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    hasher = get_request_block_hasher(
        block_size, get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    )

    def hashes(token_ids: list[int], cache_salt: str | None) -> list[bytes]:
        request = SimpleNamespace(
            all_token_ids=token_ids,
            num_tokens=len(token_ids),
            block_hashes=[],
            cache_salt=cache_salt,
            lora_request=None,
            mm_features=[],
            prompt_embeds=None,
        )
        return [bytes(h) for h in hasher(request)]  # type: ignore[arg-type]

    return hashes


async def prefill_only(
    engine_client: Any,
    token_ids: list[int],
    *,
    request_id: str,
    cache_salt: str | None,
    extra_args: dict[str, Any],
    session_id: str | None,
    priority: int = 0,
    data_parallel_rank: int | None = None,
) -> dict[str, Any] | None:
    """Run ``token_ids`` through the engine as a one-token greedy request (a prefill) and
    return the ``kv_transfer_params`` its finished output carries (the connector's handle),
    None when it has none. ``extra_args`` go where vLLM's OpenAI routes put ``vllm_xargs``
    (``kv_transfer_params`` among them); ``session_id`` is the engine request's, as vLLM's
    routes set it from a session header; ``data_parallel_rank`` the engine it runs on (None:
    where vLLM's balancer puts it). Cancelling the awaiting task aborts the request
    (vLLM's ``generate`` does on cancellation)."""
    from vllm import SamplingParams
    from vllm.inputs.engine import tokens_input

    params = SamplingParams(max_tokens=1, temperature=0.0, extra_args=dict(extra_args))
    transfer: dict[str, Any] | None = None
    rank = {"data_parallel_rank": data_parallel_rank} if data_parallel_rank is not None else {}
    async for output in engine_client.generate(
        tokens_input(list(token_ids), cache_salt=cache_salt),
        params,
        request_id,
        priority=priority,
        session_id=session_id,
        **rank,
    ):
        if output.finished:
            transfer = output.kv_transfer_params
    return transfer if isinstance(transfer, dict) else None
