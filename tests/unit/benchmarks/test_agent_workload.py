"""agent_workload's pure helpers."""

from __future__ import annotations

from benchmarks.agent_sessions import split_config
from benchmarks.agent_workload import plot_name


def test_a_pd_run_does_not_replace_the_single_instance_plot():
    assert plot_name("full", ["plain", "kvbranch"]) == "agent_workload_full.png"
    assert plot_name("full", ["pd", "pd-kvbranch:--agent-priority --"]) == (
        "agent_workload_full_pd.png"
    )
    # A run that mixes both keeps the single-instance name (it has the plain baseline).
    assert plot_name("quick", ["plain", "pd-kvbranch"]) == "agent_workload_quick.png"


def test_config_flags_split_from_the_name():
    assert split_config("kvbranch:--max-num-seqs=4 --x") == (
        "kvbranch",
        ["--max-num-seqs=4", "--x"],
    )
    assert split_config("pd") == ("pd", [])
