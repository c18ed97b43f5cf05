"""The results page a reader meets first: a headline of at most 12 claims chosen in
benchmarks/headline.toml, every ratio written so that above 1 kvbranch is better, numbers rounded
to three significant digits, a claim without a record said to be "not measured", the hardware
named, the README's figures generated from the same records, every plot in benchmarks/plots/,
and the whole page within 300 lines (pure logic: no server)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from benchmarks import headline, records, report, reporting
from benchmarks.headline import Claim
from benchmarks.records import Record
from benchmarks.report_format import fmt_value, sig3

BENCH = Path(report.__file__).resolve().parent
CPU = "AMD EPYC, 2 cores, 23.5 GiB RAM, Linux 6; Python 3.11.7, vLLM 0.32.0, torch 2.13.0+cpu"


def _rec(config: str, metric: str, value: float, unit: str = "s", **kw) -> Record:
    base = dict(benchmark="bench", machine=CPU, commit="abc1234", date="2026-12-05 10:00 UTC")
    base.update(kw)
    return Record(config=config, metric=metric, value=value, unit=unit, **base)  # type: ignore[arg-type]


def _row_of(claim: Claim, recs: list[Record]) -> headline.Row:
    return headline.rows([claim], report.latest(recs))[0]


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.321611, "0.322"),
        (14.951, "15"),
        (7531.9, "7532"),
        (10157, "10157"),
        (0.958701, "0.959"),
        (1.0, "1"),
        (2.5, "2.5"),
        (0.00123456, "0.00123"),
    ],
)
def test_numbers_have_three_significant_digits_and_never_an_exponent(value, text):
    assert sig3(value) == text


def test_a_fraction_is_a_percentage_and_a_ratio_has_no_space():
    assert fmt_value(1.0, "fraction") == "100%"
    assert fmt_value(0.981, "fraction") == "98.1%"
    assert fmt_value(2.7912, "x") == "2.79x"
    assert fmt_value(0.3216, "s") == "0.322 s"


def test_every_ratio_is_above_1_when_kvbranch_is_better_whatever_the_metric():
    times = [_rec("plain", "p50", 10.0), _rec("kvbranch", "p50", 2.0)]
    lower = Claim("faster", "bench", "plain", "kvbranch", "p50", better="lower")
    assert _row_of(lower, times).ratio == pytest.approx(5.0)
    agents = [_rec("plain", "carried", 2, "agents"), _rec("kvbranch", "carried", 4, "agents")]
    higher = Claim("more", "bench", "plain", "kvbranch", "carried", better="higher")
    assert _row_of(higher, agents).ratio == pytest.approx(2.0)
    # a run's own kvbranch/plain ratio of a time (0.8: kvbranch faster) is shown inverted
    own = [_rec("kvbranch/plain", "median ratio", 0.8, "x")]
    inverted = Claim("cold", "bench", ratio_config="kvbranch/plain", ratio_metric="median ratio")
    assert _row_of(inverted, own).ratio == pytest.approx(0.8)
    inverted = dataclasses.replace(inverted, ratio_inverted=True)
    assert _row_of(inverted, own).ratio == pytest.approx(1.25)


def test_the_target_is_on_that_ratio_and_met_only_when_reached():
    recs = [_rec("plain", "p50", 10.0), _rec("kvbranch", "p50", 4.0)]
    claim = Claim("faster", "bench", "plain", "kvbranch", "p50", min_ratio=3)
    row = _row_of(claim, recs)
    assert (row.target, row.met) == ("≥ 3x", False)
    assert _row_of(dataclasses.replace(claim, min_ratio=2.5), recs).met is True
    line = headline.table([row], report.anchor)[2]
    assert "| 10 s | 4 s | 2.5x | ≥ 3x | **NOT MET** | [2026-12-05 10:00](#bench) |" in line


def test_a_claim_without_its_records_says_not_measured_and_shows_no_number():
    claim = Claim("P/D without the pull", "bench", "pd", "pd-kvbranch-nopull", "p50", min_ratio=1)
    row = _row_of(claim, [_rec("pd", "other metric", 3.0)])
    assert not row.measured
    line = headline.table([row], report.anchor)[2]
    assert "| – | – | – | ≥ 1x | not measured |" in line
    assert headline.readme_lines([row], "hw")[3] == "* P/D without the pull: not measured."


def test_a_one_number_claim_is_checked_against_its_minimum():
    claim = Claim("identical", "bench", kvbranch="kvbranch", metric="same", min_value=1.0)
    good = _row_of(claim, [_rec("kvbranch", "same", 1.0, "fraction")])
    bad = _row_of(claim, [_rec("kvbranch", "same", 0.96, "fraction")])
    assert (good.target, good.met, bad.met) == ("≥ 100%", True, False)
    assert good.ratio is None


def test_the_headline_shows_the_newest_record_and_never_a_variant_config():
    old = _rec("kvbranch", "p50", 3.0, date="2026-12-01 10:00 UTC")
    new = _rec("kvbranch", "p50", 2.0, date="2026-12-05 10:00 UTC")
    family = _rec("kvbranch@dense", "p50", 0.02, date="2026-12-06 10:00 UTC")
    plain = _rec("plain", "p50", 10.0)
    claim = Claim("faster", "bench", "plain", "kvbranch", "p50")
    row = _row_of(claim, [old, new, family, plain])
    assert row.kvbranch == new and row.ratio == pytest.approx(5.0)


def test_variant_configs_get_one_row_each_in_their_benchmark_section():
    recs = [
        _rec("plain", "TTFT at turn 6", 10.0),
        _rec("plain@dense", "TTFT at turn 4", 0.06, note="tiny dense model"),
        _rec("kvbranch@dense", "TTFT at turn 4", 0.02, note="tiny dense model"),
        _rec("kvbranch@mla", "TTFT at turn 4", 0.25, note="tiny mla model", commit="def5678"),
    ]
    text = report.render(recs, [])
    section = text.split("\n## bench\n", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith(("| dense", "| mla"))]
    assert len(rows) == 2
    assert rows[0].startswith("| dense | 0.06 s | 0.02 s |") and "tiny dense model" in rows[0]
    assert rows[1].startswith("| mla |  | 0.25 s |") and "git def5678" in rows[1]


def test_per_agent_count_numbers_are_one_row_per_config_and_count():
    recs = [
        _rec(c, f"bfcl agents={n} resumed TTFT p90", v, target="<= 1.7 s", met=v <= 1.7)
        for c, n, v in (("kvbranch", 1, 0.7), ("kvbranch", 2, 1.9), ("plain", 1, 1.0))
    ] + [_rec("kvbranch", "bfcl agents=1 answers identical to plain", 1.0, "fraction")]
    section = report.render(recs, []).split("\n## bench\n", 1)[1]
    table = [line for line in section.splitlines() if line.startswith("| ")]
    assert table[0] == "| config, agents | resumed TTFT p90 | answers identical to plain |"
    assert table[1] == "| kvbranch, bfcl 1 | 0.7 s (target <= 1.7 s: MET) | 100% |"
    assert table[2] == "| kvbranch, bfcl 2 | 1.9 s (target <= 1.7 s: **NOT MET**) |  |"
    assert len(table) == 4  # the header and one row per config and count


def test_the_hardware_line_says_cpu_only_until_a_record_names_a_gpu():
    cpu = [_rec("plain", "p50", 1.0)]
    assert "CPU only, no GPU run yet" in headline.hardware_line(cpu)
    assert "AMD EPYC, 2 cores" in headline.hardware_line(cpu)
    gpu = cpu + [_rec("plain", "p50", 1.0, machine="NVIDIA H100, 16 cores; torch 2.13.0+cu128")]
    line = headline.hardware_line(gpu)
    assert "no GPU run yet" not in line and "NVIDIA H100" in line


def test_headline_toml_is_refused_past_12_rows_or_with_an_unknown_key(tmp_path):
    row = '[[row]]\nclaim = "c"\nbenchmark = "b"\n'
    path = tmp_path / "h.toml"
    path.write_text(row * 12)
    assert len(headline.load(path)) == 12
    path.write_text(row * 13)
    with pytest.raises(ValueError, match="at most 12"):
        headline.load(path)
    path.write_text(row + 'bettter = "lower"\n')
    with pytest.raises(ValueError, match="bettter"):
        headline.load(path)


def test_every_committed_headline_row_that_names_records_finds_them():
    """A renamed metric or config must not turn a claim into "not measured" silently: only a
    row that names no record may be unmeasured."""
    by_bench = report.latest(records.read_all())
    for claim, row in zip(headline.load(), headline.rows(headline.load(), by_bench), strict=True):
        names_records = bool(claim.kvbranch or claim.ratio_config)
        assert row.measured == names_records, claim.claim
        if claim.plain:
            assert row.plain is not None, claim.claim
        if claim.kvbranch:
            assert row.kvbranch is not None, claim.claim
        assert "@" not in (claim.plain + claim.kvbranch + claim.ratio_config), claim.claim


def test_the_committed_page_fits_300_lines_and_writes_no_raw_unit():
    text = report.render(records.read_all())
    assert len(text.splitlines()) <= 300
    assert " fraction" not in text and "e+" not in text
    head = text.split("## Headline", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in head.splitlines() if line.startswith("| ") and "---" not in line]
    assert 1 <= len(rows) - 1 <= headline.MAX_ROWS


def test_the_readme_figures_are_the_headline_of_the_committed_records():
    readme = report.README_MD.read_text()
    assert report.render_readme(readme, records.read_all()) == readme
    block = readme.split(headline.README_START, 1)[1].split(headline.README_END, 1)[0]
    assert "CPU only" in block and block.count("\n* ") == len(headline.load())


def test_a_readme_without_the_markers_is_refused():
    with pytest.raises(ValueError, match="headline"):
        headline.with_readme_block("# no markers\n", ["x"])


def test_report_check_fails_while_the_readme_figures_are_stale(tmp_path, capsys):
    records.write_run([_rec("kvbranch", "p50", 2.0)], tmp_path / "results")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{headline.README_START}\nold figure\n{headline.README_END}\nend\n")
    argv = ["--results-dir", str(tmp_path / "results"), "--out", str(tmp_path / "R.md")]
    argv += ["--readme", str(readme)]
    assert report.main(argv) == 0
    assert "old figure" not in readme.read_text() and readme.read_text().endswith("end\n")
    assert report.main([*argv, "--check"]) == 0
    readme.write_text(readme.read_text().replace("CPU only", "GPU"))
    assert report.main([*argv, "--check"]) == 1
    assert "README.md is not what the records give" in capsys.readouterr().out


def test_every_plot_a_record_names_is_in_the_plots_folder():
    named = {p for r in records.read_all() for p in r.plots}
    assert named
    for plot in named:
        assert plot.startswith("plots/") and (BENCH / plot).is_file(), plot


def test_no_plot_or_raw_json_lies_at_the_top_of_benchmarks():
    assert not [p.name for p in BENCH.glob("*.png")]
    assert not [p.name for p in BENCH.glob("*.json")]


def test_a_recorded_plot_goes_to_plots_and_a_trial_plot_to_out():
    recorded = reporting.plot_path("turn_ttft.png", no_results=False)
    trial = reporting.plot_path("turn_ttft.png", no_results=True)
    assert recorded == BENCH / "plots" / "turn_ttft.png"
    assert trial.parent == reporting.OUT_DIR
    assert reporting.plot_ref(recorded) == ("plots/turn_ttft.png",)
    assert reporting.plot_ref(trial) == () and reporting.plot_ref(None) == ()
