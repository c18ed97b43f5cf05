"""The kvbranch KV connector (vLLM ``KVConnectorBase_V1``) and its pure parts.

* ``connector``      — the class vLLM loads (``kv_connector_module_path``): a facade that
  delegates each hook to the object of its role
* ``scheduler_side`` — scheduler role: planner, control socket; ``control_ops``: its op
  registry (name → request model, answer model, handler) and the dispatcher
* ``worker_side``    — worker role: runs the planned copies, reports finished tail copies
* ``planner``        — load/save planning, the step's metadata, prompt-source accounting
* ``tails``          — token-exact reuse: keys and rules for a finished request's partial block
* ``block_index``    — hash → host slot map, LRU, pin refcounts (full blocks and tails)
* ``sessions``       — sessions, branches, forks, quotas; ``leases``: TTL pins in a budget;
  ``branches``: the nouns and errors they share
* ``host_pool``      — worker side: host tensors and block copies (CPU and CUDA)
* ``control``        — the engine-side control socket the HTTP routes talk to (the transport,
  and the typed client); ``control_models``: each op's request and answer model
* ``pd``, ``transfer_auth`` — P/D: NIXL composed with this connector, sealed handles
"""
