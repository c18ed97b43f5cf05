"""The one installer both engine plugins use (:mod:`server.engine.patch`), on a stand-in class
(the plugins' own tests run it on vLLM's real classes)."""

from __future__ import annotations

import sys
import types

import pytest

from server.engine import idle as engine_idle
from server.engine import patch as engine_patch
from server.engine import spin as engine_spin


class Target:
    def step(self, x: int) -> int:
        """The original's docs."""
        return x + 1

    def helper(self) -> None:
        pass


def _wrap(original, seconds):
    def step(self, x):
        return original(self, x) * 100 + int(seconds() * 10)

    return step


@pytest.fixture
def module(monkeypatch):
    mod = types.ModuleType("fake_vllm_mod")
    cls = type("Target", (Target,), {})
    mod.Target = cls
    monkeypatch.setitem(sys.modules, "fake_vllm_mod", mod)
    return cls


def _install(seconds, needs="helper"):
    patch = engine_patch.MethodPatch("fake_vllm_mod.Target.step", needs=needs, what="x")
    return engine_patch.install_patch(patch, seconds=seconds, wrap=_wrap)


def test_wraps_once_keeps_the_docs_and_reads_the_latest_value(module):
    assert _install(0.5)
    first = module.step
    assert module().step(1) == 205
    assert module.step.__doc__ == "The original's docs."
    assert _install(0.3)
    assert module.step is first
    assert module().step(1) == 203


def test_no_value_or_another_shape_leaves_the_class(module):
    before = module.step
    assert not _install(None)
    assert not _install(0.5, needs="missing")
    assert module.step is before


def test_no_module_or_class_is_logged_not_raised(caplog):
    caplog.set_level("INFO", logger="kvbranch.engine_patch")
    for method in ("no_such_mod_xyz.Cls.m", "sys.NoSuchClass.m"):
        patch = engine_patch.MethodPatch(method, needs="n", what="x")
        assert not engine_patch.install_patch(patch, seconds=1.0, wrap=_wrap)
    assert "no vLLM Cls here; x unchanged" in caplog.text


def test_both_plugins_use_it():
    assert engine_idle.seconds_from_env is engine_patch.seconds_from_env
    for plugin in (engine_idle, engine_spin):
        assert plugin.install_patch is engine_patch.install_patch
