"""The test session's servers, launched before their first test asks for them, and stopped
after their last.

Why: an engine start is a few single-threaded Python imports of vLLM and torch (25-50 s on CI's
2 cores); started when their first test asks, the servers came up one after the other, each on
the critical path. Now:

* the shared servers of a lane (tests/lanes.py; the whole run when it is one process) — kvbranch,
  plain vLLM, the keyed server, the keyed P/D pair — launch when the lane gets its first test,
  in order as they fit in :data:`ENGINE_BUDGET` — :func:`plan`;
* a module's own servers (``scope="module"``: test_models' pair, test_pd's instances, the
  cluster, ...) launch while a module before them runs, as soon as they fit —
  :func:`launch_ahead`; so do those of a session fixture registered with ``ahead=True``, ahead
  of the first module that uses it (a cluster that adjacent modules share: the aggregated
  replicas);
* every one of them is *released* (stopped) right after the last test of the lane that uses
  it — :func:`release_after` — so its memory goes to the servers started after it;
* a server registered with ``borrow`` (the plain vLLM reference) runs once per run: the lane
  that launches it serves it to the other until neither needs it.

Memory is the budget that binds: a server with its engine is 2.6-3 GiB and CI has 24 GB. The
lanes count their engines together through one file each in the run's lanes directory
(:func:`join_lane`); the integration modules run grouped by the shared servers they use
(tests/conftest.py), each group's servers released after it, and the modules marked ``alone``
(the cluster) last. A server no collected test uses is never started.

:func:`fixture` makes such a fixture: it takes its servers with :func:`take` (launched already,
or now — e.g. under ``--collect-only``, or when the budget said wait), awaits each and stops
them at the end of the scope. A fixture with more to do than wait (the cluster) registers its
factory with :func:`register` and calls :func:`take` and :func:`held` itself. A "process" is
anything with ``launch()``, ``wait_ready()`` and ``stop()``.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import pytest
from typing_extensions import Unpack

#: A fixture's processes, constructed but not launched.
Factory = Callable[[], tuple[Any, ...]]
#: A stand-in for a server another lane runs, from its URL: the same interface, launch and stop
#: doing nothing.
Borrow = Callable[[str], Any]

#: Engines (a server with its engine is 2.6-3 GiB) alive on the machine at once, every lane's
#: together (24 GB: seven left 110 MB and the kernel killed a worker; six, 1.6 GB).
ENGINE_BUDGET = 5
#: How long a fixture waits for another lane to release engines before it launches anyway.
ROOM_WAIT_S = 900.0
#: vLLM's OpenMP binding, set to a lane's cores while another lane has tests left.
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


@dataclass(frozen=True)
class Shared:
    factory: Factory
    scope: str
    #: vLLM engines among the processes (routers and Redis count for nothing); checked against
    #: the processes when they launch (:func:`_launch`), so a budget cannot be fooled by a count
    #: left at its default
    engines: int
    #: one per run: a lane borrows it from the lane that launched it (the reference server)
    borrow: Borrow | None = None
    #: launched ahead of the first module that uses it (:func:`launch_ahead`), not when the
    #: lane starts (:func:`plan`): a module's own servers, and a session's that only some
    #: adjacent modules share
    ahead: bool = False


_shared: dict[str, Shared] = {}
_launched: dict[str, tuple[Any, ...]] = {}
#: Servers a fixture holds now (taken and ready), by fixture name, until released.
_held: dict[str, tuple[Any, ...]] = {}
#: The node id of the last collected test that uses each fixture.
_last_user: dict[str, str] = {}
#: module node id -> for each module after it, in order, the fixtures launched ahead that it uses
#: first
_ahead: dict[str, list[list[str]]] = {}
_modules_started: set[str] = set()
#: Session-wide servers that did not fit when the lane planned: launched in order once they do.
_pending: list[str] = []
#: One-per-run servers this lane launched and runs, until no lane needs them.
_serving: dict[str, tuple[Any, ...]] = {}
#: One-per-run servers this lane runs on another lane's.
_borrowed: set[str] = set()
#: Engines a test launches itself, by what it said they are for (:func:`reserved`).
_reserved: dict[str, int] = {}


@dataclass
class Lane:
    """This process's place among the run's lanes (pytest-xdist workers, tests/lanes.py):
    ``directory`` holds one small file per lane — the engines it holds, whether it waits for
    room, whether its tests are done, the one-per-run servers it serves (by URL) and those it
    still needs — so that every lane counts the machine's engines against one
    :data:`ENGINE_BUDGET`, and one reference server serves them all; ``cores`` is this lane's
    CPU list for :data:`BIND_ENV` (None: vLLM's or the user's binding, left alone)."""

    directory: Path
    name: str
    cores: str | None = None
    planned: bool = False


@dataclass
class _Progress:
    #: the node id of this lane's last planned test; once it is torn down the lane is done
    last: str = ""
    done: bool = False
    #: one-per-run servers this lane's tests still need
    needs: set[str] = field(default_factory=set)


_lane: Lane | None = None
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
    another lane has tests to run (:func:`_binding`); None leaves the binding alone."""
    assert _lane is not None
    _lane.cores, _lane.planned = cores, True
    if cores is not None:
        os.environ[BIND_ENV] = cores


