"""Clear the kvbranch host store whenever the engine's weights or LoRA adapters change.

vLLM's block hashes (and the host store's keys, which are those hashes) name token prefixes,
cache salts and a LoRA's name and path — not the weights the KV was computed with. After new
weights, or an adapter reloaded under the same name and path, the store would serve KV of the
old model under the same keys. vLLM clears its own caches (connector included) when a pause or
sleep asks it to (``EngineCore._reset_caches``); these paths change weights without that:

* ``EngineCore.collective_rpc`` with a method that loads or changes weights
  (:data:`WEIGHT_CHANGING`: ``POST /collective_rpc``, the RL routes
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, the
  ``/weight_checker`` reset, ``LLM.collective_rpc``);
* ``EngineCore.add_lora`` that reloads an adapter the engine already has (its id is loaded, or
  ``load_inplace``: ``POST /v1/load_lora_adapter`` of a known name) — a new adapter changes no
  stored KV: its name and path are part of every key it makes;
* ``EngineCore.remove_lora`` (``POST /v1/unload_lora_adapter``): a later load under the same
  name and path may bring other weights.

After such a call succeeds, the engine core resets its connector cache
(``Scheduler.reset_connector_cache``: the kvbranch connector's ``reset_cache`` forgets every
block, tail and pin). It runs in the engine core's thread, between steps, like vLLM's own
resets. Installed by the connector's scheduler role (``connector/engine/connector.py``),
which is created in the engine core process — the API process, where endpoint plugins load,
cannot reach it. Pinned to
vLLM 0.32's ``EngineCore``; on another version the methods may differ and this logs that it
left vLLM unchanged.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("kvbranch.engine_changes")

#: ``collective_rpc`` methods (worker methods of vLLM 0.32) after which stored KV may be stale.
WEIGHT_CHANGING = frozenset(
    {
        "load_model",
        "reload_weights",
        "reset_weights",
        "load_weights",
        "update_weights",
        "start_weight_update",
        "finish_weight_update",
        "start_draft_weight_update",
        "update_config",
        "checkpoint_restore",
    }
)

_PATCHED = "_kvbranch_engine_changes"


def reset_connector(core: Any, why: str) -> None:
    """Reset the engine's connector cache (the host store); never raises."""
    scheduler = getattr(core, "scheduler", None)
    reset = getattr(scheduler, "reset_connector_cache", None)
    if reset is None:
        return
    try:
        ok = reset()
    except Exception:  # noqa: BLE001 - the weight change itself succeeded; say so loudly
        logger.exception("kvbranch: host store reset after %s failed", why)
        return
    logger.info("kvbranch: host store reset after %s (%s)", why, "done" if ok else "refused")


def changes_weights(method: Any) -> bool:
    return isinstance(method, str) and method in WEIGHT_CHANGING


def _wrap(cls: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    original = getattr(cls, name, None)
    if original is None:
        return False
    if getattr(original, _PATCHED, False):
        return True
    wrapped = functools.wraps(original)(make(original))
    setattr(wrapped, _PATCHED, True)
    setattr(cls, name, wrapped)
    return True


def _collective_rpc(original: Callable[..., Any]) -> Callable[..., Any]:
    def collective_rpc(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, method, *args, **kwargs)
        if changes_weights(method):
            reset_connector(self, f"collective_rpc({method!r})")
        return result

    return collective_rpc


def _add_lora(original: Callable[..., Any]) -> Callable[..., Any]:
    def add_lora(self: Any, lora_request: Any, *args: Any, **kwargs: Any) -> Any:
        reload = bool(getattr(lora_request, "load_inplace", False))
        if not reload:
            try:
                reload = getattr(lora_request, "lora_int_id", None) in self.list_loras()
            except Exception:  # noqa: BLE001 - on any doubt, treat it as a reload
                reload = True
        result = original(self, lora_request, *args, **kwargs)
        if result is not False and reload:
            name = getattr(lora_request, "lora_name", "?")
            reset_connector(self, f"reloading LoRA adapter {name!r}")
        return result

    return add_lora


def _remove_lora(original: Callable[..., Any]) -> Callable[..., Any]:
    def remove_lora(self: Any, lora_id: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, lora_id, *args, **kwargs)
        if result is not False:
            reset_connector(self, f"removing LoRA adapter id {lora_id!r}")
        return result

    return remove_lora


def install(cls: Any = None) -> bool:
    """Patch vLLM's ``EngineCore`` (or ``cls``, for tests); idempotent. False when the class
    is not the expected one (nothing is patched then)."""
    if cls is None:
        try:
            from vllm.v1.engine.core import EngineCore
        except ImportError:
            logger.info("kvbranch: no vLLM EngineCore here; weight changes keep the host store")
            return False
        cls = EngineCore
    if not all(hasattr(cls, name) for name in ("collective_rpc", "add_lora", "remove_lora")):
        logger.warning("kvbranch: unexpected vLLM EngineCore; weight changes keep the host store")
        return False
    _wrap(cls, "collective_rpc", _collective_rpc)
    _wrap(cls, "add_lora", _add_lora)
    _wrap(cls, "remove_lora", _remove_lora)
    return True
