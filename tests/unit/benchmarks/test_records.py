"""A result record survives its file unchanged, a broken record file is named instead of read as
something else, and ``report`` builds RESULTS.md from records alone: the same records give the
same file, and its sections show every target of the latest numbers, met or not (pure logic)."""

from __future__ import annotations

import json
import math
import random

import pytest

from benchmarks import headline, records, report
from benchmarks.records import Record

ROOT_RECORDS = records.RESULTS_DIR


def _rec(**kw) -> Record:
    base = dict(
        benchmark="turn_ttft",
        config="kvbranch",
        metric="TTFT at turn 6",
        value=1.715,
        unit="s",
        machine="AMD EPYC, 2 cores",
        commit="80f1afe",
        date="2026-12-01 14:31 UTC",
        command=".venv/bin/python -m benchmarks turn_ttft",
    )
    base.update(kw)
    return Record(**base)


def test_a_record_round_trips_through_its_file(tmp_path):
    recs = [
        _rec(target="<= 1.2x", met=False, plots=("turn_ttft.png",), note="a | pipe"),
        _rec(config="plain", value=10.9),
        _rec(metric="could not measure", value=math.nan, met=None),
        _rec(metric="count", value=5, unit="turns", target="all 5", met=True),
    ]
    path = records.write_run(recs, tmp_path)
    assert path.name == "202612011431-turn_ttft-80f1afe.json"
    back = records.read_all(tmp_path)
    assert back[:2] + back[3:] == recs[:2] + recs[3:]
    assert math.isnan(back[2].value) and back[2].metric == "could not measure"
    assert json.loads(path.read_text())[2]["value"] is None  # JSON has no NaN
    assert list(json.loads(path.read_text())[0]) == list(records.FIELDS)


@pytest.mark.parametrize(
    "change",
    [
        {"value": "1.7"},
        {"value": True},
        {"met": "yes"},
        {"unit": ""},
        {"plots": "x.png"},
        {"surprise": 1},
        {"commit": 7},
    ],
)
def test_a_broken_record_is_refused_naming_its_file(tmp_path, change):
    data = _rec().to_dict()
    data.update(change)
    (tmp_path / "202612011431-x.json").write_text(json.dumps([data]))
    with pytest.raises(ValueError, match="202612011431-x.json"):
        records.read_all(tmp_path)


def test_stamping_fills_only_what_the_benchmark_left_empty():
    ctx = records.RunContext("machine", "c0ffee1", "2026-12-05 02:00 UTC", "cmd")
    own = records.result("b", "c", "m", 1, "s")
    kept = _rec()
    stamped = records.stamp([own, kept], ctx)
    assert (stamped[0].machine, stamped[0].commit, stamped[0].date) == (
        "machine",
        "c0ffee1",
        "2026-12-05 02:00 UTC",
    )
    assert stamped[1] == kept  # migrated records keep their own date, commit, machine


def _history() -> list[Record]:
    old = "2026-12-01 10:00 UTC"
    new = "2026-12-03 10:00 UTC"
    return [
        _rec(date=old, commit="1111111", metric="p50", value=9.0, target=">= 3x", met=True),
        _rec(date=old, commit="1111111", config="plain", metric="p50", value=20.0),
        _rec(date=new, commit="2222222", metric="p50", value=2.0, target=">= 3x", met=False),
        _rec(date=old, commit="1111111", metric="quick p50", value=4.0, target="<= 5", met=True),
        _rec(benchmark="capacity", metric="wrong answers", value=0, unit="answers", target="0"),
        _rec(benchmark="capacity", metric="died", value=1, unit="processes", target="0", met=False),
    ]


