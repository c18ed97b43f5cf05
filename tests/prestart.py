"""The test session's servers, launched before their first test asks for them, and stopped
after their last.

Why: an engine start is a few single-threaded Python imports of vLLM and torch (25-50 s on CI's
2 cores); started when their first test asks, the servers came up one after the other, each on
the critical path, while the other core idled. Now:

* the session's shared servers (kvbranch, plain vLLM, the keyed server, the keyed P/D pair)
  launch at the end of collection, all at once, on the other core while the unit tests run
  (pure logic, about two minutes on one core) — :func:`plan`;
* a module's own servers (``scope="module"``: test_models' pair, test_pd's instances, the
  cluster, ...) launch while a module before them runs, as soon as the engines then alive stay
  within :data:`ENGINE_BUDGET` — :func:`launch_ahead`;
* every one of them is *released* (stopped) right after the last collected test that uses it —
  :func:`release_after` — so its memory goes to the servers started after it.

Memory is the other budget: an engine is about 2.6 GiB (PSS) and CI has 24 GB; five engines
kept to the end of the session plus the index-backed cluster's four did not fit (the kernel
killed the kvbranch server's worker in a local run). So the integration modules run grouped by
the shared servers they use (tests/conftest.py), each group's servers released after it, and
the modules marked ``alone`` (the cluster) last. A server no collected test uses is never
started.

:func:`fixture` makes such a fixture: it takes its servers with :func:`take` (launched already,
or now — e.g. under ``--collect-only``, or when the budget said wait) and wraps them in
:func:`running`, which awaits each and stops them all at the end of the scope. A fixture with
more to do than wait (the cluster) registers its factory with :func:`register` and calls
:func:`take`, :func:`running` and :func:`held` itself. A "process" is anything with
``launch()``, ``wait_ready()`` and ``stop()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

#: A fixture's processes, constructed but not launched.
Factory = Callable[[], tuple[Any, ...]]

#: Engines (about 2.6 GiB PSS each) that may be alive when a module's servers launch ahead.
ENGINE_BUDGET = 6


@dataclass(frozen=True)
class Shared:
    factory: Factory
    scope: str
    #: vLLM engines among the processes (routers and Redis count for nothing); checked against
    #: the processes when they launch (:func:`_launch`), so a budget cannot be fooled by a count
    #: left at its default
    engines: int


_shared: dict[str, Shared] = {}
_launched: dict[str, tuple[Any, ...]] = {}
#: Servers a fixture holds now (taken and ready), by fixture name, until released.
_held: dict[str, tuple[Any, ...]] = {}
#: The node id of the last collected test that uses each fixture.
_last_user: dict[str, str] = {}
#: module node id -> for each module after it, in order, the module-scoped fixtures it uses
#: first
_ahead: dict[str, list[list[str]]] = {}
_modules_started: set[str] = set()


def register(fixture_name: str, factory: Factory, *, scope: str = "module", engines: int = 1):
    """Name ``factory`` as what fixture ``fixture_name`` serves, for launching ahead."""
    _shared[fixture_name] = Shared(factory, scope, engines)


def fixture(
    fixture_name: str, factory: Factory, *, scope: str = "session", engines: int = 1
) -> Any:
    """A pytest fixture named ``fixture_name`` over ``factory``'s processes, launched ahead of
    its first test (:func:`plan`, :func:`launch_ahead`); it yields the process (or the tuple of
    them when there are several), each ready, and stops them at the end of its scope or after
    its last test, whichever comes first."""
    register(fixture_name, factory, scope=scope, engines=engines)

    @pytest.fixture(scope=scope, name=fixture_name)
    def servers() -> Iterator[Any]:
        with running(take(fixture_name)) as procs, held(fixture_name, procs):
            yield procs[0] if len(procs) == 1 else procs

    return servers


def _engine_count(proc: Any) -> int:
    """vLLM engines in one process of a factory: a server process is one unless it is a
    router; an object that holds several (the cluster) says so with ``engines``."""
    if hasattr(proc, "engines"):
        return int(proc.engines)
    args = getattr(proc, "args", [])
    return 0 if "--role" in args and args[args.index("--role") + 1] == "router" else 1


def _launch(fixture_name: str) -> tuple[Any, ...]:
    shared = _shared[fixture_name]
    procs = shared.factory()
    counted = sum(_engine_count(proc) for proc in procs)
    if counted != shared.engines:
        raise ValueError(
            f"{fixture_name}: declared {shared.engines} engine(s), its processes hold {counted}"
            " (prestart.fixture(..., engines=N): the memory budget counts them)"
        )
    for proc in procs:
        proc.launch()
    return procs


def module_of(item: Any) -> str:
    """The node id of the module ``item`` belongs to."""
    return item.nodeid.split("::")[0]


def plan(items: Iterable[Any]) -> None:
    """For the collected ``items`` in their final order: launch the session's (and packages')
    shared servers now, note which module's servers launch ahead during which module, and the
    last test that uses each fixture, after which :func:`release_after` stops it."""
    _last_user.clear()
    _ahead.clear()
    _modules_started.clear()
    first_module: dict[str, str] = {}
    modules: list[str] = []
    for item in items:
        module = module_of(item)
        if not modules or modules[-1] != module:
            modules.append(module)
        for name in item.fixturenames:
            _last_user[name] = item.nodeid
            first_module.setdefault(name, module)
    module_scoped = [n for n in first_module if n in _shared and _shared[n].scope == "module"]
    for i, before in enumerate(modules):
        _ahead[before] = [
            [n for n in module_scoped if first_module[n] == module] for module in modules[i + 1 :]
        ]
    launch_for(n for n in first_module if n in _shared and _shared[n].scope != "module")


def _engines_alive() -> int:
    return sum(_shared[n].engines for n in (*_launched, *_held) if n in _shared)


def launch_ahead(item: Any) -> None:
    """Once the first test of a module is set up (its own servers up), launch the own servers
    of the modules after it, in order, while they fit in :data:`ENGINE_BUDGET` beside those
    alive (the first that does not fit waits, and so do those after it: a module of one short
    test hides little of a start-up, so the budget, not the distance, is the limit)."""
    module = module_of(item)
    if module in _modules_started:
        return
    _modules_started.add(module)
    for names in _ahead.get(module, []):
        wanted = [n for n in names if n not in _launched and n not in _held]
        if _engines_alive() + sum(_shared[n].engines for n in wanted) > ENGINE_BUDGET:
            return  # nor the module after it: each module's servers come up in order
        launch_for(wanted)


def launch_for(fixture_names: Iterable[str]) -> None:
    """Launch (without waiting) the registered servers among ``fixture_names``."""
    for name in sorted({n for n in fixture_names if n in _shared and n not in _launched}):
        _launched[name] = _launch(name)


def take(fixture_name: str) -> tuple[Any, ...]:
    """The fixture's processes: those launched ahead, or launched now."""
    procs = _launched.pop(fixture_name, None)
    return procs if procs is not None else _launch(fixture_name)


@contextmanager
def held(fixture_name: str, procs: tuple[Any, ...]) -> Iterator[None]:
    """``procs`` are what ``fixture_name`` serves until its scope ends or :func:`release_after`
    stops them early (stopping twice is harmless)."""
    _held[fixture_name] = procs
    try:
        yield
    finally:
        _held.pop(fixture_name, None)


def release_after(item: Any) -> None:
    """Stop the servers whose last collected user is ``item`` (it has just been torn down): a
    test that comes later cannot ask for them, and their memory goes to the servers it starts."""
    for name, nodeid in _last_user.items():
        if nodeid == item.nodeid:
            for proc in _held.pop(name, ()):
                proc.stop()


@contextmanager
def running(procs: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    """Each process ready (its own start-up error raised here), all stopped on exit."""
    try:
        for proc in procs:
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def stop_untaken() -> None:
    """Stop what was launched for a test that never ran (a failure under ``-x``, a deselection
    after collection, an interrupted session)."""
    while _launched:
        _, procs = _launched.popitem()
        for proc in procs:
            proc.stop()
