"""Per-step timing of the engine, seen from the connector's hooks (what
``benchmarks/turn_ttft --profile-dir`` splits each turn's TTFT with).

When ``KVBRANCH_STEP_TRACE`` names a folder, each role of the connector appends one JSON line
per engine step to ``<folder>/<role>-<pid>.jsonl``:

* scheduler role (engine core process): when the step's metadata was built, the tokens the step
  schedules (prefill: requests with more than one token this step; decode: one token), and the
  time spent in the connector's scheduler hooks since the previous step (matching, allocation,
  finishing, building the metadata);
* worker role (the worker process): when the step reached the worker (``bind``), the load copy,
  the end of the forward (``wait_for_save``) and the save copy.

``benchmarks/step_profile.py`` joins the two (both use the system-wide monotonic clock) into
the per-step breakdown: forward, copies, connector, everything else, idle. Off by default: a
hook then costs a clock read and one attribute test. Lines are buffered and flushed every
:data:`FLUSH_EVERY` steps, every :data:`FLUSH_AFTER_S` seconds and at shutdown, so tracing adds
no per-step system call.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, TextIO

ENV_STEP_TRACE = "KVBRANCH_STEP_TRACE"
FLUSH_EVERY = 64
#: ... or when this many seconds passed since the last flush (a process may be killed).
FLUSH_AFTER_S = 2.0


class StepTrace:
    """One role's trace file, or nothing when tracing is off (``enabled`` is False)."""

    def __init__(self, role: str, folder: str | None = None) -> None:
        folder = folder if folder is not None else os.environ.get(ENV_STEP_TRACE)
        self._file: TextIO | None = None
        self._lines: list[str] = []
        #: Seconds spent in connector hooks since the last record, by hook.
        self.hook_s: dict[str, float] = {}
        self._flushed_at = time.monotonic()
        if folder:
            path = Path(folder)
            path.mkdir(parents=True, exist_ok=True)
            self._file = (path / f"{role}-{os.getpid()}.jsonl").open("a", encoding="utf-8")

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def add_hook_time(self, hook: str, started: float) -> None:
        """Add the time since ``started`` (``time.perf_counter()``) to ``hook``'s total."""
        self.hook_s[hook] = self.hook_s.get(hook, 0.0) + time.perf_counter() - started

    def record(self, **fields: Any) -> None:
        if self._file is None:
            return
        if self.hook_s:
            fields["hook_s"] = {k: round(v, 6) for k, v in self.hook_s.items()}
            self.hook_s = {}
        self._lines.append(json.dumps(fields, separators=(",", ":")))
        if len(self._lines) >= FLUSH_EVERY or time.monotonic() - self._flushed_at > FLUSH_AFTER_S:
            self.flush()

    def flush(self) -> None:
        if self._file is None or not self._lines:
            return
        self._file.write("\n".join(self._lines) + "\n")
        self._file.flush()
        self._lines = []
        self._flushed_at = time.monotonic()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


def scheduled_token_split(num_scheduled_tokens: dict[str, int]) -> tuple[int, int]:
    """(prefill tokens, decode tokens) of a step: a request scheduled for one token decodes."""
    prefill = decode = 0
    for n in num_scheduled_tokens.values():
        if n == 1:
            decode += 1
        else:
            prefill += n
    return prefill, decode
