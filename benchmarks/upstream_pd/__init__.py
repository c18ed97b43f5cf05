"""vLLM's own bidirectional P/D, run as a user would run it, for the benchmarks to compare
kvbranch P/D against ("upstream P/D"): two plain vLLM 0.32 instances with vLLM's
``NixlConnector`` (``bidirectional_kv_xfer``) and a minimal proxy of ours that carries D's
params to the next turn's P. Only the CPU-host fixes named in
:mod:`benchmarks.upstream_pd.instance` differ from upstream (docs/pd.md, "The upstream
baseline").

* :mod:`~benchmarks.upstream_pd.cluster` — start and stop P, D and the proxy;
* :mod:`~benchmarks.upstream_pd.instance` — one plain vLLM instance;
* :mod:`~benchmarks.upstream_pd.cpu_host` — the connector's two thread fixes;
* :mod:`~benchmarks.upstream_pd.stream_params` — D's params in the streamed usage chunk;
* :mod:`~benchmarks.upstream_pd.proxy` and :mod:`~benchmarks.upstream_pd.carry` — the proxy.
"""

from benchmarks.upstream_pd.cluster import UpstreamPD

__all__ = ["UpstreamPD"]
