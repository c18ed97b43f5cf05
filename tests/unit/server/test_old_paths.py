"""The paths a user can name still work after server/ was split by process (issue 38 item 2):
each old module is a shim that hands out the very objects of the new one, and the old
``python -m`` commands still run."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import import_module, metadata

import pytest
from vllm.utils.import_utils import resolve_obj_by_qualname

from tests.unit.test_layers import ROOT

#: old module -> (new module, names that must be the same objects)
SHIMS = {
    "server.engine_scheduler": ("server.engine.scheduler", ("WarmFirstScheduler", "QUALNAME")),
    "server.engine_spin": ("server.engine.spin", ("install", "DEFAULT_SPIN_MS", "ENV_MQ_SPIN_S")),
    "server.inspect": ("server.tools.inspect", ("main", "COMMANDS")),
    "server.model_cache": ("server.launcher.model_cache", ("main", "default_model_dir")),
    "server.process": ("server.launcher.process", ("ServerProcess", "free_port", "ROOT")),
    "server.cluster_auth": ("server.common.cluster_auth", ("ROUTER_PROOF_HEADER", "sign")),
    "server.connector.connector": ("server.connector.engine.connector", ("KVBranchConnector",)),
}


@pytest.mark.parametrize("old", sorted(SHIMS))
def test_an_old_module_hands_out_the_new_ones_objects(old):
    new, names = SHIMS[old]
    old_module, new_module = import_module(old), import_module(new)
    for name in names:
        assert getattr(old_module, name) is getattr(new_module, name), (old, name)


def test_the_old_scheduler_cls_and_the_launchers_own_load_the_warm_first_scheduler():
    """As vLLM loads ``--scheduler-cls``: by qualified name."""
    from server.engine.scheduler import WarmFirstScheduler
    from server.launcher.cli import WARM_FIRST_SCHEDULER

    old = resolve_obj_by_qualname("server.engine_scheduler.WarmFirstScheduler")
    assert old is WarmFirstScheduler
    assert resolve_obj_by_qualname(WARM_FIRST_SCHEDULER) is WarmFirstScheduler


def _entry_point(group: str, name: str) -> str:
    """``name``'s value in pyproject.toml's ``[project.entry-points."group"]`` table (no tomllib
    on Python 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    table = text.split(f'[project.entry-points."{group}"]\n', 1)[1].split("\n[", 1)[0]
    found = re.search(rf'^{re.escape(name)} = "([^"]+)"$', table, re.M)
    assert found, (group, name)
    return found.group(1)


def test_the_entry_points_load_the_new_modules_and_the_installed_ones_still_load():
    from server.engine.spin import install

    spin = _entry_point("vllm.general_plugins", "kvbranch_mq_spin")
    assert spin == "server.engine.spin:install"
    module, _, attr = spin.partition(":")
    assert getattr(import_module(module), attr) is install
    plugin = _entry_point("vllm.endpoint_plugins", "kvbranch")
    module, _, attr = plugin.partition(":")
    assert callable(getattr(import_module(module), attr))
    # What this machine's install registered (an older path until reinstalled) loads too.
    installed = {ep.name: ep for ep in metadata.entry_points(group="vllm.general_plugins")}
    if "kvbranch_mq_spin" in installed:
        assert installed["kvbranch_mq_spin"].load() is install


@pytest.mark.parametrize(
    ("module", "usage"),
    [
        ("server", "usage: python -m server"),
        ("server.inspect", "usage: python -m server.inspect"),
        ("server.model_cache", "usage: python -m server.model_cache"),
    ],
)
def test_the_old_commands_run(module, usage):
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(usage), done.stdout
