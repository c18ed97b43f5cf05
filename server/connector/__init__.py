"""The KV connector: runs in vLLM's engine-core process (scheduler role) and its workers (worker
role). May import server.common, server.engine and vLLM; never the plugin, router or launcher.

The kvbranch KV connector (vLLM ``KVConnectorBase_V1``), in layers.

* ``core/``    — pure logic, no vLLM import: planner, block index, sessions, branches, leases,
  tails, the step's metadata
* ``engine/``  — the engine adapters: the connector facade vLLM loads, scheduler side, worker
  side, host pool, stats, step trace
* ``control/`` — the engine-side control socket the HTTP routes talk to: transport, op
  models, op registry
* ``pd/``      — P/D: NIXL composed with this connector, split by job (composition, verified
  NIXL child, sealed handles, params, holds, read bounds)

``config`` — the typed ``kv_connector_extra_config`` of each connector (``ConnectorConfig``,
``NixlChildConfig``): every key our code reads and its default, written once.

``vllm_compat`` — the one module here that imports vLLM (and touches its private attributes);
the pin, ``vllm==0.32.0``, is checked there at import.

Shims (module paths users' configs and our launcher name; re-exports only):
``connector`` (``kv_connector_module_path``: ``KVBranchConnector``), ``pd`` (the package,
``KVBranchPDConnector``), ``transfer_auth`` (→ ``pd/transfer_auth``).
"""
