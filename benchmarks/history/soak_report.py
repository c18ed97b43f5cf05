"""What the cluster soak (:mod:`benchmarks.history.soak`) found, from its records alone: per tenant
the requests served, the 4xx and 5xx by cause, the failures that happened while the only instance of
a role was down (reported apart, not counted against the cluster), the answers compared with
the plain vLLM replay, memory and Redis keys over time, and every target met or not — as a
Markdown report, records and a plot.

With aggregated replicas it also counts the turns that pulled their history from a peer, from
the replicas' ``/metrics`` read over the run (a reading is ``{"t", "member", "life", "counts"}``,
``life`` counting the replica's restarts: its counters start again at zero).

Pure functions of plain dicts (an event is :meth:`benchmarks.soak_abuse.Outcome.to_dict`, with a
``door`` when it was sent to a named process; a fault is ``{"role", "victim", "t_kill", "t_back",
"only"}``, a sample is ``{"t", "rss", "redis_keys"}``) so that the unit tests check the verdicts on
made-up runs.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks import reporting
from benchmarks.records import Record, result
from benchmarks.step_profile import sum_samples

LEGIT = ("A", "B")
#: A router that was never killed may grow this much over the soak (MiB of RSS, first sample
#: after the cluster was up to the last): more is a leak worth a look at this run length.
ROUTER_GROWTH_MIB = 64.0
FAULT_COLOURS = {
    "router": "tab:blue",
    "redis": "tab:red",
    "prefill": "tab:green",
    "decode": "tab:purple",
    "replica": "tab:green",
}
#: Roles whose processes serve a turn whole: a request in flight when one was killed may have
#: been the one it served (the router answers 503 then: a turn is never sent twice).
SERVING_ROLES = ("replica",)
#: ``kvbranch_peer_turns_total`` sources of turns that pulled their history from a peer.
PULLED = ("peer", "revived", "revived_run")
_PEER_TURNS = "kvbranch_peer_turns_total"
_PROMPT_TOKENS = "kvbranch_prompt_tokens_total"
_CONNECTOR_UP = "kvbranch_connector_up"
#: Keys of the totals that are no turn source (:func:`pull_line` lists the rest).
_NOT_SOURCES = ("pulled", "remote_tokens", "readings", "connector_down")


def in_fault(event: dict[str, Any], faults: list[dict[str, Any]]) -> bool:
    """Whether a request overlapped a fault that excuses its failure: the only instance of a
    role down (P, D or Redis with one of each), the very door it talked to killed (its router,
    or the replica it was sent to directly), or a replica killed while the request was in
    flight (that replica may have been serving it)."""
    door = event.get("door") or f"router{event['router']}"
    for f in faults:
        end = f["t_back"] if f["t_back"] is not None else float("inf")
        if event["t1"] < f["t_kill"] or event["t0"] > end:
            continue
        if f["only"] or f["victim"] == door:
            return True
        if f["role"] in SERVING_ROLES and event["t0"] <= f["t_kill"]:
            return True
    return False


def outcome(event: dict[str, Any]) -> str:
    """``ok`` (a legitimate request served, or a hostile one answered as expected), ``4xx`` (a
    legitimate request refused), ``5xx``, ``lost`` (no answer) or ``unexpected`` (a hostile
    request answered with a status outside its expected ones)."""
    status = event["status"]
    if status is None:
        return "lost"
    if status >= 500:
        return "5xx"
    if "expected" in event:
        return (
            "ok"
            if status in event["expected"] and not event.get("no_retry_after")
            else ("unexpected")
        )
    return "ok" if status < 400 else "4xx"


def tenant_summary(events: list[dict[str, Any]], faults: list[dict[str, Any]]) -> dict[str, dict]:
    """Per tenant: requests, served, 4xx and 5xx by cause (``status kind/case``), failures
    outside and during faults, unexpected answers to hostile requests."""
    out: dict[str, dict[str, Any]] = {}
    for ev in events:
        s = out.setdefault(
            ev["tenant"],
            {
                "requests": 0,
                "ok": 0,
                "by_cause": Counter(),
                "failed": 0,
                "failed_in_fault": 0,
                "unexpected": 0,
                "failures": [],
            },
        )
        s["requests"] += 1
        kind = outcome(ev)
        cause = f"{ev['status'] or 'no answer'} {ev['kind']}/{ev['case']}"
        if kind == "ok":
            s["ok"] += 1
            if ev["status"] >= 400:
                s["by_cause"][cause] += 1  # a hostile request refused as it should be
            continue
        s["by_cause"][cause] += 1
        if kind == "4xx":
            continue
        if kind == "unexpected":
            s["unexpected"] += 1
            s["failures"].append(_brief(ev))
        elif in_fault(ev, faults):
            s["failed_in_fault"] += 1
        else:
            s["failed"] += 1
            s["failures"].append(_brief(ev))
    return out


def _brief(ev: dict[str, Any]) -> str:
    why = ev.get("error") or ev.get("body") or ""
    door = ev.get("door") or f"router{ev['router']}"
    return (
        f"t={ev['t0']:.0f}s {door} {ev['kind']}/{ev['case']}: {ev['status'] or 'no answer'} {why}"[
            :240
        ]
    )


def compare_answers(served: list[dict[str, Any]]) -> dict[str, Any]:
    """Each served legitimate answer against the plain replay of its body (``answer`` and
    ``plain``: content and tool calls): how many compared, the same, and the wrong ones."""
    compared = [r for r in served if r.get("plain") is not None]
    wrong = [r for r in compared if r["answer"] != r["plain"]]
    return {
        "compared": len(compared),
        "same": len(compared) - len(wrong),
        "not_replayed": len(served) - len(compared),
        "wrong": [
            {"kind": r["kind"], "t0": r["t0"], "cluster": r["answer"], "plain": r["plain"]}
            for r in wrong
        ],
    }


def memory_summary(
    samples: list[dict[str, Any]], faults: list[dict[str, Any]], died: Any = ()
) -> dict[str, Any]:
    """Per process: first, peak and last RSS (MiB), whether it was killed (or ``died`` on its
    own), and its growth first → last when neither; Redis keys min / max / last."""
    killed = {f["victim"] for f in faults} | set(died)
    names = sorted({n for s in samples for n in s["rss"]})
    procs = {}
    for name in names:
        series = [s["rss"][name] for s in samples if s["rss"].get(name)]
        if not series:
            continue
        procs[name] = {
            "first": series[0],
            "peak": max(series),
            "last": series[-1],
            "killed": name in killed,
            "growth": None if name in killed else series[-1] - series[0],
        }
    keys = [s["redis_keys"] for s in samples if s.get("redis_keys") is not None]
    return {
        "procs": procs,
        "redis_keys": {"min": min(keys), "max": max(keys), "last": keys[-1]} if keys else None,
    }


def peer_pull_counts(metrics: str) -> dict[str, float]:
    """A replica's ``/metrics`` text: its session turns by where their history came from
    (``kvbranch_peer_turns_total``'s sources), ``remote_tokens``, the prompt tokens it
    pulled from peers, and ``connector_up``."""

    def key_of(sample: Any) -> str | None:
        if sample.name == _PEER_TURNS:
            return str(sample.labels.get("source"))
        if sample.name == _PROMPT_TOKENS and sample.labels.get("source") == "remote":
            return "remote_tokens"
        return "connector_up" if sample.name == _CONNECTOR_UP else None

    return sum_samples(metrics, key_of)


def pull_totals(readings: list[dict[str, Any]]) -> dict[str, float]:
    """The whole run's counts from the replicas' readings: each process life's last reading
    (its counters only grow until a kill ends it), summed over lives and replicas; ``pulled``
    is the turns that pulled from a peer (:data:`PULLED`)."""
    last: dict[tuple[str, int], dict[str, Any]] = {}
    for r in readings:
        key = (r["member"], r["life"])
        if key not in last or r["t"] >= last[key]["t"]:
            last[key] = r
    totals: Counter[str] = Counter()
    for r in last.values():
        totals.update({k: v for k, v in r["counts"].items() if k != "connector_up"})
    out = {k: float(v) for k, v in sorted(totals.items())}
    out["pulled"] = float(sum(totals.get(s, 0) for s in PULLED))
    # Readings whose connector stats were missing (``kvbranch_connector_up 0``: the collector
    # then gives no prompt-token rows, and the pulled tokens read as 0).
    out["readings"] = float(len(readings))
    out["connector_down"] = float(sum(r["counts"].get("connector_up") == 0 for r in readings))
    return out


class Target(NamedTuple):
    """One target of the soak: what it asks, whether it was met, the numbers in words, and the
    one number it is decided on (for the run's record)."""

    what: str
    met: bool
    detail: str
    value: float
    unit: str
    goal: str


def targets(
    tenants: dict[str, dict],
    answers: dict[str, Any],
    memory: dict[str, Any],
    faults: list[dict[str, Any]],
    end: dict[str, Any],
    pulls: dict[str, float] | None = None,
) -> list[Target]:
    """Every target of the soak: what the tenants were answered, then how the cluster held
    (and with replicas, whether turns pulled from peers)."""
    out = traffic_targets(tenants, answers) + cluster_targets(memory, faults, end)
    if pulls is not None:
        out.append(pull_target(pulls))
    return out


def pull_target(pulls: dict[str, float]) -> Target:
    """Turns landed on a replica other than their history's and pulled it: the aggregated
    cluster's KV followed its sessions under the faults."""
    n = pulls.get("pulled", 0.0)
    detail = ", ".join(f"{s} {pulls.get(s, 0):.0f}" for s in PULLED)
    return Target(
        "turns that pulled their history from a peer replica (kvbranch_peer_turns_total): > 0",
        n > 0,
        f"{n:.0f} ({detail}; {pulls.get('remote_tokens', 0):.0f} prompt tokens pulled)",
        n,
        "turns",
        "> 0",
    )


def traffic_targets(tenants: dict[str, dict], answers: dict[str, Any]) -> list[Target]:
    """The legitimate tenants served, right and never throttled; the hostile ones refused."""
    legit = [tenants.get(t, {"failed": 0, "by_cause": Counter(), "ok": 0}) for t in LEGIT]
    failed = sum(t["failed"] for t in legit)
    throttled = sum(n for t in legit for c, n in t["by_cause"].items() if c.startswith("429"))
    hostile = [tenants[t] for t in ("C", "anonymous") if t in tenants]
    bad = sum(t["failed"] + t["unexpected"] for t in hostile)
    c429 = sum(
        n for c, n in tenants.get("C", {}).get("by_cause", {}).items() if c.startswith("429")
    )
    return [
        Target(
            "legitimate requests failed (5xx or no answer) outside a fault of the only "
            "instance of a role or of their own router: 0",
            failed == 0,
            f"{failed} (and {sum(t.get('failed_in_fault', 0) for t in legit)} during faults)",
            failed,
            "requests",
            "0",
        ),
        Target(
            "wrong answers against the plain vLLM replay: 0",
            answers["compared"] > 0 and not answers["wrong"],
            f"{len(answers['wrong'])} of {answers['compared']} compared",
            len(answers["wrong"]),
            "answers",
            "0",
        ),
        Target(
            "legitimate tenants never throttled (429): 0",
            throttled == 0,
            str(throttled),
            throttled,
            "requests",
            "0",
        ),
        Target(
            "hostile requests answered as expected (4xx naming the problem; no 5xx outside a "
            "fault, no other status)",
            bad == 0 and bool(hostile),
            f"{bad} otherwise of {sum(t['requests'] for t in hostile)}",
            bad,
            "requests answered otherwise",
            "0",
        ),
        Target(
            "the tenant past its in-flight share got 429 with Retry-After",
            c429 > 0,
            str(c429),
            c429,
            "requests",
            "> 0",
        ),
    ]


def cluster_targets(
    memory: dict[str, Any], faults: list[dict[str, Any]], end: dict[str, Any]
) -> list[Target]:
    """The cluster recovered from every fault, its routers did not grow, nothing died on its
    own, and Redis holds no key forever."""
    recovered = [f for f in faults if f["t_back"] is not None]
    routers = {n: p for n, p in memory["procs"].items() if n.startswith("router")}
    growth = [p["growth"] for p in routers.values() if p["growth"] is not None]
    died = end.get("died", {})
    no_ttl = end.get("keys_without_ttl")
    return [
        Target(
            "the cluster recovered on its own from every fault",
            len(recovered) == len(faults) and bool(faults) and end.get("whole", False),
            f"{len(recovered)} of {len(faults)} faults; whole at the end: {end.get('whole')}",
            len(faults) - len(recovered),
            "faults not recovered from",
            "0",
        ),
        Target(
            f"a router never killed grows at most {ROUTER_GROWTH_MIB:.0f} MiB",
            bool(growth) and max(growth) <= ROUTER_GROWTH_MIB,
            ", ".join(
                f"{n} {p['growth']:+.1f} MiB" for n, p in routers.items() if p["growth"] is not None
            )
            or "no router ran throughout",
            max(growth) if growth else float("nan"),
            "MiB",
            f"<= {ROUTER_GROWTH_MIB:.0f} MiB",
        ),
        Target(
            "no process died on its own (every exit was a fault's SIGKILL)",
            not died,
            ", ".join(f"{n} at t={t:.0f}s" for n, t in died.items()) or "none",
            len(died),
            "processes",
            "0",
        ),
        Target(
            "every Redis key has a TTL at the end",
            no_ttl == 0,
            f"{no_ttl} of {end.get('keys')} without one",
            no_ttl if isinstance(no_ttl, int) else float("nan"),
            "keys without a TTL",
            "0",
        ),
    ]


def config_name(cfg: dict[str, Any]) -> str:
    """The records' configuration: ``cluster`` (P/D, as every earlier run) or ``N replicas``."""
    return f"{cfg['replicas']} replicas" if cfg.get("replicas") else "cluster"


def _pulls(record: dict[str, Any]) -> dict[str, float] | None:
    return pull_totals(record["pulls"]) if "pulls" in record else None


def records_of(record: dict[str, Any], plot: str) -> list[Record]:
    """One record per target of the run (benchmarks/records.py), the plot linked."""
    faults = record["faults"]
    tenants = tenant_summary(record["events"], faults)
    answers = compare_answers(record["served"])
    memory = memory_summary(record["samples"], faults, record["end"].get("died", {}))
    config = config_name(record["config"])
    return [
        result("soak", config, t.what, t.value, t.unit, t.goal, t.met, (plot,) if plot else ())
        for t in targets(tenants, answers, memory, faults, record["end"], _pulls(record))
    ]


def section(record: dict[str, Any], info: dict[str, str], elapsed_s: float, plot: str) -> str:
    """The Markdown report of one soak run."""
    faults = record["faults"]
    tenants = tenant_summary(record["events"], faults)
    answers = compare_answers(record["served"])
    memory = memory_summary(record["samples"], faults, record["end"].get("died", {}))
    pulls = _pulls(record)
    what = (
        f"{record['config']['replicas']} aggregated replicas"
        if record["config"].get("replicas")
        else "Redis"
    )
    lines = reporting.run_header(
        f"Cluster soak: tenants, abuse and faults through 2 routers + {what}", info, elapsed_s
    )
    lines += [workload_line(record["config"]), ""]
    lines += [tenant_table(tenants), fault_table(faults), memory_table(memory)]
    if pulls is not None:
        lines.append(pull_line(pulls))
    lines += findings(tenants, answers, memory, faults, record["end"], pulls)
    lines.append(f"- Plot: `{plot}` (RSS over time, Redis keys; faults marked).")
    return "\n".join(lines) + "\n"


def pull_line(pulls: dict[str, float]) -> str:
    """Every source of the replicas' session turns, summed over the run."""
    sources = ", ".join(f"{k} {v:.0f}" for k, v in pulls.items() if k not in _NOT_SOURCES)
    down = pulls.get("connector_down", 0)
    missing = (
        f" (the connector's stats were missing in {down:.0f} of {pulls.get('readings', 0):.0f} "
        "readings: `kvbranch_connector_up 0`)"
        if down
        else ""
    )
    return (
        f"- Replicas' session turns by where their history came from (summed over every "
        f"process life): {sources or 'none'}; pulled from a peer: {pulls['pulled']:.0f} turns, "
        f"{pulls.get('remote_tokens', 0):.0f} prompt tokens{missing}."
    )


def _topology(cfg: dict[str, Any]) -> str:
    if not cfg.get("replicas"):
        return f"{cfg['prefills']} P + {cfg['decodes']} D + 2 routers + Redis"
    policies = cfg.get("router_policies") or ["cache-aware", "cache-aware"]
    doors = ", ".join(cfg.get("doors") or [])
    return (
        f"{cfg['replicas']} aggregated replicas (`--role single --index`, a core each) + 2 "
        f"routers in aggregated mode (router0 {policies[0]}, router1 {policies[1]}) + Redis; "
        f"hostile rounds at {doors or 'the routers'}"
    )


def workload_line(cfg: dict[str, Any]) -> str:
    return (
        f"{_topology(cfg)}, three API keys (A and B "
        f"legitimate, C abusive), `--router-tenant-inflight {cfg['tenant_inflight']}`; "
        f"{cfg['traffic_s']:.0f} s of traffic: {cfg['agents']} agents per legitimate tenant "
        "(sessions over the session routes, several turns alternating routers, streaming and "
        "not, a fork per session, a tool-call request), beside them malformed bodies and "
        "headers, unauthenticated floods, idle sockets and tenant C past its share; a fault "
        f"(SIGKILL, then restart) every {cfg['fault_every_s']:.0f} s, cycling "
        f"{' → '.join(cfg['fault_cycle'])}. Answers replayed afterwards on plain vLLM "
        "(tests/vanilla_vllm.py, no kvbranch code), greedy, same bodies."
    )


def tenant_table(tenants: dict[str, dict]) -> str:
    header = [
        "tenant",
        "requests",
        "ok",
        "4xx / 5xx / no answer by cause",
        "failed",
        "failed during fault",
        "unexpected status",
    ]
    rows = []
    for name in sorted(tenants):
        t = tenants[name]
        causes = ", ".join(f"{c} ×{n}" for c, n in sorted(t["by_cause"].items())) or "–"
        rows.append(
            [
                name,
                t["requests"],
                t["ok"],
                causes,
                t["failed"],
                t["failed_in_fault"],
                t["unexpected"],
            ]
        )
    return reporting.md_table(header, rows)


def fault_table(faults: list[dict[str, Any]]) -> str:
    rows = [
        [
            f["role"],
            f["victim"],
            f"{f['t_kill']:.0f}",
            "never" if f["t_back"] is None else f"{f['t_back']:.0f}",
            f["only"],
        ]
        for f in faults
    ]
    header = ["fault", "victim", "killed at s", "back at s", "only one of its role"]
    return reporting.md_table(header, rows)


def memory_table(memory: dict[str, Any]) -> str:
    rows = [
        [
            n,
            f"{p['first']:.0f}",
            f"{p['peak']:.0f}",
            f"{p['last']:.0f}",
            "killed or died" if p["killed"] else f"{p['growth']:+.1f}",
        ]
        for n, p in memory["procs"].items()
    ]
    header = ["process (RSS of its tree)", "first MiB", "peak", "last", "growth"]
    return reporting.md_table(header, rows)


def findings(
    tenants: dict[str, dict],
    answers: dict[str, Any],
    memory: dict[str, Any],
    faults: list[dict[str, Any]],
    end: dict[str, Any],
    pulls: dict[str, float] | None = None,
) -> list[str]:
    """The report's bullet lines: Redis keys, answers, every target, what failed."""
    lines = []
    keys = memory["redis_keys"]
    if keys:
        lines.append(f"- Redis keys: min {keys['min']}, max {keys['max']}, last {keys['last']}.")
    lines.append(
        f"- Answers: {answers['same']} of {answers['compared']} identical to plain vLLM"
        f" ({answers['not_replayed']} not replayed)."
    )
    for w in answers["wrong"][:5]:
        lines.append(
            f"- WRONG ({w['kind']}, t={w['t0']:.0f}s): cluster {w['cluster']!r} vs "
            f"plain {w['plain']!r}"[:400]
        )
    for t in targets(tenants, answers, memory, faults, end, pulls):
        lines.append(f"- Target: {t.what} — {t.detail}: {'met' if t.met else '**NOT met**'}.")
    for f in faults:
        if f.get("restart_error"):
            lines.append(f"- {f['victim']} did not start again: {f['restart_error']}")
    for name, t in sorted(tenants.items()):
        for f in t["failures"][:6]:
            lines.append(f"- {name} failure: {f}")
    return lines


def plot(record: dict[str, Any], path: Path) -> bool:
    """Memory (instances, routers) and Redis keys over time, the faults as vertical lines."""
    plt = reporting.pyplot()
    if plt is None or not record["samples"]:
        return False
    samples, faults = record["samples"], record["faults"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    names = sorted({n for s in samples for n in s["rss"]})
    for name in names:
        ax = axes[1] if name.startswith("router") else axes[0]
        pts = [(s["t"], s["rss"][name]) for s in samples if s["rss"].get(name)]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ".-", ms=3, label=name)
    keys = [(s["t"], s["redis_keys"]) for s in samples if s.get("redis_keys") is not None]
    axes[2].plot(
        [k[0] for k in keys], [k[1] for k in keys], ".-", ms=3, color="tab:red", label="Redis keys"
    )
    for f in faults:
        for ax in axes:
            ax.axvline(f["t_kill"], color=FAULT_COLOURS.get(f["role"], "k"), ls="--", lw=1)
        axes[0].annotate(
            f"kill {f['victim']}",
            (f["t_kill"], 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            fontsize=7,
        )
    for ax, label in zip(axes, ("instances RSS MiB", "routers RSS MiB", "Redis keys"), strict=True):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[2].set_xlabel("seconds since traffic began (dashed: a SIGKILL)")
    axes[0].set_title("kvbranch cluster soak: memory and Redis keys under faults and abuse")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
