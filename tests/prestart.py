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

import json
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

#: A fixture's processes, constructed but not launched.
Factory = Callable[[], tuple[Any, ...]]

#: Engines (about 2.6 GiB PSS each) that may be alive on the machine, every lane's together,
#: when a module's servers launch ahead or a fixture launches its own (24 GB: seven leave ~3 GB).
ENGINE_BUDGET = 7
#: How long a fixture waits for another lane to release engines before it launches anyway.
ROOM_WAIT_S = 900.0
#: vLLM's OpenMP binding, set to a lane's cores while another lane holds engines.
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


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


@dataclass
class Lane:
    """This process's place among the run's lanes (pytest-xdist workers, tests/conftest.py):
    ``directory`` holds one small file per lane with the engines it holds, so that every lane
    counts the machine's engines against one :data:`ENGINE_BUDGET`; ``cores`` is this lane's
    CPU list for :data:`BIND_ENV` (None: the user chose a binding, left alone)."""

    directory: Path
    name: str
    cores: str | None = None
    planned: bool = False


_lane: Lane | None = None


@dataclass
class _Progress:
    #: the node id of this lane's last planned test; once it is torn down the lane is done
    last: str = ""
    done: bool = False


_progress = _Progress()


def join_lane(directory: Path, name: str) -> None:
    """Count engines with the other lanes in ``directory`` from now on (a lane plans its
    servers at its first test: :func:`lane_unplanned`, :func:`bind_lane`, :func:`plan`)."""
    global _lane
    directory.mkdir(parents=True, exist_ok=True)
    _lane = Lane(directory, name)
    _publish()


def lane_unplanned() -> bool:
    return _lane is not None and not _lane.planned


def bind_lane(cores: str | None) -> None:
    """Bind this lane's servers to ``cores`` (their launches inherit the environment) while
    another lane has tests to run (:func:`_binding`); None leaves vLLM's binding alone."""
    assert _lane is not None
    _lane.cores, _lane.planned = cores, True
    if cores is not None:
        os.environ[BIND_ENV] = cores


def leave_lane() -> None:
    global _lane
    if _lane is not None:
        (_lane.directory / _lane.name).unlink(missing_ok=True)
        try:
            _lane.directory.rmdir()  # the last lane out
        except OSError:
            pass
        _lane = None


def _own_engines() -> int:
    return sum(_shared[n].engines for n in {*_launched, *_held} if n in _shared)


def _publish(*, waiting: bool = False) -> None:
    if _lane is None:
        return
    path = _lane.directory / _lane.name
    tmp = path.with_suffix(".tmp")
    state = {"engines": _own_engines(), "waiting": waiting, "done": _progress.done}
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def _peers() -> dict[str, dict[str, Any]]:
    """The other lanes' last published state, by lane name (a file being replaced is skipped:
    read again at the next look)."""
    if _lane is None:
        return {}
    states = {}
    for path in _lane.directory.iterdir():
        if path.name == _lane.name or path.suffix == ".tmp":
            continue
        try:
            states[path.name] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return states


def _engines_alive() -> int:
    return _own_engines() + sum(int(p.get("engines", 0)) for p in _peers().values())


def _wait_for_room(engines: int) -> None:
    """Block until ``engines`` more fit in :data:`ENGINE_BUDGET` beside every lane's. Another
    lane's engines go when its tests are done with them; when two lanes wait for each other,
    the one whose name sorts first goes ahead; past :data:`ROOM_WAIT_S` it goes anyway."""
    deadline = time.monotonic() + ROOM_WAIT_S
    while _lane is not None and _engines_alive() + engines > ENGINE_BUDGET:
        peers = _peers()
        if not any(int(p.get("engines", 0)) for p in peers.values()):
            break  # nothing to wait for: this lane alone is over the budget
        waiting = [name for name, p in peers.items() if p.get("waiting")]
        if waiting and all(_lane.name < name for name in waiting):
            break  # both wait for the other: the first name goes
        if time.monotonic() > deadline:
            warnings.warn(
                f"prestart: launching past the engine budget after {ROOM_WAIT_S}s", stacklevel=2
            )
            break
        _publish(waiting=True)
        time.sleep(1.0)
    _publish()


@contextmanager
def _binding() -> Iterator[None]:
    """This lane's binding while another lane has tests to run; vLLM's own choice (all cores)
    once this lane is alone (the cluster after the kvbranch lane is done)."""
    alone = (
        _lane is not None
        and _lane.cores is not None
        and all(p.get("done") for p in _peers().values())
    )
    if not alone:
        yield
        return
    cores = os.environ.pop(BIND_ENV, None)
    try:
        yield
    finally:
        if cores is not None:
            os.environ[BIND_ENV] = cores


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
        procs = take(fixture_name)
        with held(fixture_name, procs), running(procs):
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
    with _binding():  # the factory may read it too (P/D instances name their cores)
        procs = shared.factory()
        counted = sum(_engine_count(proc) for proc in procs)
        if counted != shared.engines:
            raise ValueError(
                f"{fixture_name}: declared {shared.engines} engine(s), its processes hold"
                f" {counted} (prestart.fixture(..., engines=N): the memory budget counts them)"
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
    _progress.done = False
    first_module: dict[str, str] = {}
    modules: list[str] = []
    for item in items:
        _progress.last = item.nodeid
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
        _publish()


def take(fixture_name: str) -> tuple[Any, ...]:
    """The fixture's processes: those launched ahead, or launched now (once they fit in the
    budget beside the other lanes'), counted as held from here on (:func:`held` ends that)."""
    procs = _launched.pop(fixture_name, None)
    if procs is None:
        if fixture_name in _shared:
            _wait_for_room(_shared[fixture_name].engines)
        procs = _launch(fixture_name)
    _held[fixture_name] = procs
    _publish()
    return procs


@contextmanager
def held(fixture_name: str, procs: tuple[Any, ...]) -> Iterator[None]:
    """``procs`` are what ``fixture_name`` serves until its scope ends or :func:`release_after`
    stops them early (stopping twice is harmless)."""
    _held[fixture_name] = procs
    try:
        yield
    finally:
        _held.pop(fixture_name, None)
        _publish()


def release_after(item: Any) -> None:
    """Stop the servers whose last collected user is ``item`` (it has just been torn down): a
    test that comes later cannot ask for them, and their memory goes to the servers it starts."""
    for name, nodeid in _last_user.items():
        if nodeid == item.nodeid:
            for proc in _held.pop(name, ()):
                proc.stop()
            _publish()
    if item.nodeid == _progress.last:
        _progress.done = True
        _publish()


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
    _publish()
