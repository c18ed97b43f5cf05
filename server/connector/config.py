"""The connectors' typed configs: every ``kv_connector_extra_config`` key our code reads, with its
default, written once here. The launcher (``server/launcher/cli.py``) builds them and dumps them
into vLLM's ``--kv-transfer-config``; each connector parses its dict back through them.

* :class:`ConnectorConfig` — the kvbranch connector's dict. Unknown keys are an error (a typo'd
  key would otherwise silently run on the default).
* :class:`NixlChildConfig` — the NIXL child's dict in P/D: our keys typed; upstream
  ``NixlConnector``'s own keys (``bidirectional_kv_xfer``, ``kv_recompute_threshold``,
  ``backends``, ...) pass through unchecked, since upstream reads them and owns their defaults
  (``decoder_kv_blocks_ttl`` is read by both: its default here is upstream's, 480 s).

Pure: pydantic and the core layer's constants, no vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from server.connector.core.branches import (
    DEFAULT_IDLE_TTL_S,
    DEFAULT_MAX_BRANCHES_PER_SESSION,
    DEFAULT_MAX_SESSIONS_PER_TENANT,
)
from server.connector.pd.hold_registry import CLAIM_MARGIN_S

DEFAULT_HOST_STORE_BYTES = 2 << 30
#: How long a step's forward waits for a synchronous pull's read before recomputing instead.
DEFAULT_SYNC_PULL_WAIT_S = 2.0

_C = TypeVar("_C", bound="_ExtraConfig")


class ConnectorConfigError(ValueError):
    """A ``kv_connector_extra_config`` that does not parse: names the connector and the keys."""


class _ExtraConfig(BaseModel):
    model_config = ConfigDict(frozen=True)

    @classmethod
    def from_extra(cls: type[_C], extra: Mapping[str, Any] | None) -> _C:
        """Parse vLLM's ``kv_connector_extra_config`` (``None``: all defaults)."""
        try:
            return cls.model_validate(dict(extra or {}))
        except ValidationError as e:
            problems = []
            for err in e.errors():
                key = ".".join(str(p) for p in err["loc"]) or "(the dict)"
                if err["type"] == "extra_forbidden":
                    problems.append(f"unknown key {key!r}")
                else:
                    problems.append(f"{key}: {err['msg']} (got {err.get('input')!r})")
            known = ", ".join(sorted(cls.model_fields))
            raise ConnectorConfigError(
                f"{cls.__name__} (kv_connector_extra_config of {cls._owner()}): "
                + "; ".join(problems)
                + f". Known keys: {known}"
            ) from None

    @classmethod
    def _owner(cls) -> str:
        return "the connector"

    def to_extra(self) -> dict[str, Any]:
        """The dict to put in ``kv_connector_extra_config`` (JSON-ready; ``None`` left out)."""
        return self.model_dump(mode="json", exclude_none=True)


