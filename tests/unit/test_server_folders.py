"""server/'s folders say where their code runs (issue 38 item 2), and the imports keep it so:
code of one process never imports the code of another, only the process-neutral helpers
(server/common/) they share. Read from the source with ``ast`` (:func:`test_layers.imports_of`):
every import counts, inside functions and under ``TYPE_CHECKING`` alike.

The old paths a user can name (``--scheduler-cls``, the entry points, ``python -m ...``) are
shims at server/'s root; :mod:`tests.unit.server.test_old_paths` checks that they still work.
"""

from __future__ import annotations

from pathlib import Path

from tests.unit.test_layers import ROOT, imports_of

#: Per folder of server/: the prefixes of ``server.*`` it must never import, and the exceptions.
RULES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # vLLM's engine-core process (and the patches every vLLM process installs).
    "engine": (("server.plugin", "server.router", "server.launcher", "server.tools"), ()),
    # The connector runs in the engine core and its workers, like server/engine/.
    "connector": (("server.plugin", "server.router", "server.launcher", "server.tools"), ()),
    # vLLM's API server: talks to the engine core over the control socket only.
    "plugin": (("server.router", "server.engine", "server.launcher", "server.tools"), ()),
    # The P/D router, its own process. Its launch and cluster modules start processes and use
    # the launcher's; of the connector it uses two pure pieces:
    "router": (
        ("server.plugin", "server.engine", "server.connector", "server.tools"),
        (
            # the cluster secret, kept beside the seal it keys (P/D handles) in connector/pd/
            "server.connector.pd.transfer_auth",
            # new_id: the session ids the router makes have the instances' own format
            "server.connector.core.sessions",
        ),
    ),
    # Shared by the router and the plugin (and instances publishing into it).
    "index": (("server.plugin", "server.router", "server.engine", "server.launcher"), ()),
    # Process-neutral: only itself.
    "common": (
        tuple(f"server.{p}" for p in ("plugin", "router", "engine", "launcher", "connector")),
        (),
    ),
    # A terminal client: talks HTTP, imports no server code at all.
    "tools": (("server.",), ()),
}

#: server/'s root holds only the package and the old paths users name (each a shim).
ROOT_MODULES = {
    "__init__.py",
    "__main__.py",  # python -m server
    "engine_scheduler.py",  # --scheduler-cls server.engine_scheduler.WarmFirstScheduler
    "engine_spin.py",  # an installed vllm.general_plugins entry point of an older install
    "inspect.py",  # python -m server.inspect
    "model_cache.py",  # python -m server.model_cache
    "cluster_auth.py",  # for code with uncommitted changes (issue 38 item 2): remove later
    "process.py",  # idem
}


def violations(folder: str, root: Path = ROOT) -> list[str]:
    never, allowed = RULES[folder]
    out = []
    for path in sorted((root / "server" / folder).rglob("*.py")):
        for name in sorted(imports_of(path, root)):
            if not name.startswith(never) or name in allowed:
                continue
            if name.startswith(f"server.{folder}.") or name == f"server.{folder}":
                continue  # its own modules (the "tools" rule forbids every server.*)
            out.append(f"{path.relative_to(root)} imports {name}")
    return out


def test_each_folder_imports_only_what_its_process_may():
    for folder in RULES:
        assert violations(folder) == [], folder


def test_every_folder_says_what_lives_there_and_what_it_may_import():
    for init in sorted((ROOT / "server").glob("*/__init__.py")):
        doc = init.read_text().split('"""')
        assert len(doc) >= 3 and doc[1].strip(), f"{init} has no docstring"


def test_the_root_holds_no_loose_modules():
    loose = {p.name for p in (ROOT / "server").glob("*.py")} - ROOT_MODULES
    assert loose == set(), "put each module in the folder of the process it runs in"


def test_the_root_modules_besides_init_and_main_are_shims():
    for name in sorted(ROOT_MODULES - {"__init__.py", "__main__.py"}):
        text = (ROOT / "server" / name).read_text()
        assert len(text.splitlines()) <= 10 and "import *" in text, name


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_check_sees_the_engine_importing_the_plugin(tmp_path):
    """What the move removed: the scheduler read the priority encoding from the plugin."""
    root = _tree(
        tmp_path,
        {
            "server/__init__.py": "",
            "server/plugin/__init__.py": "",
            "server/plugin/priority.py": "",
            "server/engine/__init__.py": "",
            "server/engine/scheduler.py": "def f():\n    from server.plugin.priority import x\n",
        },
    )
    assert violations("engine", root) == [
        "server/engine/scheduler.py imports server.plugin.priority"
    ]


def test_the_check_allows_the_router_only_the_named_connector_pieces(tmp_path):
    root = _tree(
        tmp_path,
        {
            "server/__init__.py": "",
            "server/connector/__init__.py": "",
            "server/connector/pd/__init__.py": "",
            "server/connector/pd/transfer_auth.py": "",
            "server/connector/pd/connector.py": "",
            "server/router/pool.py": (
                "from server.connector.pd.transfer_auth import load_cluster_secret\n"
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from server.connector.pd import connector\n"
            ),
        },
    )
    assert violations("router", root) == [
        "server/router/pool.py imports server.connector.pd.connector"
    ]
