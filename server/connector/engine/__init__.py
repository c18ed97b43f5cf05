"""Engine core and its workers: the adapters vLLM calls, one object per role.
May import the rest of server.connector, server.common and server.engine; never the plugin.

The engine adapters: what vLLM calls.

* ``connector``      — ``KVBranchConnector`` (vLLM ``KVConnectorBase_V1``): a facade that
  delegates each hook to the object of its role
* ``scheduler_side`` — scheduler role: planner, control socket, op table
* ``worker_side``    — worker role: runs the planned copies, reports finished tail copies
* ``host_pool``      — worker side: host tensors and block copies (CPU and CUDA)
* ``stats``          — transfer stats and Prometheus metrics (vLLM's connector metrics API)
* ``step_trace``     — the optional per-step JSONL trace
"""