def leave_lane() -> None:
    global _lane
    if _lane is not None:
        (_lane.directory / _lane.name).unlink(missing_ok=True)
        if not _peers():  # the last lane out
            (_lane.directory / ".lock").unlink(missing_ok=True)
            try:
                _lane.directory.rmdir()
            except OSError:
                pass
        _lane = None


def _own_engines() -> int:
    names = ({*_launched, *_held} - _borrowed) | set(_serving)
    return sum(_shared[n].engines for n in names if n in _shared) + sum(_reserved.values())


def _publish(*, waiting: bool = False) -> None:
    if _lane is None:
        return
    state = {
        "engines": _own_engines(),
        "waiting": waiting,
        "done": _progress.done,
        "serves": {name: procs[0].url for name, procs in _serving.items()},
        "needs": sorted(_progress.needs),
        "pid": os.getpid(),
    }
    path = _lane.directory / _lane.name
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def _peers() -> dict[str, dict[str, Any]]:
    """The other lanes' last published state, by lane name (a file being replaced is skipped:
    read again at the next look)."""
    if _lane is None:
        return {}
    states = {}
    for path in _lane.directory.iterdir():
        if path.name == _lane.name or path.suffix == ".tmp" or path.name.startswith("."):
            continue
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _alive(state.get("pid")):  # a lane that died holds nothing and needs nothing
            states[path.name] = state
    return states


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return True  # no pid published: taken at its word
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _engines_alive() -> int:
    return _own_engines() + sum(int(p.get("engines", 0)) for p in _peers().values())


