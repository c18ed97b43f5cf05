"""Engine core (server side of the socket) and API server (its clients): the control socket.
May import the connector's core and server.engine's counters; never the plugin or the router.

The engine-side control socket the HTTP routes talk to.

* ``transport`` — the socket server, the sync and async typed clients, the socket path
* ``models``    — each op's request and answer model
* ``ops``       — the op registry (name → request model, answer model, handler), the dispatcher
"""
