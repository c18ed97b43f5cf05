"""Start and stop the upstream P/D baseline: P on core 0, D on core 1 (the cores ``python -m
server --disagg`` gives them on 2 cores), both plain vLLM (:mod:`benchmarks.upstream_pd.instance`),
and the proxy (:mod:`benchmarks.upstream_pd.proxy`) in front; clients talk to the proxy as to
one server.

    with UpstreamPD(kv_cache_gib=0.15, max_model_len=4096) as pd:
        ...  # requests to pd.url; pd.prefill.url for P's own /metrics
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import httpx

from server.launcher.process import ServerProcess, free_port

#: vLLM's counter of prompt tokens by where they came from (``source`` label).
SOURCE_METRIC = "vllm:prompt_tokens_by_source_total"
PULLED = "external_kv_transfer"


class Instance(ServerProcess):
    module = "benchmarks.upstream_pd.instance"


class ProxyProcess(ServerProcess):
    module = "benchmarks.upstream_pd.proxy"


@dataclass
class UpstreamPD:
    kv_cache_gib: float
    max_model_len: int
    hold_ttl_s: int = 30
    failure_policy: str = "fail"
    nixl_progress_us: int = 1000
    mq_spin_ms: float = 2.0
    idle_poll_ms: float = 20.0
    cores: tuple[str, str] = ("0", "1")
    ready_timeout: float = 1200.0
    name: str = "pd-upstream"
    #: Extra environment of P and D (e.g. ``VLLM_SERVER_DEV_MODE=1``).
    env: dict[str, str] = field(default_factory=dict)
    processes: list[ServerProcess] = field(default_factory=list)

    def instance_args(self, role: str, core: str) -> list[str]:
        return [
            *("--role", role, "--cpu-cores", core, "--nixl-port", str(free_port())),
            *("--kv-cache-gib", str(self.kv_cache_gib)),
            *("--max-model-len", str(self.max_model_len), "--hold-ttl-s", str(self.hold_ttl_s)),
            *("--failure-policy", self.failure_policy),
            *("--nixl-progress-us", str(self.nixl_progress_us)),
            *("--mq-spin-ms", str(self.mq_spin_ms), "--idle-poll-ms", str(self.idle_poll_ms)),
        ]

    def start(self) -> UpstreamPD:
        t0 = time.monotonic()
        try:
            self.prefill = Instance(
                self.instance_args("prefill", self.cores[0]),
                name=f"{self.name}-p",
                ready_timeout=self.ready_timeout,
                env=self.env,
            )
            self.decode = Instance(
                self.instance_args("decode", self.cores[1]),
                name=f"{self.name}-d",
                ready_timeout=self.ready_timeout,
                env=self.env,
            )
            self.processes += [self.prefill.launch(), self.decode.launch()]
            self.prefill.wait_ready()
            self.decode.wait_ready()
            proxy_args = ["--prefill", self.prefill.url, "--decode", self.decode.url]
            self.proxy = ProxyProcess(
                [*proxy_args, "--ttl-s", str(self.hold_ttl_s)], name=f"{self.name}-proxy"
            )
            self.processes.append(self.proxy.start())
        except BaseException:
            self.stop()
            raise
        print(
            f"[{self.name}] P {self.prefill.url} (core {self.cores[0]}), D {self.decode.url} "
            f"(core {self.cores[1]}), proxy {self.proxy.url} ready after "
            f"{time.monotonic() - t0:.0f}s (logs {self.prefill.log_path}, "
            f"{self.decode.log_path}, {self.proxy.log_path})",
            flush=True,
        )
        return self

    @property
    def url(self) -> str:
        return self.proxy.url

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()

    def __enter__(self) -> UpstreamPD:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def prompt_tokens_by_source(self) -> dict[str, float]:
        """P's own count of prompt tokens by source (``external_kv_transfer``: pulled from D)."""
        return tokens_by_source(httpx.get(f"{self.prefill.url}/metrics", timeout=30).text)

    def proxy_stats(self) -> dict[str, int]:
        return dict(httpx.get(f"{self.proxy.url}/proxy/stats", timeout=30).json())


def tokens_by_source(metrics: str) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source_total{...,source="x"} 12.0`` lines, summed per source."""
    out: dict[str, float] = {}
    pattern = re.compile(re.escape(SOURCE_METRIC) + r"\{([^}]*)\}\s+([0-9.eE+-]+)")
    for labels, value in pattern.findall(metrics):
        source = re.search(r'source="([^"]+)"', labels)
        if source:
            out[source.group(1)] = out.get(source.group(1), 0.0) + float(value)
    return out