def test_report_is_the_same_for_the_same_record_files_whatever_order_they_were_written(tmp_path):
    runs: dict[tuple[str, str, str], list[Record]] = {}
    for r in _history():
        runs.setdefault((r.benchmark, r.date, r.commit), []).append(r)
    texts = []
    for seed in (1, 2, 3):
        folder = tmp_path / str(seed)
        order = list(runs.values())
        random.Random(seed).shuffle(order)
        for run in order:
            records.write_run(run, folder)
        texts.append(report.render(records.read_all(folder)))
    assert texts[0] == texts[1] == texts[2] == report.render(records.read_all(tmp_path / "1"))
    assert texts[0].endswith("\n") and len(texts[0].splitlines()) < 300


def test_the_sections_show_every_target_of_the_latest_numbers():
    text = report.render(_history(), [])
    # Table cells, and the lines of a run of one config (one line per metric, no table).
    cells = "\n".join(line for line in text.splitlines() if line.startswith(("| ", "  - ")))
    assert "2 s (target >= 3x: **NOT MET**)" in cells
    assert "| 9 s" not in cells  # the older p50 is superseded
    assert "4 s (target <= 5: MET)" in cells  # its own latest
    assert "0 answers (target 0: –)" in cells  # undecided
    assert "1 processes (target 0: **NOT MET**)" in cells


def test_a_run_of_one_config_is_one_line_per_metric_and_a_retired_metric_is_named_once(
    monkeypatch,
):
    monkeypatch.setitem(report.RETIRED, "turn_ttft", {"old ratio": "the new probe"})
    probe = dict(date="2026-12-02 10:00 UTC", commit="3333333", config="probe", unit="x")
    recs = [
        *_history(),
        _rec(metric="bfcl 4x3: old ratio", value=1.78, unit="x", target="<= 1.3x", met=False),
        _rec(**probe, metric="moved / local", value=1.03, target="<= 1.3x", met=True),
    ]
    text = report.render(recs, [])
    section = text.split("\n## turn_ttft\n", 1)[1].split("\n## ", 1)[0]
    assert "old ratio" in section and "1.78" not in section  # named, its number not shown
    assert "`old ratio` (the new probe)" in section
    # A run of one config: a line under its run line, not a one-column table.
    run = section.split("git 3333333", 1)[1]
    assert run.split("\n")[1] == "  - moved / local (probe): 1.03x (target <= 1.3x: MET)"


def test_a_finished_study_is_one_line_that_names_every_target_it_missed():
    study = [
        _rec(
            benchmark="soak", metric="wrong answers", value=0, unit="answers", target="0", met=True
        ),
        _rec(benchmark="soak", metric="died", value=1, unit="processes", target="0", met=False),
    ]
    text = report.render([*_history(), *study], [])
    assert "\n## soak\n" not in text  # benchmarks/history/soak.py: a finished study
    (line,) = [x for x in text.splitlines() if x.startswith("- **soak**")]
    assert "1 of 2 targets met" in line and "not met: died 1 processes (0)" in line
    named = report.render([*_history(), *study], [headline.Claim(claim="c", benchmark="soak")])
    assert "\n## soak\n" in named  # a study a headline row names keeps its section


def test_each_section_names_the_runs_its_numbers_come_from():
    text = report.render(_history())
    section = text.split("\n## turn_ttft\n", 1)[1]
    assert section.index("git 2222222") < section.index("git 1111111")  # newest run first
    assert "history/RESULTS-log-2026.md" in text


def test_the_committed_results_md_is_what_the_committed_records_give():
    assert report.RESULTS_MD.read_text() == report.render(records.read_all(ROOT_RECORDS))


def test_report_check_says_when_results_md_is_stale(tmp_path, capsys):
    records.write_run(_history()[:1], tmp_path)
    out = tmp_path / "RESULTS.md"
    argv = ["--results-dir", str(tmp_path), "--out", str(out), "--no-readme"]
    assert report.main([*argv, "--check"]) == 1
    assert report.main(argv) == 0
    assert report.main([*argv, "--check"]) == 0
    assert "up to date" in capsys.readouterr().out
