"""Result records: one JSON object per number a benchmark run measured, one file per run under
``benchmarks/results/``.

Why records and not a Markdown log: ``benchmarks/RESULTS.md`` used to be appended to by every
run and its headline table was written by hand, so the headline drifted from the sections and the
file grew to thousands of lines. A record carries everything needed to read one number on its
own (what was measured, on which configuration, against which target, on which machine, at which
commit and date, by which command), and :mod:`benchmarks.report` rebuilds RESULTS.md from the
records alone.

A benchmark's ``run`` returns records with only the measurement filled in (:func:`result`); the
dispatcher (:mod:`benchmarks.__main__`) stamps the run's machine, commit, date and command on
every one (:func:`stamp`) and writes them (:func:`write_run`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: Every key of a record's JSON object, in the order it is written.
FIELDS = (
    "benchmark",
    "config",
    "metric",
    "value",
    "unit",
    "target",
    "met",
    "machine",
    "commit",
    "date",
    "command",
    "plots",
    "note",
)


@dataclass(frozen=True)
class Record:
    """One measured number. ``target`` says in words what the number should be (empty: no
    target), ``met`` whether it is (None: no target, or not decidable from this run).
    ``date`` is ``YYYY-MM-DD HH:MM UTC``, so that dates sort as text. ``plots`` are paths
    relative to ``benchmarks/``."""

    benchmark: str
    config: str
    metric: str
    value: float
    unit: str
    target: str = ""
    met: bool | None = None
    machine: str = ""
    commit: str = ""
    date: str = ""
    command: str = ""
    plots: tuple[str, ...] = field(default_factory=tuple)
    note: str = ""

    def __post_init__(self) -> None:
        # one type for every value, however the benchmark computed it (an int count, numpy)
        object.__setattr__(self, "value", float(self.value))
        object.__setattr__(self, "plots", tuple(self.plots))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["plots"] = list(self.plots)
        if isinstance(self.value, float) and not math.isfinite(self.value):
            out["value"] = None  # JSON has no NaN; a run that could not measure says so
        return {key: out[key] for key in FIELDS}

    @classmethod
    def from_dict(cls, data: Any) -> Record:
        """The record of one JSON object; ValueError on a missing, unknown or mistyped key
        (a record file is read back by ``report``: a broken one must be named, not skipped)."""
        if not isinstance(data, dict):
            raise ValueError(f"a record is a JSON object, not {type(data).__name__}")
        unknown = set(data) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown record keys {sorted(unknown)}")
        for key in ("benchmark", "config", "metric", "unit"):
            if not isinstance(data.get(key), str) or not data[key]:
                raise ValueError(f"record key {key!r} must be a non-empty string")
        value = data.get("value")
        if value is None:
            value = math.nan
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError("record key 'value' must be a number or null")
        met = data.get("met")
        if met is not None and not isinstance(met, bool):
            raise ValueError("record key 'met' must be true, false or null")
        plots = data.get("plots", [])
        if not isinstance(plots, list) or not all(isinstance(p, str) for p in plots):
            raise ValueError("record key 'plots' must be a list of strings")
        text = {}
        for key in ("target", "machine", "commit", "date", "command", "note"):
            text[key] = data.get(key, "")
            if not isinstance(text[key], str):
                raise ValueError(f"record key {key!r} must be a string")
        return cls(
            benchmark=data["benchmark"],
            config=data["config"],
            metric=data["metric"],
            value=float(value),
            unit=data["unit"],
            met=met,
            plots=tuple(plots),
            **text,
        )


def result(
    benchmark: str,
    config: str,
    metric: str,
    value: float,
    unit: str,
    target: str = "",
    met: bool | None = None,
    plots: tuple[str, ...] = (),
    note: str = "",
) -> Record:
    """A record with the measurement only; the dispatcher stamps the run's context on it."""
    return Record(
        benchmark, config, metric, float(value), unit, target, met, plots=plots, note=note
    )


@dataclass(frozen=True)
class RunContext:
    """What every record of one run shares."""

    machine: str
    commit: str
    date: str
    command: str


def stamp(records: list[Record], ctx: RunContext) -> list[Record]:
    """The records with the run's context filled in where the benchmark left it empty."""
    return [
        dataclasses.replace(
            r,
            machine=r.machine or ctx.machine,
            commit=r.commit or ctx.commit,
            date=r.date or ctx.date,
            command=r.command or ctx.command,
        )
        for r in records
    ]


def run_file_name(benchmark: str, date: str, commit: str) -> str:
    """``<date>-<benchmark>-<commit>.json`` with the date's digits only: one file per run,
    listed in time order."""
    digits = re.sub(r"[^0-9]", "", date)[:12]
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{benchmark}-{commit or 'unknown'}")
    return f"{digits}-{safe}.json"


def dumps(records: list[Record]) -> str:
    """A run's records as the text of its file (a JSON list, one object per record)."""
    return json.dumps([r.to_dict() for r in records], indent=1, ensure_ascii=False) + "\n"


def loads(text: str) -> list[Record]:
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("a record file holds a JSON list of records")
    return [Record.from_dict(item) for item in data]


def write_run(records: list[Record], directory: Path = RESULTS_DIR) -> Path:
    """Write one run's (stamped) records to their own file; the path written."""
    if not records:
        raise ValueError("a run without records writes no file")
    first = records[0]
    path = directory / run_file_name(first.benchmark, first.date, first.commit)
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(records))
    return path


def read_all(directory: Path = RESULTS_DIR) -> list[Record]:
    """Every record under ``directory``; a file that does not parse raises ValueError naming
    it."""
    out: list[Record] = []
    for path in sorted(directory.glob("*.json")):
        try:
            out.extend(loads(path.read_text()))
        except (ValueError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: {exc}") from exc
    return out
