"""Engine core, scheduler role: the connector's pure logic (the router borrows ``new_id``).
Imports only itself and the standard library: no vLLM, nothing else of the server.

The connector's pure logic: no vLLM import (``tests/unit/server/connector/test_layers.py``).

* ``planner``     — load/save planning, the step's metadata, prompt-source accounting
* ``block_index`` — hash → host slot map, LRU, pin refcounts (full blocks and tails)
* ``sessions``    — sessions, branches, forks, quotas; ``leases``: TTL pins in a budget;
  ``branches``: the nouns and errors they share
* ``tails``       — token-exact reuse: keys and rules for a finished request's partial block
* ``metadata``    — what the scheduler side tells the worker side each step
* ``kv_groups``   — which KV cache groups the host store serves (the model families)
"""