@contextmanager
def _room() -> Iterator[None]:
    """One lane at a time looks at the engines alive and launches: two lanes planning at once
    would each count the other's engines before they were published."""
    if _lane is None:
        yield
        return
    with open(_lane.directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _wanted(names: Iterable[str]) -> int:
    """The engines launching ``names`` adds (none for a server borrowed from another lane)."""
    return sum(_shared[n].engines for n in names if n not in _borrowed)


def _fits(engines: int) -> bool:
    """Whether ``engines`` more stay within :data:`ENGINE_BUDGET` beside every lane's."""
    return _engines_alive() + engines <= ENGINE_BUDGET


def _must_wait(engines: int) -> bool:
    """Whether ``engines`` more wait for another lane's to go: not when they fit, nor when
    no other lane holds any (this lane alone is over the budget), nor when both lanes wait
    for each other (the first lane by name goes)."""
    if _lane is None or _fits(engines):
        return False
    peers = _peers()
    if not any(int(p.get("engines", 0)) for p in peers.values()):
        return False
    waiting = [lane for lane, p in peers.items() if p.get("waiting")]
    return not (waiting and all(_lane.name < lane for lane in waiting))


def _when_room(engines: int, then: Callable[[], Any]) -> Any:
    """``then()`` (under :func:`_room`) once ``engines`` more fit beside every lane's
    (:func:`_must_wait`), or after :data:`ROOM_WAIT_S` with a warning."""
    deadline = time.monotonic() + ROOM_WAIT_S
    while True:
        with _room():
            if not _must_wait(engines):
                return then()
            if time.monotonic() > deadline:
                warnings.warn(
                    f"prestart: launching past the engine budget after {ROOM_WAIT_S}s",
                    stacklevel=3,
                )
                return then()
            _publish(waiting=True)
        time.sleep(1.0)


def lanes_bound() -> bool:
    """Whether this lane binds its servers to its own cores (:func:`bind_lane`)."""
    return _lane is not None and _lane.cores is not None


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


class Sizing(TypedDict, total=False):
    """What :func:`register` and :func:`fixture` both take besides the scope: the vLLM engines
    among the processes (1 unless said; see :class:`Shared`), for a one-per-run server how
    another lane borrows it, and whether it launches ahead of its first module (a module's
    servers do; a session's only when said)."""

    engines: int
    borrow: Borrow | None
    ahead: bool


def register(
    fixture_name: str, factory: Factory, *, scope: str = "module", **sizing: Unpack[Sizing]
) -> None:
    """Name ``factory`` as what fixture ``fixture_name`` serves, for launching ahead."""
    engines, borrow = sizing.get("engines", 1), sizing.get("borrow")
    ahead = sizing.get("ahead", scope == "module")
    _shared[fixture_name] = Shared(factory, scope, engines, borrow, ahead)


def fixture(
    fixture_name: str, factory: Factory, *, scope: str = "session", **sizing: Unpack[Sizing]
) -> Any:
    """A pytest fixture named ``fixture_name`` over ``factory``'s processes, launched ahead of
    its first test (:func:`plan`, :func:`launch_ahead`); it yields the process (or the tuple of
    them when there are several), each ready, and stops them at the end of its scope or after
    its last test, whichever comes first. With ``borrow`` (a session server), one runs per
    run: a lane uses ``borrow(url)`` of the one another lane launched."""
    register(fixture_name, factory, scope=scope, **sizing)

    @pytest.fixture(scope=scope, name=fixture_name)
    def servers() -> Iterator[Any]:
        procs = take(fixture_name)
        with held(fixture_name, procs):
            try:
                for proc in procs:
                    proc.wait_ready()
                yield procs[0] if len(procs) == 1 else procs
            finally:
                # not waiting here for another lane that still needs it: the other servers
                # of this scope stop after this one (tests.conftest waits at the session's end)
                _stop(fixture_name, procs)

    return servers


def _engine_count(proc: Any) -> int:
    """vLLM engines in one process of a factory: a server process is one unless it is a
    router; an object that holds several (the cluster) says so with ``engines``."""
    if hasattr(proc, "engines"):
        return int(proc.engines)
    args = getattr(proc, "args", [])
    return 0 if "--role" in args and args[args.index("--role") + 1] == "router" else 1


def _launch(fixture_name: str) -> tuple[Any, ...]:
    """Launch ``fixture_name``'s processes — or, for a one-per-run server another lane serves,
    borrow it (called in :func:`_room`)."""
    shared = _shared[fixture_name]
    if shared.borrow is not None:
        for peer in _peers().values():
            url = peer.get("serves", {}).get(fixture_name)
            if url:
                _borrowed.add(fixture_name)
                return (shared.borrow(url),)
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
    if shared.borrow is not None and _lane is not None:
        _serving[fixture_name] = procs
    return procs


def _stop(fixture_name: str, procs: tuple[Any, ...], *, wait: bool = False) -> None:
    """Stop ``procs`` — unless they are borrowed, or this lane serves them and another lane
    still needs them: then they stop once none does (``wait``: block until then; else a later
    :func:`release_after` or the fixture's own end stops them)."""
    _progress.needs.discard(fixture_name)
    if fixture_name in _borrowed:
        _publish()
        return
    if fixture_name in _serving:
        while any(fixture_name in p.get("needs", ()) for p in _peers().values()):
            if not wait:
                _publish()
                return
            time.sleep(1.0)
        _serving.pop(fixture_name, None)
    for proc in procs:
        proc.stop()
    _publish()


def module_of(item: Any) -> str:
    """The node id of the module ``item`` belongs to."""
    return item.nodeid.split("::")[0]


def is_integration(item: Any) -> bool:
    """Whether ``item`` is under tests/integration (starts real servers)."""
    return "tests/integration" in str(item.fspath).replace("\\", "/")


def plan(items: Iterable[Any]) -> None:
    """For the collected ``items`` in their final order: launch the session's (and packages')
    shared servers now (those that fit; the rest as soon as they do), note which module's
    servers launch ahead during which module, and the last test that uses each fixture, after
    which :func:`release_after` stops it."""
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
    launched_ahead = [n for n in first_module if n in _shared and _shared[n].ahead]
    for i, before in enumerate(modules):
        _ahead[before] = [
            [n for n in launched_ahead if first_module[n] == module] for module in modules[i + 1 :]
        ]
    _progress.needs = {n for n in first_module if n in _shared and _shared[n].borrow}
    _pending[:] = [n for n in first_module if n in _shared and not _shared[n].ahead]
    _launch_pending()


def _try_launch(names: list[str]) -> bool:
    """Launch ``names`` if they fit beside every lane's engines; False (none launched) if not."""
    with _room():
        if not _fits(_wanted(names)):
            return False
        launch_for(names)
    return True


def _launch_pending() -> None:
    while _pending and _try_launch(_pending[:1]):
        _pending.pop(0)


def launch_ahead(item: Any) -> None:
    """After each test's set-up: launch the session's servers that did not fit so far; then,
    once per module, the own servers of the modules after it, in order, while they fit in
    :data:`ENGINE_BUDGET` beside those alive (the first that does not fit waits, and so do
    those after it: a module of one short test hides little of a start-up, so the budget, not
    the distance, is the limit)."""
    _launch_pending()
    module = module_of(item)
    if module in _modules_started:
        return
    _modules_started.add(module)
    if _pending:
        return  # the session's first
    for names in _ahead.get(module, []):
        wanted = [n for n in names if n not in _launched and n not in _held]
        if not _try_launch(wanted):
            return  # nor the module after it: each module's servers come up in order


def launch_for(fixture_names: Iterable[str]) -> None:
    """Launch (without waiting) the registered servers among ``fixture_names``."""
    for name in sorted({n for n in fixture_names if n in _shared and n not in _launched}):
        _launched[name] = _launch(name)
        _publish()


def take(fixture_name: str) -> tuple[Any, ...]:
    """The fixture's processes: those launched ahead, or launched now (once they fit in the
    budget beside the other lanes': :func:`_must_wait`, at most :data:`ROOM_WAIT_S`), counted
    as held from here on (:func:`held` ends that)."""
    procs = _launched.pop(fixture_name, None)
    if procs is None:
        if fixture_name in _pending:
            _pending.remove(fixture_name)
        procs = _when_room(_wanted([fixture_name]), lambda: _launch(fixture_name))
    _held[fixture_name] = procs
    _publish()
    return procs


@contextmanager
def reserved(purpose: str, engines: int) -> Iterator[None]:
    """Room for ``engines`` that a test launches and stops itself (a server it kills, say):
    entered once they fit beside every lane's (waiting as :func:`take` does), counted as this
    lane's until the block ends. (The router lifecycle's two launches of P and D had started
    beside five engines: 7 alive, 21.7 of 24 GB in use.)"""
    _when_room(engines, lambda: _reserved.__setitem__(purpose, engines))
    _publish()
    try:
        yield
    finally:
        _reserved.pop(purpose, None)
        _publish()


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
    test that comes later cannot ask for them, and their memory goes to the servers it starts;
    and those this lane serves that no lane needs any more."""
    for name, nodeid in _last_user.items():
        if nodeid == item.nodeid and name in _held:
            _stop(name, _held.pop(name))
    for name, procs in list(_serving.items()):
        if name not in _progress.needs and name not in _held and name not in _launched:
            _stop(name, procs)
    if item.nodeid == _progress.last:
        _progress.done = True
        _publish()


def stop_untaken() -> None:
    """Stop what was launched for a test that never ran (a failure under ``-x``, a deselection
    after collection, an interrupted session), and what this lane still serves."""
    while _launched:
        name, procs = _launched.popitem()
        _stop(name, procs, wait=True)
    for name, procs in list(_serving.items()):
        _stop(name, procs, wait=True)
    _publish()
