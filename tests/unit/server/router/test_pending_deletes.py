"""The deletes an unreachable instance missed (server/router/pending_deletes.py), as pure logic:
kept once each, bounded per tenant and in all, sent again oldest first, kept while the instance
still cannot be reached, given up on any answer but success or already gone."""

from __future__ import annotations

import asyncio

from server.router.pending_deletes import MissedDelete, PendingDeletes

U, V = "http://a.test:1", "http://b.test:2"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def deliver(pending: PendingDeletes, url: str, answers: list[int | None]) -> tuple[bool, list]:
    sent: list[tuple[str, str, dict]] = []

    async def send(to: str, missed: MissedDelete) -> int | None:
        sent.append((to, missed.path, missed.headers))
        return answers.pop(0)

    return asyncio.run(pending.deliver(url, send)), sent


def test_a_delete_missed_twice_is_sent_once():
    pending = PendingDeletes()
    assert pending.add(U, "t", "/s/1", {"authorization": "Bearer k"})
    assert pending.add(U, "t", "/s/1", {"authorization": "Bearer k"})
    ok, sent = deliver(pending, U, [200])
    assert ok and sent == [(U, "/s/1", {"authorization": "Bearer k"})] and len(pending) == 0


def test_each_instance_gets_only_what_it_missed_oldest_first():
    pending = PendingDeletes()
    pending.add(U, "t", "/s/1", {})
    pending.add(V, "t", "/s/2", {})
    pending.add(U, "t", "/s/3", {})
    ok, sent = deliver(pending, U, [200, 404])
    assert ok and [p for _, p, _ in sent] == ["/s/1", "/s/3"]
    assert pending.missed(V) == ["/s/2"] and pending.counts["delivered"] == 2


def test_an_instance_still_unreachable_keeps_the_rest():
    pending = PendingDeletes()
    pending.add(U, "t", "/s/1", {})
    pending.add(U, "t", "/s/2", {})
    ok, _ = deliver(pending, U, [200, None])
    assert not ok and pending.missed(U) == ["/s/2"]


def test_any_other_answer_gives_the_delete_up():
    pending = PendingDeletes()
    pending.add(U, "t", "/s/1", {})
    ok, _ = deliver(pending, U, [401])
    assert ok and len(pending) == 0 and pending.counts["refused"] == 1


def test_one_tenant_cannot_crowd_out_the_others():
    pending = PendingDeletes(max_per_tenant=2, max_total=3)
    assert pending.add(U, "flood", "/s/1", {}) and pending.add(V, "flood", "/s/2", {})
    assert not pending.add(U, "flood", "/s/3", {})  # its share is full
    assert pending.add(U, "other", "/s/4", {})
    assert not pending.add(U, "third", "/s/5", {})  # all of it is full
    assert pending.counts["dropped"] == 2 and len(pending) == 3
    deliver(pending, U, [200, 200])
    assert pending.add(U, "flood", "/s/3", {})  # delivered ones free their places


def test_a_delete_older_than_the_sessions_ttl_is_forgotten_unsent():
    clock = Clock()
    pending = PendingDeletes(ttl_s=10.0, clock=clock)
    pending.add(U, "t", "/s/1", {})
    clock.now = 11.0
    ok, sent = deliver(pending, U, [])
    assert ok and sent == [] and len(pending) == 0 and pending.counts["expired"] == 1
