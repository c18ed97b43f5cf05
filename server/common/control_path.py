"""Where the connector's control socket lives when the kv-transfer-config names none.

Why: ``python -m server`` makes a fresh private directory per server and writes its socket's
path into ``kv_connector_extra_config`` (``control_socket``) and the plugin's environment.
Started by vLLM's own CLI (``vllm serve``, docs/vllm-serve.md) nobody does that, yet the engine
core (which binds the socket) and the API server's plugin (which connects to it) must agree on a
path without talking to each other. What both processes see is the kv-transfer-config, and in it
the ``engine_id`` vLLM gives every server (a fresh UUID unless the user sets one): the socket is
named after a digest of it, in one private directory per user.

The directory is ``$XDG_RUNTIME_DIR/kvbranch`` (systemd's per-user runtime directory, mode 0700)
when that exists, else ``<tmp>/kvbranch-<uid>``; made with mode 0700 when missing. The control
server refuses to bind in a directory that is not a real directory owned by this user without
group or other permissions (``server.connector.control.transport.check_private_dir``), and the
plugin checks the same before connecting: a directory another user made first stops the server
with that message instead of handing session ops to them.

Standard library only: the engine core and the plugin both import it.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile

#: vLLM appends ``_dp<rank>`` to the engine id in each data-parallel engine core; the socket of
#: rank ``r`` is the first one's path with ``.r`` before its suffix (``engine_socket_path``).
_DP_SUFFIX = re.compile(r"_dp\d+$")
_DIGEST_CHARS = 24


def runtime_dir() -> str:
    """This user's private directory for control sockets (not created here); systemd's
    runtime directory only where it exists (a shell after ``su`` can name one that does not)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR", "").strip()
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        return os.path.join(xdg, "kvbranch")
    return os.path.join(tempfile.gettempdir(), f"kvbranch-{os.getuid()}")


def default_control_socket(engine_id: str, *, create: bool = False) -> str:
    """The control socket of the server whose kv-transfer-config has this ``engine_id`` (a
    data-parallel rank's suffixed id gives the same path). ``create``: make the directory with
    mode 0700 if it is missing (the engine core does; the plugin only reads)."""
    if not engine_id:
        raise ValueError("the kv-transfer-config has no engine_id")
    base = _DP_SUFFIX.sub("", engine_id)
    digest = hashlib.sha256(b"kvbranch-control\0" + base.encode()).hexdigest()[:_DIGEST_CHARS]
    folder = runtime_dir()
    if create:
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass  # the control server checks that it is private before binding
    return os.path.join(folder, f"control-{digest}.sock")
