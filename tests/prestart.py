"""The test session's shared servers, launched as soon as collection ends and awaited by their
fixtures.

Why: an engine start is a few single-threaded Python imports of vLLM and torch (25-50 s on CI's
2 cores), and the session's shared servers used to start one after the other, each when its
first test asked for it, while the other core idled. The unit tests run first (pure logic, about
two minutes on one core), so the servers the collected integration tests will ask for start on
the other core meanwhile, all at once. They are the servers that live for the whole session
anyway (or for the ``keyed`` package, which runs first): starting them early keeps no more of
them alive together than before. A server no collected test uses is never started.

:func:`fixture` makes such a fixture: it takes its servers with :func:`take` (launched here, or
now if collection did not launch them, e.g. under ``--collect-only`` or for a server a test
asked for dynamically) and wraps them in :func:`running`, which awaits each and stops them all
at the end.

Memory, not only time: five engines started at collection live through the whole session, and
the index-backed cluster's four engines do not fit beside them on CI's 24 GB (the kernel killed
the kvbranch server's worker there). So a shared server is also *released* — stopped — right
after the last collected test that uses it (:func:`plan`, :func:`release_after`), and the
modules marked ``alone`` (the cluster) run last, when only the servers they use are left.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.server_process import ServerProcess

#: A shared server fixture's processes, constructed but not launched.
Factory = Callable[[], tuple[ServerProcess, ...]]

_factories: dict[str, Factory] = {}
_launched: dict[str, tuple[ServerProcess, ...]] = {}
#: Servers a fixture holds now (taken and ready), by fixture name, until released.
_held: dict[str, tuple[ServerProcess, ...]] = {}
#: The node id of the last collected test that uses each shared fixture.
_last_user: dict[str, str] = {}


def fixture(fixture_name: str, factory: Factory, *, scope: str = "session") -> Any:
    """A pytest fixture named ``fixture_name`` over ``factory``'s processes, launched at the end
    of collection when a collected test uses it; it yields the process (or the tuple of them
    when there are several), each ready, and stops them at the end of its scope."""
    _factories[fixture_name] = factory

    @pytest.fixture(scope=scope, name=fixture_name)
    def servers() -> Iterator[ServerProcess | tuple[ServerProcess, ...]]:
        with running(take(fixture_name)) as procs, held(fixture_name, procs):
            yield procs[0] if len(procs) == 1 else procs

    return servers


def _launch(fixture_name: str) -> tuple[ServerProcess, ...]:
    return tuple(proc.launch() for proc in _factories[fixture_name]())


def plan(items: Iterable[pytest.Item]) -> None:
    """Launch the shared servers the collected ``items`` use (in their final order) and note
    the last test that uses each, after which :func:`release_after` stops it."""
    _last_user.clear()
    for item in items:
        for name in item.fixturenames:
            _last_user[name] = item.nodeid
    launch_for(_last_user)


def launch_for(fixture_names: Iterable[str]) -> None:
    """Launch (without waiting) the shared servers among ``fixture_names``."""
    for name in sorted({n for n in fixture_names if n in _factories and n not in _launched}):
        _launched[name] = _launch(name)


def take(fixture_name: str) -> tuple[ServerProcess, ...]:
    """The fixture's processes: those launched at collection, or launched now."""
    procs = _launched.pop(fixture_name, None)
    return procs if procs is not None else _launch(fixture_name)


@contextmanager
def held(fixture_name: str, procs: tuple[ServerProcess, ...]) -> Iterator[None]:
    """``procs`` are what ``fixture_name`` serves until its scope ends or :func:`release_after`
    stops them early (stopping twice is harmless)."""
    _held[fixture_name] = procs
    try:
        yield
    finally:
        _held.pop(fixture_name, None)


def release_after(item: pytest.Item) -> None:
    """Stop the servers whose last collected user is ``item`` (it has just been torn down): a
    test that comes later cannot ask for them, and their memory goes to the servers it starts."""
    for name, nodeid in _last_user.items():
        if nodeid == item.nodeid:
            for proc in _held.pop(name, ()):
                proc.stop()


@contextmanager
def running(procs: tuple[ServerProcess, ...]) -> Iterator[tuple[ServerProcess, ...]]:
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
