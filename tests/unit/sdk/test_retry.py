"""Retries and backoff over an in-process fake transport; the waits are recorded, not slept."""

from __future__ import annotations

import email.utils
import time

import httpx
import pytest

from sdk import (
    APIConnectionError,
    APITimeoutError,
    BadRequestError,
    NotFoundError,
    RateLimitError,
    RetryPolicy,
    ServerError,
    StreamInterruptedError,
)
from sdk.testing import FakeKVBranchServer

MESSAGES = [{"role": "user", "content": "hello"}]


class Recorder:
    """Injected waits: records each backoff and advances a fake clock by it."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now


def make(driver, fake: FakeKVBranchServer, rec: Recorder, **policy):
    """A client whose waits are recorded (and must be its own driver's kind of sleep)."""
    retry = driver.retry(wait=rec.sleep, clock=rec.clock, random=lambda: 1.0, **policy)
    return driver.client("http://fake", transport=fake.transport(), retry=retry, model="fake-model")


@pytest.fixture
def fake():
    return FakeKVBranchServer()


@pytest.fixture
def rec():
    return Recorder()


@pytest.mark.parametrize("status", [502, 503, 504])
def test_gateway_errors_are_retried_with_exponential_backoff(driver, fake, rec, status):
    fake.fail_next(status, times=3)
    result = make(driver, fake, rec, initial_backoff_s=0.5, max_backoff_s=10).chat(MESSAGES)
    assert result.text == "echo 1: hello"
    assert len(fake.chat_requests()) == 4
    assert rec.waits == [0.5, 1.0, 2.0]  # random() == 1: the full ceiling of each step


def test_backoff_is_capped_and_jittered(rec):
    policy = RetryPolicy(initial_backoff_s=1, max_backoff_s=4, random=lambda: 0.25)
    assert [policy.backoff(n, None) for n in range(1, 6)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    no_jitter = RetryPolicy(initial_backoff_s=1, max_backoff_s=4, jitter=False)
    assert [no_jitter.backoff(n, None) for n in range(1, 5)] == [1, 2, 4, 4]


def test_real_jitter_stays_within_the_ceiling():
    policy = RetryPolicy(initial_backoff_s=1, max_backoff_s=8)
    waits = [policy.backoff(3, None) for _ in range(200)]
    assert all(0 <= w <= 4 for w in waits) and len(set(waits)) > 100


def test_retry_after_seconds_is_honoured(driver, fake, rec):
    fake.fail_next(429, headers={"Retry-After": "3"})
    fake.fail_next(503, headers={"Retry-After": "1.5"})
    result = make(driver, fake, rec).chat(MESSAGES)
    assert result.text
    assert rec.waits == [3.0, 1.5]


def test_retry_after_http_date_is_honoured(driver, fake, rec):
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    fake.fail_next(429, headers={"Retry-After": when})
    make(driver, fake, rec, max_total_s=120).chat(MESSAGES)
    assert len(rec.waits) == 1 and 25 <= rec.waits[0] <= 31


def test_retry_after_beyond_the_time_budget_gives_up(driver, fake, rec):
    fake.fail_next(429, headers={"Retry-After": "120"})
    with pytest.raises(RateLimitError) as info:
        make(driver, fake, rec, max_total_s=60).chat(MESSAGES)
    assert info.value.retry_after == 120.0 and rec.waits == []
    assert "injected 429" in str(info.value)


def test_attempts_are_bounded(driver, fake, rec):
    fake.fail_next(503, times=10)
    with pytest.raises(ServerError) as info:
        make(driver, fake, rec, max_attempts=3).chat(MESSAGES)
    assert info.value.status_code == 503
    assert len(fake.chat_requests()) == 3 and len(rec.waits) == 2


def test_total_time_is_bounded(driver, fake, rec):
    fake.fail_next(503, times=10)
    with pytest.raises(ServerError):
        make(
            driver,
            fake,
            rec,
            max_attempts=100,
            initial_backoff_s=4,
            max_backoff_s=4,
            max_total_s=10,
        ).chat(MESSAGES)
    assert rec.waits == [4.0, 4.0]  # a third wait would end past 10 s
    assert len(fake.chat_requests()) == 3


@pytest.mark.parametrize(
    "status,error", [(400, BadRequestError), (404, NotFoundError), (500, ServerError)]
)
def test_other_errors_are_not_retried(driver, fake, rec, status, error):
    fake.fail_next(status)
    with pytest.raises(error):
        make(driver, fake, rec).chat(MESSAGES)
    assert len(fake.chat_requests()) == 1 and rec.waits == []


def test_connection_errors_are_retried(driver, fake, rec):
    fake.fail_next(httpx.ConnectError("connection refused"), times=2)
    assert make(driver, fake, rec).chat(MESSAGES).text
    assert len(rec.waits) == 2


def test_connection_error_after_all_attempts(driver, fake, rec):
    fake.fail_next(httpx.ConnectError("connection refused"), times=5)
    with pytest.raises(APIConnectionError, match="cannot connect.*connection refused"):
        make(driver, fake, rec, max_attempts=2).chat(MESSAGES)


def test_read_timeout_is_not_retried(driver, fake, rec):
    # the server may still be generating: sending again would run it twice
    fake.fail_next(httpx.ReadTimeout("read timed out"))
    with pytest.raises(APITimeoutError, match="not retried"):
        make(driver, fake, rec).chat(MESSAGES)
    assert len(fake.chat_requests()) == 1


def test_connect_timeout_is_retried(driver, fake, rec):
    fake.fail_next(httpx.ConnectTimeout("connect timed out"))
    assert make(driver, fake, rec).chat(MESSAGES).text
    assert len(rec.waits) == 1


def test_stream_is_retried_before_its_first_byte(driver, fake, rec):
    fake.fail_next(503)
    fake.fail_next(httpx.ConnectError("refused"))
    stream = make(driver, fake, rec).chat_stream(MESSAGES)
    assert stream.final().text == "echo 1: hello"
    assert len(fake.chat_requests()) == 3 and len(rec.waits) == 2


def test_stream_is_never_retried_after_its_first_byte(driver, fake, rec):
    fake.break_next_stream(after_events=2)
    stream = make(driver, fake, rec).chat_stream(MESSAGES)
    seen = []
    with pytest.raises(StreamInterruptedError, match="not retried"):
        for chunk in stream:
            seen.append(chunk)
    assert len(seen) == 2
    assert len(fake.chat_requests()) == 1 and rec.waits == []


def test_empty_stream_body_counts_as_before_first_byte(driver, rec):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"")
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            content=b'data: {"choices":[{"index":0,"delta":{"content":"ok"},'
            b'"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n',
        )

    retry = driver.retry(wait=rec.sleep, clock=rec.clock)
    client = driver.client(
        "http://x", transport=httpx.MockTransport(handler), retry=retry, model="m"
    )
    assert client.chat_stream(MESSAGES).final().text == "ok"
    assert len(calls) == 2


def test_retries_wait_with_the_drivers_own_sleep(driver, fake, rec):
    # driver.retry fails the test if the client waits with the other driver's sleep
    fake.fail_next(429, headers={"Retry-After": "2"})
    fake.fail_next(httpx.ConnectError("refused"))
    client = make(driver, fake, rec)
    first = client.chat(MESSAGES)
    fake.fail_next(503)
    second = client.chat_stream(MESSAGES).final()
    assert first.text == second.text == "echo 1: hello"
    assert rec.waits == [2.0, 1.0, 0.5]


def test_policy_rejects_bad_settings():
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="max_total_s"):
        RetryPolicy(max_total_s=-1)