class ConnectorConfig(_ExtraConfig):
    """The kvbranch connector's settings (``KVBranchConnector``, also as a P/D child)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Host block store size; the slot count is this over one block's bytes.
    host_store_bytes: int = Field(default=DEFAULT_HOST_STORE_BYTES, ge=0)
    #: Bytes pins may hold (TTL leases); ``None``: half the store.
    pin_budget_bytes: int | None = Field(default=None, ge=0)
    #: A pin's lease when the request names none.
    pin_ttl_s: float = Field(default=300.0, gt=0)
    #: The control socket's path (one per engine core, suffixed); ``None``: one named after
    #: the kv-transfer-config's engine id in a private per-user directory (vLLM's own CLI:
    #: server/common/control_path.py).
    control_socket: str | None = None
    #: Every request has an owner (API keys): one without must not make a session.
    tenants: bool = False
    max_sessions_per_tenant: int = Field(default=DEFAULT_MAX_SESSIONS_PER_TENANT, ge=1)
    max_branches_per_session: int = Field(default=DEFAULT_MAX_BRANCHES_PER_SESSION, ge=1)
    #: The share of the pin budget one tenant may hold.
    tenant_pin_share: float = Field(default=1.0, gt=0, le=1)
    #: A session untouched this long is dropped.
    session_idle_ttl_s: float = Field(default=DEFAULT_IDLE_TTL_S, gt=0)
    # Read by the API server's plugin, not the connector, when vLLM's own CLI started the
    # server (server/plugin/vllm_serve.py, docs/vllm-serve.md); the launcher passes them in
    # the environment instead (server.common.env). ``None``: the launcher's default.
    #: ``single``, ``prefill`` or ``decode`` (``None``: from ``kv_role``).
    role: Literal["single", "prefill", "decode"] | None = None
    #: The cluster index this instance publishes into (``--index``).
    index_url: str | None = Field(default=None, pattern=r"^(memory$|redis://|rediss://|unix://)")
    #: Its namespace in the index (``--cluster-name``).
    cluster_name: str | None = Field(default=None, min_length=1)
    #: The URL routers reach this instance at (``--advertise-url``).
    advertise_url: str | None = Field(default=None, pattern=r"^https?://")

    @classmethod
    def _owner(cls) -> str:
        return "KVBranchConnector"

    @property
    def pin_budget(self) -> int:
        """The pin budget in bytes, its default resolved."""
        if self.pin_budget_bytes is None:
            return self.host_store_bytes // 2
        return self.pin_budget_bytes


class NixlChildConfig(_ExtraConfig):
    """The NIXL child's settings in P/D (``VerifiedNixlConnector``): ours typed, upstream's
    passed through (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    #: NIXL's UCX progress thread as upstream builds it: busy-spinning (it halves a shared
    #: core — docs/pd_notes.md pitfall 3). Off by default; see ``nixl_progress_delay_us``.
    nixl_progress_thread: bool = False
    #: NIXL's UCX progress thread paced: it waits this many microseconds between polls instead
    #: of spinning (0: no progress thread, NIXL progresses only when the engine polls it, once
    #: per step). Without it a peer's read of this instance's blocks waits for the end of the
    #: engine's current forward: D's read of a turn's prompt waited for P's whole prefill of
    #: the next turn (docs/pd.md, "Where a first turn's time goes").
    nixl_progress_delay_us: int = Field(default=1000, ge=0, le=1_000_000)
    #: NIXL's own threads at nice 19 from the start, instead of watched and lowered only once
    #: one spins (``server/connector/nixl_threads.py``).
    nixl_threads_lowered: bool = False
    #: How long a router's claim keeps D's hold of a turn's blocks.
    claim_ttl_s: float = Field(default=30.0, gt=0)
    #: How long D holds a finished turn's blocks for P (upstream's key and default).
    decoder_kv_blocks_ttl: int = Field(default=480, gt=0)
    #: A read NIXL's worker started but has not finished after this long is failed (vLLM then
    #: recomputes those blocks): upstream bounds handshakes (5 s) and D's deadline before a read
    #: starts, not a read in flight. It is also what makes D's claim a fence, not only a time
    #: margin: P starts a pull only while the claim has ``CLAIM_MARGIN_S`` left, and D releases a
    #: claimed hold no earlier than ``CLAIM_MARGIN_S`` after the claim ends; a read still in flight
    #: ``CLAIM_MARGIN_S`` after it started is failed (recompute) — before D can reuse the blocks,
    #: as long as an engine step takes less than that. (A read of one conversation's KV takes
    #: milliseconds on loopback, well under a second over a network.)
    pull_timeout_s: float = Field(default=CLAIM_MARGIN_S, gt=0)
    #: An aggregated replica (``--role single`` with a shared index), not a P or a D: a turn
    #: that pulled its history from a peer decodes here and is held afterwards as D's turns are
    #: (for the next turn's pull by whichever replica gets it), where upstream would hold it for
    #: a D's read of the prompt as it does P's prefill legs.
    aggregated: bool = False
    #: A verified pull is loaded *synchronously*: the step's forward waits for the read (at
    #: most this long; past it, or on a failed read, those blocks are recomputed) and computes
    #: the rest of the prompt in the same step, instead of upstream's asynchronous load, which
    #: costs the turn two forwards of other requests on a busy engine
    #: (``server/connector/pd/sync_reads.py``). A read given up stays in flight against pinned
    #: blocks (``late_reads.py``), so the give-up never waits on NIXL. 0: upstream's
    #: asynchronous load (docs/cluster.md, "A pull the forward waits for").
    sync_pull_wait_s: float = Field(default=DEFAULT_SYNC_PULL_WAIT_S, ge=0, le=60)

    @classmethod
    def _owner(cls) -> str:
        return "VerifiedNixlConnector"
