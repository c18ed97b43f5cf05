"""The kvbranch KV connector (vLLM ``KVConnectorBase_V1``) and its pure parts.

* ``connector``   — the class vLLM loads (``kv_connector_module_path``), both roles
* ``planner``     — scheduler side: load/save planning and prompt-source accounting
* ``block_index`` — hash → host slot map, LRU, pin refcounts
* ``sessions``    — sessions, branches, TTL pins in a budget, forks
* ``host_pool``   — worker side: host tensors and block copies (CPU and CUDA)
* ``control``     — the engine-side control socket the HTTP routes talk to
"""
