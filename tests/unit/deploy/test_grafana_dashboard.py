"""The Grafana dashboard (deploy/grafana/kvbranch.json) must only query series that exist: every
metric name in its PromQL is one the code registers (kvbranch's collector on vLLM's /metrics,
the connector's copy histogram, the router's counters) or one the installed vLLM registers;
and every kvbranch metric the code registers has a panel, so a renamed or new metric fails
here rather than as an empty panel in production.

Names are taken from the running code (the collectors are run against a fake stats answer and
throwaway registries), not from a list kept by hand: Prometheus series names follow from each
family's type (counter ``_total``, histogram ``_bucket``/``_sum``/``_count``).
"""

from __future__ import annotations

import collections
import inspect
import json
import re
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry

from sdk.contract import PDStats
from server.connector.control.models import EngineStats, EngineStoreStats, SchedulerStats

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "kvbranch.json"

SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "unknown": ("",),
}
PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "le",
    "inf",
    "nan",
}


def _series(registry: CollectorRegistry) -> set[str]:
    return {
        family.name + suffix for family in registry.collect() for suffix in SUFFIXES[family.type]
    }


def _fake_stats() -> EngineStats:
    """A connector stats answer: every field of the control op's answer model, zero where a
    number goes (so that a field the collector reads and the model lacks fails here)."""
    store = dict.fromkeys(EngineStoreStats.model_fields, 1)
    pd = dict(dict.fromkeys(PDStats.model_fields, 0), handles_declined={"expired": 1})
    stats: dict[str, Any] = dict.fromkeys(EngineStats.model_fields, 0)
    stats.update(
        store=store,
        sessions=[],
        hits_tokens={"device": 1, "host": 1, "remote": 1, "recomputed": 1},
        pd=pd,
        scheduler=dict.fromkeys(SchedulerStats.model_fields, 0),
    )
    return EngineStats.model_validate(stats)


def kvbranch_series(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    from server.connector.engine.stats import KVBranchPromMetrics
    from server.plugin import metrics
    from server.router.app import Router

    monkeypatch.setattr(metrics, "call_sync", lambda *a, **k: _fake_stats())
    plugin = CollectorRegistry()
    plugin.register(metrics.KVBranchCollector("/nonexistent.sock"))
    counters: dict[str, Any] = collections.defaultdict(int, outage=False)
    plugin.register(metrics.IndexPublisherCollector(SimpleNamespace(counters=lambda: counters)))

    connector = CollectorRegistry()
    types = {
        cls: partial(cls, registry=connector)
        for cls in (prometheus_client.Gauge, prometheus_client.Counter, prometheus_client.Histogram)
    }
    KVBranchPromMetrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]}
    )

    router = Router(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], hold_ttl_s=1.0)
    return _series(plugin) | _series(connector) | _series(router.registry)


def vllm_series() -> set[str]:
    """Every ``vllm:`` name in the installed vLLM's metrics logger, with any type's suffix
    (the logger builds its metrics from a full engine config; its source names them all)."""
    from vllm.v1.metrics import loggers

    names = set(re.findall(r"""["'](vllm:[a-z0-9_:]+)["']""", inspect.getsource(loggers)))
    assert "vllm:time_to_first_token_seconds" in names  # the scan still finds them
    return {
        name + suffix
        for name in names
        for suffix in {s for group in SUFFIXES.values() for s in group}
    }


def _expressions(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for value in node.values() for e in _expressions(value)]
    if isinstance(node, list):
        return [e for value in node for e in _expressions(value)]
    return []


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (labels, ranges, functions, grouping
    clauses, strings and numbers left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings (label values)
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        rest = text[match.end() :].lstrip()
        if rest.startswith("("):
            continue  # a function
        if match.group().lower() in PROMQL_WORDS:
            continue
        names.add(match.group())
    return names


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_the_name_parser() -> None:
    expr = (
        "histogram_quantile(0.95, sum by (le, direction) (rate(kvbranch_host_copy_seconds_"
        'bucket{job=~"$job",x="a{b}"}[$__rate_interval]))) / sum(vllm:prompt_tokens_total)'
    )
    assert metric_names(expr) == {"kvbranch_host_copy_seconds_bucket", "vllm:prompt_tokens_total"}


def test_every_panel_query_names_a_registered_metric(
    dashboard: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    known = kvbranch_series(monkeypatch) | vllm_series()
    exprs = _expressions(dashboard["panels"])
    assert len(exprs) > 20
    unknown = {}
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        if names - known:
            unknown[expr] = sorted(names - known)
    assert not unknown, f"queries name metrics nothing registers: {unknown}"


def test_every_kvbranch_metric_has_a_panel(
    dashboard: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    def family(series: str) -> str:
        return re.sub(r"_(total|created|bucket|sum|count)$", "", series)

    used = {family(n) for e in _expressions(dashboard["panels"]) for n in metric_names(e)}
    missing = {family(s) for s in kvbranch_series(monkeypatch)} - used
    assert not missing, f"kvbranch metrics without a panel: {sorted(missing)}"


def test_dashboard_shape(dashboard: dict[str, Any]) -> None:
    """Importable as is: a datasource variable every panel uses, unique ids, no overlaps."""
    assert dashboard["uid"] and dashboard["title"] == "kvbranch"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        area = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not (area & cells), f"panel {p['title']!r} overlaps another"
        cells |= area
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}"
            assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])


def test_the_config_files_parse() -> None:
    """The provisioning and scrape files are valid YAML that point at what they should."""
    yaml = pytest.importorskip("yaml")
    deploy = DASHBOARD.parents[1]
    prom = yaml.safe_load((deploy / "prometheus" / "prometheus.yml").read_text())
    targets = [
        t for job in prom["scrape_configs"] for c in job["static_configs"] for t in c["targets"]
    ]
    assert "127.0.0.1:8000" in targets  # python -m server's default port
    provisioning = deploy / "grafana" / "provisioning"
    source = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    assert source["datasources"][0]["type"] == "prometheus"
    provider = yaml.safe_load((provisioning / "dashboards" / "kvbranch.yml").read_text())
    assert provider["providers"][0]["options"]["path"].endswith("/kvbranch")
