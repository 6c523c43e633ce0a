"""Hand-off (``HandOff`` policy) and coalescing (``lock_enqueue="until_start"``) in real workers."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import redis
from celery import Celery, group
from celery.exceptions import SoftTimeLimitExceeded

from celery_redislock import HandOff, LockBackendError, LockContended, SingletonTask
from celery_redislock.keys import debounce_key, handoff_keys, queued_key, slot_keys
from celery_redislock.pending import PendingIndex
from celery_redislock.store import LockStore
from celery_redislock.tokens import LockOwner, LockValue
from tests.brokers import QUORUM, queue_settled
from tests.conftest import embedded_worker
from tests.helpers import held
from tests.servers import wait_until

pytestmark = pytest.mark.worker


def _spans(record: redis.Redis, name: str) -> list[tuple[float, float, str]]:
    """(start, end, label) of every finished body, in start order."""
    rows = [row.split("|") for row in record.lrange(name, 0, -1)]
    return sorted((float(start), float(end), label) for start, end, label in rows)


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_parked_duplicates_run_one_at_a_time_in_arrival_order_right_after_each_release(
    app: Celery, record: redis.Redis, pool: str
) -> None:
    @app.task(
        base=SingletonTask, shared=False, lock_args=("account",), lock_on_contention="handoff"
    )
    def recompute(account: int, label: str, seconds: float) -> str:
        start = time.time()
        time.sleep(seconds)
        record.rpush("spans", f"{start}|{time.time()}|{label}")
        return label

    @app.task(shared=False)
    def other() -> float:
        return time.time()

    with embedded_worker(app, pool, 2):
        first = recompute.delay(7, "holder", 1.5)
        wait_until(lambda: record.exists("spans") or _held(app, recompute), timeout=20)
        waiters = []
        for index in range(3):
            waiters.append(recompute.delay(7, f"w{index}", 0.3))
            # Each parks before the next is sent: arrival order is known.
            wait_until(lambda n=index + 1: _parked(app, recompute) >= n, timeout=20)
        # Parked executions hold no worker slot: with concurrency 2 and the
        # holder running, another task still runs at once.
        sent = time.time()
        assert other.delay().get(timeout=20) - sent < 1.0
        assert first.get(timeout=30) == "holder"
        assert [w.get(timeout=30) for w in waiters] == ["w0", "w1", "w2"]
    spans = _spans(record, "spans")
    assert [label for _, _, label in spans] == ["holder", "w0", "w1", "w2"]
    for (_, end, _), (start, _, label) in itertools.pairwise(spans):
        assert start >= end, f"{label} overlapped the run before it"
        # Handed over on release, not after the holder's 30 s TTL.
        assert start - end < 1.0, f"{label} started {start - end:.3f}s after the release"


def _settings(app: Celery, task: Any) -> Any:
    return task._lock_settings()


def _held(app: Celery, task: Any) -> bool:
    client = redis.Redis.from_url(app.conf.redislock_url)
    try:
        return any(not k.endswith((b":fence",)) for k in client.scan_iter(match=b"*"))
    finally:
        client.close()


def _parked(app: Celery, task: Any) -> int:
    client = redis.Redis.from_url(app.conf.redislock_url)
    try:
        return sum(
            int(client.llen(key)) for key in client.scan_iter(match=b"*:waiters", count=1000)
        )
    finally:
        client.close()


def test_a_parked_execution_runs_at_its_safety_net_when_nobody_hands_it_over(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    """The holder's release cannot publish (its process died after the pop): the re-sent copy runs.

    Exactly once: the woken copy is never published here, and the safety
    net's copy runs the body.
    """

    @app.task(
        base=SingletonTask,
        shared=False,
        lock_args=(),
        lock_ttl=2,
        lock_on_contention=HandOff(jitter=0.1),
    )
    def job(label: str) -> str:
        record.rpush("runs", label)
        return label

    key = job.lock_key_for(("waiter",), {})
    holder_value = "v1|holder|0|elsewhere|1|ab|job|0"
    with embedded_worker(app, "threads", 2):
        # Held only once the worker is up: its start-up must not eat the TTL.
        assert lock_client.set(key, holder_value, px=2000)
        result = job.delay("waiter")
        wait_until(lambda: lock_client.llen(handoff_keys(key)[0]) == 1, timeout=20)
        # A release by a process that cannot publish the woken message: the
        # lock is handed to the waiter, but its message is never sent.
        bare = LockStore(client=lock_client)
        bare.release(key, holder_value)
        assert lock_client.get(key).startswith(b"v1|")  # handed over, not freed
        assert result.get(timeout=20) == "waiter"
        wait_until(lambda: not lock_client.exists(key), timeout=10)
    assert record.lrange("runs", 0, -1) == ["waiter"]


def test_both_copies_of_a_parked_execution_arrive_and_the_body_runs_once(
    app: Celery, record: redis.Redis, lock_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Woken copy and safety-net copy both delivered: one runs, the other is dropped."""

    @app.task(
        base=SingletonTask,
        shared=False,
        lock_args=(),
        lock_ttl=1,
        lock_on_contention=HandOff(jitter=0.0),
    )
    def job(label: str) -> str:
        record.rpush("runs", label)
        time.sleep(0.2)
        return label

    key = job.lock_key_for(("waiter",), {})
    holder_value = "v1|holder|0|elsewhere|1|ab|job|0"
    with caplog.at_level("INFO", logger="celery_redislock"), embedded_worker(app, "threads", 2):
        # Held only once the worker is up (a slow start-up let the key expire
        # before the call arrived, and it never parked), for long enough that
        # the call parks behind it on a loaded machine.
        assert lock_client.set(key, holder_value, px=2000)
        result = job.delay("waiter")
        wait_until(lambda: lock_client.llen(handoff_keys(key)[0]) == 1, timeout=20)
        # Released (woken copy published) just as the safety net (the
        # holder's remaining TTL) fires.
        settings = job._lock_settings()
        wait_until(lambda: 0 <= lock_client.pttl(key) < 100, timeout=10, interval=0.005)
        settings.backend.release(key, holder_value)
        assert result.get(timeout=20) == "waiter"
        ran = handoff_keys(key)[2]
        wait_until(lambda: lock_client.hlen(ran) == 1, timeout=10)
        # The second copy arrives and is dropped.
        wait_until(lambda: "another copy of this parked execution already ran" in caplog.text)
    assert record.lrange("runs", 0, -1) == ["waiter"]


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_coalescing_storm_never_loses_the_latest_change(
    app_factory: Any, record: redis.Redis, pool: str
) -> None:
    """1,000 calls over ~3 s against a 0.25 s body: the last body sees the final counter."""
    app = app_factory()

    @app.task(base=SingletonTask, shared=False, lock_args=("account",), lock_enqueue="until_start")
    def recompute(account: int) -> int:
        start = time.time()
        seen = int(record.get("counter") or 0)
        running = record.incr("running")
        record.rpush("overlap", running)
        time.sleep(0.25)
        record.decr("running")
        record.rpush("seen", f"{start}|{seen}")
        return seen

    calls = 1000
    with embedded_worker(app, pool, 4 if pool == "threads" else 2):
        deadline = time.time() + 3.0
        for n in range(calls):
            record.incr("counter")
            recompute.delay(1)
            pause = (deadline - time.time()) / (calls - n)
            if pause > 0:
                time.sleep(pause)
        final = int(record.get("counter"))
        lock = redis.Redis.from_url(app.conf.redislock_url)
        key = recompute.lock_key_for((1,), {})

        def settled() -> bool:
            return not lock.exists(key) and not lock.exists(queued_key(key))

        wait_until(settled, timeout=30)
        lock.close()
    seen = [int(row.split("|")[1]) for row in record.lrange("seen", 0, -1)]
    assert final == calls
    assert seen[-1] == final, f"the last body saw {seen[-1]}, the final value is {final}"
    assert max(int(n) for n in record.lrange("overlap", 0, -1)) == 1
    # About storm / body + 1 bodies (3 s / 0.25 s + 1 = 13), not 1,000.
    assert 2 <= len(seen) <= 20, len(seen)


def test_a_call_while_the_queued_run_waits_joins_it(app: Celery, record: redis.Redis) -> None:
    @app.task(base=SingletonTask, shared=False, lock_args=("account",), lock_enqueue="until_start")
    def recompute(account: int, seconds: float) -> float:
        record.rpush("runs", account)
        time.sleep(seconds)
        return seconds

    with embedded_worker(app, "threads", 2):
        running = recompute.delay(1, 1.0)
        wait_until(lambda: record.llen("runs") == 1, timeout=20)
        queued = recompute.delay(1, 0.1)  # published: the first one started
        joined = recompute.delay(1, 0.2)  # the queued one has not started: joins it
        assert queued.id != running.id
        assert joined.id == queued.id
        assert running.get(timeout=20) == 1.0
        assert queued.get(timeout=20) == 0.1
    assert record.lrange("runs", 0, -1) == ["1", "1"]


def test_parked_executions_survive_a_threaded_release_storm(
    app: Celery, record: redis.Redis
) -> None:
    """Eight callers, one key: every call runs, never two at once."""

    @app.task(base=SingletonTask, shared=False, lock_args=(), lock_on_contention="handoff")
    def job(n: int) -> int:
        running = record.incr("running")
        record.rpush("overlap", running)
        time.sleep(0.05)
        record.decr("running")
        return n

    with embedded_worker(app, "threads", 4):
        results: list[Any] = []
        guard = threading.Lock()

        def call(n: int) -> None:
            result = job.delay(n)
            with guard:
                results.append(result)

        threads = [threading.Thread(target=call, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(r.get(timeout=30) for r in results) == list(range(8))
    assert max(int(n) for n in record.lrange("overlap", 0, -1)) == 1


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_debounced_burst_runs_once_a_window_after_its_last_call(
    app: Celery, record: redis.Redis, pool: str
) -> None:
    @app.task(base=SingletonTask, shared=False, lock_args=("account",), lock_debounce=0.6)
    def recompute(account: int) -> int:
        record.rpush("runs", f"{time.time()}|{record.get('counter')}")
        return account

    with embedded_worker(app, pool, 2):
        results = []
        for _ in range(10):
            record.incr("counter")
            last_call = time.time()  # before the call: its window starts inside delay()
            results.append(recompute.delay(1))
            time.sleep(0.1)
        assert len({r.id for r in results}) == 1  # every call joined the burst's run
        assert results[-1].get(timeout=20) == 1
    runs = [row.split("|") for row in record.lrange("runs", 0, -1)]
    assert len(runs) == 1
    started, seen = float(runs[0][0]), runs[0][1]
    assert seen == "10"  # it ran after the last call
    # Quorum queues round every countdown up to whole seconds (brokers.md):
    # the re-send that moves the run to its due time may arrive up to 1 s late.
    latest = 2.0 + (1.0 if QUORUM else 0.0)
    # The window (0.6 s) after the last call, less 0.1 s for the clocks of two processes.
    assert 0.5 <= started - last_call < latest, started - last_call


@pytest.mark.parametrize("where", ["task", "call"])
def test_a_burst_runs_by_its_last_calls_expiry_not_its_first(
    app: Celery, record: redis.Redis, where: str
) -> None:
    """``expires`` counts from when the run is due: the window does not eat into it.

    Calls at 0, 0.6 and 1.2 s, each expiring 1.5 s after itself, window 1 s:
    the run is due at 2.2 s. Its first message expired at 1.5 s, and the
    re-send that moved it kept that expiry: the run was REVOKED and no call
    of the burst ran (review helper-28).
    """
    options = {"expires": 1.5} if where == "task" else {}

    @app.task(base=SingletonTask, shared=False, lock_args=(), lock_debounce=1.0, **options)
    def recompute(n: int) -> int:
        record.rpush("runs", n)
        return n

    with embedded_worker(app, "threads", 2):
        calls = []
        for n in range(3):
            if where == "call":
                calls.append(recompute.apply_async((n,), expires=1.5))
            else:
                calls.append(recompute.delay(n))
            if n < 2:
                time.sleep(0.6)  # the burst's spacing
        assert len({call.id for call in calls}) == 1
        assert calls[-1].get(timeout=20) == 0  # the burst's run is its first call
    assert record.lrange("runs", 0, -1) == ["0"]


def test_a_long_burst_moved_many_times_keeps_its_expiry_margin(
    app: Celery, record: redis.Redis
) -> None:
    """Twelve calls 0.7 s apart, window 1 s, each expiring 1.5 s after itself.

    On quorum queues each re-send's countdown is rounded up to whole seconds;
    the expiry moved by the unrounded time lost the difference at every hop,
    until the run was REVOKED and the burst lost (review helper-30).
    """

    @app.task(base=SingletonTask, shared=False, lock_args=(), lock_debounce=1.0, expires=1.5)
    def recompute(n: int) -> int:
        record.rpush("runs", n)
        return n

    with embedded_worker(app, "threads", 2):
        calls = []
        for n in range(12):
            calls.append(recompute.delay(n))
            if n < 11:
                time.sleep(0.7)  # the burst's spacing
        assert calls[-1].get(timeout=30) == 0
    assert record.lrange("runs", 0, -1) == ["0"]


def test_a_debounced_run_expiring_within_its_window_still_runs(
    app: Celery, record: redis.Redis
) -> None:
    # The window is the package's delay, not the caller's: a run expiring
    # 0.5 s after its call but due 1 s after it was REVOKED every time.
    @app.task(base=SingletonTask, shared=False, lock_args=(), lock_debounce=1.0, expires=0.5)
    def recompute(n: int) -> int:
        record.rpush("runs", n)
        return n

    with embedded_worker(app, "threads", 2):
        assert recompute.delay(7).get(timeout=20) == 7
    assert record.lrange("runs", 0, -1) == ["7"]


def test_a_never_ending_burst_still_runs_by_its_max_wait(app: Celery, record: redis.Redis) -> None:
    @app.task(
        base=SingletonTask,
        shared=False,
        lock_args=("account",),
        lock_debounce=0.5,
        lock_debounce_max_wait=1.0,
    )
    def recompute(account: int) -> int:
        record.rpush("runs", f"{time.time()}|{record.get('counter')}")
        return account

    with embedded_worker(app, "threads", 2):
        first_call = time.time()
        last = None
        while time.time() - first_call < 3.0:
            record.incr("counter")
            last = recompute.delay(1)
            time.sleep(0.1)
        final = record.get("counter")
        assert last is not None
        last.get(timeout=20)
        wait_until(lambda: record.lrange("runs", -1, -1)[0].endswith(f"|{final}"), timeout=10)
    runs = [float(row.split("|")[0]) for row in record.lrange("runs", 0, -1)]
    # A run at most max_wait (+ delivery slack) after each burst began:
    # several runs in 3 s of calls, not one at the end.
    assert len(runs) >= 2
    assert runs[0] - first_call < 1.0 + 1.0


def test_debounce_and_enqueue_together_are_refused(app: Celery) -> None:
    from celery_redislock import ConfigurationError

    with pytest.raises(ConfigurationError, match="lock_debounce or lock_enqueue"):

        @app.task(base=SingletonTask, shared=False, lock_debounce=1, lock_enqueue=True)
        def both() -> None: ...

        both.name  # noqa: B018  (the proxy builds the task class on first use)


@pytest.mark.fault
def test_parked_executions_run_when_the_lock_store_restarts_empty(
    app_factory: Any, record: redis.Redis, redis_server_factory: Any
) -> None:
    """The queue is lost with the store: the safety-net copy runs the parked execution."""
    store_server = redis_server_factory()
    app = app_factory(redislock_url=store_server.url_for(0), redislock_ttl=2)
    release = threading.Event()

    @app.task(
        base=SingletonTask, shared=False, lock_args=(), lock_on_contention=HandOff(jitter=0.1)
    )
    def job(label: str, hold: bool) -> str:
        record.rpush("runs", label)
        if hold:
            release.wait(20)
        return label

    key = job.lock_key_for(("x", False), {})
    locks = store_server.client()
    with embedded_worker(app, "threads", 2):
        holder = job.delay("holder", True)
        wait_until(lambda: record.llen("runs") == 1, timeout=20)
        waiter = job.delay("waiter", False)
        wait_until(lambda: locks.llen(handoff_keys(key)[0]) == 1, timeout=20)
        store_server.restart()  # empty: the lock and the queue are gone
        assert waiter.get(timeout=20) == "waiter"  # its safety net ran it
        release.set()
        assert holder.get(timeout=20) == "holder"
    assert sorted(record.lrange("runs", 0, -1)) == ["holder", "waiter"]


class _LostParkReply(LockStore):
    """The first real park runs on the server, but its reply never arrives."""

    lost: ClassVar[list[bool]] = []

    def do_park(self, keys: Any, args: Any, *calls: Any) -> Any:
        reply = super().do_park(keys, args, *calls)
        if args[5] and not self.lost:
            self.lost.append(True)
            raise redis.exceptions.TimeoutError("Timeout reading from socket")
        return reply


def test_a_call_whose_park_reply_was_lost_is_queued_once_and_runs_once(
    app_factory: Any, record: redis.Redis, lock_client: redis.Redis, caplog: Any
) -> None:
    """Its backoff re-send parks the same call again: the same hand-off value, one entry."""
    _LostParkReply.lost.clear()
    app = app_factory(redislock_store_class=_LostParkReply)

    @app.task(base=SingletonTask, shared=False, lock_args=(), lock_on_contention="handoff")
    def job(label: str) -> str:
        record.rpush("runs", label)
        return label

    key = job.lock_key_for(("x",), {})
    holder = "v1|holder|0|elsewhere|1|ab|job|0"
    lock_client.set(key, holder, px=30000)
    with caplog.at_level("INFO", logger="celery_redislock"), embedded_worker(app, "threads", 2):
        result = job.delay("one-call")
        wait_until(lambda: caplog.text.count("parked behind lock") >= 1, timeout=30)
        assert lock_client.llen(handoff_keys(key)[0]) == 1  # one call, queued once
        job._lock_settings().backend.release(key, holder)
        assert result.get(timeout=20) == "one-call"
    assert record.lrange("runs", 0, -1) == ["one-call"]


def test_a_redelivered_call_that_died_after_parking_runs_once(
    app_factory: Any, record: redis.Redis, lock_client: redis.Redis, server: Any
) -> None:
    """acks_late: the child dies between parking and its safety net; the original comes back.

    The release hands the lock to the call and publishes its woken copy;
    the redelivered original is another copy of the same call: one runs.
    """
    flag = server.client(9)
    app = app_factory(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        redislock_store_class="tests.worker.test_handoff:_DieAfterPark",
    )
    _DieAfterPark.flag_url = server.url_for(9)

    @app.task(base=SingletonTask, shared=False, lock_args=(), lock_on_contention="handoff")
    def job(label: str) -> str:
        record.rpush("runs", label)
        return label

    key = job.lock_key_for(("x",), {})
    holder = "v1|holder|0|elsewhere|1|ab|job|0"
    lock_client.set(key, holder, px=30000)
    with embedded_worker(app, "prefork", 2):
        result = job.delay("one-call")
        wait_until(lambda: flag.exists("died-once"), timeout=30)
        job._lock_settings().backend.release(key, holder)
        assert result.get(timeout=30) == "one-call"

        wait_until(lambda: queue_settled(app), timeout=30, interval=0.2)
    assert record.lrange("runs", 0, -1) == ["one-call"]


class _DieAfterPark(LockStore):
    """The pool child dies right after its first real park (an OOM kill, say)."""

    flag_url: ClassVar[str] = ""

    def do_park(self, keys: Any, args: Any, *calls: Any) -> Any:
        reply = super().do_park(keys, args, *calls)
        if args[5] and redis.Redis.from_url(self.flag_url).set("died-once", 1, nx=True):
            os._exit(1)
        return reply


def test_a_revoked_debounced_run_ends_its_burst(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    @app.task(base=SingletonTask, shared=False, lock_args=("account",), lock_debounce=0.5)
    def recompute(account: int) -> int:
        record.rpush("runs", account)
        return account

    with embedded_worker(app, "threads", 2):
        dead = recompute.delay(1)
        burst = debounce_key(recompute.lock_key_for((1,), {}))
        assert lock_client.exists(burst)
        dead.revoke()
        wait_until(lambda: not lock_client.exists(burst), timeout=20)
        later = recompute.delay(1)
        assert later.id != dead.id  # a new burst, not a join of the revoked run
        assert later.get(timeout=20) == 1
    assert record.lrange("runs", 0, -1) == ["1"]


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_parked_calls_take_the_slots_their_holders_free(
    app: Celery, record: redis.Redis, pool: str
) -> None:
    """lock_limit=2 with HandOff: never more than 2 at once, waiters in arrival order."""

    @app.task(
        base=SingletonTask,
        shared=False,
        lock_args=("tenant",),
        lock_limit=2,
        lock_on_contention="handoff",
    )
    def export(tenant: int, label: str, seconds: float) -> str:
        running = record.incr("running")
        record.rpush("peak", running)
        record.rpush("order", label)
        time.sleep(seconds)
        record.decr("running")
        return label

    with embedded_worker(app, pool, 4 if pool == "threads" else 3):
        holders = [export.delay(1, f"h{n}", 1.0) for n in range(2)]
        wait_until(lambda: record.llen("order") == 2, timeout=20)
        waiters = []
        for n in range(3):
            waiters.append(export.delay(1, f"w{n}", 0.2))
            wait_until(lambda n=n: _parked(app, export) >= n + 1, timeout=20)
        assert [h.get(timeout=30) for h in holders] == ["h0", "h1"]
        assert [w.get(timeout=30) for w in waiters] == ["w0", "w1", "w2"]
    assert max(int(n) for n in record.lrange("peak", 0, -1)) == 2
    # w0 and w1 are handed the two freed slots (they may start in either
    # order); w2, parked last, only gets a slot one of them frees.
    order = record.lrange("order", 0, -1)
    assert set(order[2:4]) == {"w0", "w1"} and order[4] == "w2"


def test_a_parked_call_that_expired_gives_the_handed_lock_back(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    """Its woken message is revoked on arrival: the key passes on, not after the hand-off TTL."""

    @app.task(base=SingletonTask, shared=False, lock_args=("account",), lock_enqueue="until_start")
    def recompute(account: int, label: str) -> str:
        record.rpush("runs", label)
        time.sleep(1.0)
        return label

    key = recompute.lock_key_for((1, ""), {})
    with embedded_worker(app, "threads", 2):
        running = recompute.delay(1, "running")
        wait_until(lambda: record.llen("runs") == 1, timeout=20)
        expiring = recompute.apply_async((1, "expiring"), expires=0.5)
        wait_until(lambda: _parked(app, recompute) == 1, timeout=20)
        assert running.get(timeout=20) == "running"
        wait_until(lambda: expiring.state == "REVOKED", timeout=20)
        # Not the 30 s hand-off TTL. The queued key goes in Celery's
        # task_revoked, which it sends after storing REVOKED: a call made in
        # between joins the revoked run (CI saw it once; a known gap).
        wait_until(
            lambda: not lock_client.exists(key) and not lock_client.exists(queued_key(key)),
            timeout=5,
        )
        later = recompute.delay(1, "later")
        assert later.get(timeout=20) == "later"
    assert record.lrange("runs", 0, -1) == ["running", "later"]


def test_a_handed_over_call_that_retries_and_parks_again_still_runs(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    """Its self.retry() is a new attempt: a new hand-off value, not a copy to drop."""

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        lock_args=(),
        lock_ttl=1.5,
        lock_on_contention=HandOff(jitter=0.1),
    )
    def job(self: Any, label: str) -> str:
        record.rpush("attempts", self.request.retries)
        if self.request.retries == 0:
            # Celery's own re-send: on quorum queues Celery refuses a countdown under 1 s.
            raise self.retry(countdown=1 if QUORUM else 0.3)
        return label

    key = job.lock_key_for(("x",), {})
    holder = "v1|holder|0|elsewhere|1|ab|job|0"
    lock_client.set(key, holder, px=30000)
    with embedded_worker(app, "threads", 2):
        result = job.delay("done")
        wait_until(lambda: lock_client.llen(handoff_keys(key)[0]) == 1, timeout=20)
        job._lock_settings().backend.release(key, holder)  # handed over: attempt 0 runs
        wait_until(lambda: record.llen("attempts") == 1, timeout=20)
        wait_until(lambda: not lock_client.exists(key), timeout=20)
        lock_client.set(key, holder, px=1000)  # the retry finds it held again and parks
        assert result.get(timeout=30) == "done"
    assert record.lrange("attempts", 0, -1) == ["0", "1"]


def test_a_coalesced_task_sent_in_a_group_runs_after_the_holder_not_skipped(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    @app.task(
        base=SingletonTask,
        shared=False,
        lock_args=("account",),
        lock_ttl=1,
        lock_enqueue="until_start",
    )
    def recompute(account: int) -> int:
        record.rpush("runs", account)
        return account

    key = recompute.lock_key_for((1,), {})
    lock_client.set(key, "v1|holder|0|elsewhere|1|ab|job|0", px=1000)
    with embedded_worker(app, "threads", 2):
        result = group(recompute.s(1)).apply_async()  # canvas members skip enqueue dedup
        assert result.get(timeout=20) == [1]
    assert record.lrange("runs", 0, -1) == ["1"]


def test_a_call_that_gives_up_after_max_wait_never_runs_later(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    @app.task(
        base=SingletonTask,
        shared=False,
        lock_args=(),
        lock_ttl=1,
        lock_on_contention=HandOff(max_wait=0.5, jitter=0.0),
    )
    def job(label: str) -> str:
        record.rpush("runs", label)
        return label

    key = job.lock_key_for(("x",), {})
    holder = "v1|holder|0|elsewhere|1|ab|job|0"
    lock_client.set(key, holder, px=1000)
    with embedded_worker(app, "threads", 2):
        result = job.delay("late")

        def failed() -> bool:
            lock_client.set(key, holder, px=1000)  # the holder lives on (renewed)
            return result.state == "FAILURE"

        wait_until(failed, timeout=20, interval=0.1)
        with pytest.raises(LockContended):
            result.get(timeout=5)
        job._lock_settings().backend.release(key, holder)
        assert not lock_client.exists(key)  # nothing handed to the call that gave up
    assert record.lrange("runs", 0, -1) == []


def _windowed_job(app: Celery, record: redis.Redis, ttl: float, hold: float, jitter: float) -> Any:
    """A hand-off task that keeps its key ``hold`` s after it succeeds; spans in ``spans``."""

    @app.task(
        base=SingletonTask,
        shared=False,
        lock_args=(),
        lock_ttl=ttl,
        lock_hold_after_success=hold,
        lock_on_contention=HandOff(jitter=jitter),
    )
    def job(label: str, seconds: float) -> str:
        start = time.time()
        time.sleep(seconds)
        record.rpush("spans", f"{start}|{time.time()}|{label}")
        return label

    return job


def test_parked_calls_behind_an_idempotency_window_run_in_the_order_they_parked(
    app_factory: Any, record: redis.Redis
) -> None:
    """``lock_hold_after_success``: no release hands the key over; a sweep does, in order.

    Each run keeps the key 3 s after it succeeds. The safety nets (due one
    TTL after the hold, 1 s of jitter) come in any order: a copy that finds
    the key free hands it to the call that parked first.
    """
    app = app_factory(redislock_sweep_interval=0.2)
    job = _windowed_job(app, record, ttl=2, hold=3, jitter=1.0)
    with embedded_worker(app, "threads", 4):
        holder = job.delay("holder", 0.3)
        wait_until(lambda: _held(app, job), timeout=20)
        waiters = []
        for index in range(3):
            waiters.append(job.delay(f"w{index}", 0.05))
            wait_until(lambda n=index + 1: _parked(app, job) >= n, timeout=20)
        assert holder.get(timeout=20) == "holder"
        assert [w.get(timeout=40) for w in waiters] == ["w0", "w1", "w2"]
    spans = _spans(record, "spans")
    assert [label for _, _, label in spans] == ["holder", "w0", "w1", "w2"]
    for (_, end, _), (start, _, label) in itertools.pairwise(spans):
        # After the window (3 s), within a sweep interval and a little.
        assert 3.0 <= start - end < 4.5, f"{label} started {start - end:.3f}s after the run before"


def test_a_call_parked_behind_a_window_shorter_than_the_ttl_runs_when_the_window_ends(
    app_factory: Any, record: redis.Redis
) -> None:
    """The sweep looks at the key when the window ends, not one run TTL after the park.

    A parked call's sweep was due one holder TTL (10 s) after it parked; the
    holder's 2 s window ended long before (review helper-44 F3).
    """
    app = app_factory(redislock_sweep_interval=0.2)
    job = _windowed_job(app, record, ttl=10, hold=2, jitter=0.0)
    with embedded_worker(app, "threads", 2):
        holder = job.delay("holder", 0.3)
        wait_until(lambda: _held(app, job), timeout=20)
        waiter = job.delay("waiter", 0.05)
        wait_until(lambda: _parked(app, job) >= 1, timeout=20)
        assert holder.get(timeout=20) == "holder"
        assert waiter.get(timeout=20) == "waiter"
    (_, end, _), (start, _, _) = _spans(record, "spans")
    assert 2.0 <= start - end < 3.5, f"it started {start - end:.3f}s after the holder ended"


def _max_overlap(record: redis.Redis, name: str) -> int:
    """Most bodies running at once, from the ``start|end`` spans recorded in ``name``."""
    edges = sorted(
        (float(edge), step)
        for span in record.lrange(name, 0, -1)
        for edge, step in zip(span.split("|")[:2], (1, -1), strict=True)
    )
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


@pytest.mark.parametrize("limit", [1, 2])
def test_two_deliveries_of_one_task_id_never_run_at_once_with_hand_off(
    app_factory: Any, record: redis.Redis, limit: int
) -> None:
    """A redelivered copy meets its own first delivery: it waits for it, never beside it.

    With ``lock_limit=2`` a slot is free: the copy must not park and be handed
    it (by a release or a sweep) while its first delivery still runs.
    """
    app = app_factory(redislock_sweep_interval=0.2, redislock_ttl=5)

    @app.task(
        base=SingletonTask,
        shared=False,
        lock_args=(),
        lock_limit=limit,
        lock_on_contention=HandOff(max_wait=60),
    )
    def job(label: str) -> str:
        start = time.time()
        time.sleep(2)
        record.rpush("spans", f"{start}|{time.time()}|{label}")
        return label

    with embedded_worker(app, "threads", 3):
        job.apply_async(("first",), task_id="T-same")
        wait_until(lambda: _held(app, job), timeout=20)
        job.apply_async(("second",), task_id="T-same")  # the same message again
        wait_until(lambda: record.llen("spans") == 2, timeout=40)
    assert _max_overlap(record, "spans") == 1


def test_a_copy_of_a_parked_call_is_not_granted_a_slot_while_its_own_task_holds_another(
    lock_client: redis.Redis,
) -> None:
    """lock_limit=2: task T's redelivery parked while T's first delivery holds slot 1.

    Slot 2 frees (its holder died); a later call's safety net finds it free.
    Neither that copy (handing over to the head of the line) nor a sweep may
    give slot 2 to T's copy while T still runs in slot 1.
    """
    store = LockStore(client=lock_client)
    store.handoff_ttl_ms = 5000
    store.on_handoff = lambda *_: None
    index = PendingIndex(store, "redislock", "proj")
    key = "redislock:job:{k}"
    slot_1, slot_2 = slot_keys(key, 2)

    def value(task_id: str, pid: int) -> str:
        return LockValue.new_encoded(LockOwner(task_id, 0, "h", pid), "job")

    def park(task_id: str, pid: int, copy: str, message: bytes) -> Any:
        handoff = LockValue.parked(task_id, 0, "job").encode()
        return store.park(
            key, value(task_id, pid), 10_000, handoff, copy, message, limit=2,
            task_prefix=LockOwner.task_prefix(task_id),
        )  # fmt: skip

    running_t = value("T", 1)
    assert store.acquire_slot(key, 2, running_t, 10_000).key == slot_1
    assert store.acquire_slot(key, 2, value("H", 2), 10_000).key == slot_2
    park("T", 3, "o", b"msg-T")  # T's redelivery: its own task holds slot 1
    assert park("B", 4, "o", b"msg-B").parked
    lock_client.delete(slot_2)  # H's worker died; its slot expired
    park("B", 5, "f:1", b"")  # B's safety net
    index.reap_parked(key, 2, 5000, 0)  # a sweep: slot 2 is not T's either
    woken = park("T", 6, "w:1", b"")  # whatever T's copy finds, it must not run now
    assert not woken.result.acquired
    assert held(lock_client, slot_1) == running_t.encode()


def test_a_second_delivery_inside_the_idempotency_window_never_runs_again(
    app_factory: Any, record: redis.Redis
) -> None:
    """``lock_hold_after_success`` + ``HandOff``: the same webhook delivered again while
    its first run runs. It never runs a second time: not beside it, not after the window."""
    app = app_factory(redislock_ttl=2, redislock_sweep_interval=0.2)

    @app.task(
        base=SingletonTask,
        shared=False,
        lock_args=("payment",),
        lock_on_contention=HandOff(max_wait=600, jitter=0),
        lock_hold_after_success=4,
    )
    def process_payment(payment: str) -> str:
        record.rpush("runs", payment)
        time.sleep(1.5)
        return payment

    with embedded_worker(app, "threads", 2):
        first = process_payment.apply_async(("pay-1",), task_id="webhook-pay-1")
        wait_until(lambda: record.llen("runs") == 1, timeout=20)
        process_payment.apply_async(("pay-1",), task_id="webhook-pay-1")  # redelivered
        assert first.get(timeout=20) == "pay-1"
        # Past the window (4 s) and a sweep: nothing runs it again.
        wait_until(
            lambda: (
                not process_payment._lock_settings().backend.inspect(
                    process_payment.lock_key_for(("pay-1",), {})
                )[0]
            ),
            timeout=20,
        )
        time.sleep(1.0)  # the observation window: a sweep would hand it over now
    assert record.lrange("runs", 0, -1) == ["pay-1"]


def _held_by_another(
    app: Celery, record: redis.Redis, lock_client: redis.Redis, **options: Any
) -> tuple[Any, str, str, str]:
    """A hand-off task (``options`` added) whose key another holder keeps.

    Returns the task, its key for ``("x",)``, the waiters list and the holder's value.
    """
    options = {"lock_on_contention": "handoff", **options}

    @app.task(base=SingletonTask, shared=False, lock_args=(), **options)
    def job(label: str) -> str:
        record.rpush("runs", label)
        return label

    key = job.lock_key_for(("x",), {})
    holder = "v1|holder|0|elsewhere|1|ab|job|0"
    lock_client.set(key, holder, px=60_000)
    return job, key, handoff_keys(key)[0], holder


def test_a_revoked_parked_call_leaves_the_queue_when_a_copy_of_it_arrives(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    """Revoked while parked: its next copy (safety net, woken message) is dropped and withdraws it.

    Left in the queue, the holder's release would hand it the key and publish
    a message only to be dropped again; withdrawn, the release frees the key.
    """
    from celery_redislock.headers import HANDOFF_HEADER

    job, key, waiters, holder = _held_by_another(app, record, lock_client)
    with embedded_worker(app, "threads", 2):
        parked = job.delay("revoked")
        wait_until(lambda: lock_client.llen(waiters) == 1, timeout=20)
        handoff = lock_client.lindex(waiters, 0).decode()
        parked.revoke()
        # Its safety-net copy, as the worker receives it: same id, its hand-off value.
        wait_until(lambda: parked.state == "REVOKED" or _revoked_in_worker(app, parked.id), 10)
        job.apply_async(("revoked",), task_id=parked.id, headers={HANDOFF_HEADER: handoff})
        wait_until(lambda: lock_client.llen(waiters) == 0, timeout=20)
        assert held(lock_client, key) == holder.encode()
        job._lock_settings().backend.release(key, holder)
        assert not lock_client.exists(key)  # not handed to the revoked call
        assert job.delay("later").get(timeout=20) == "later"
    assert record.lrange("runs", 0, -1) == ["later"]


@contextlib.contextmanager
def _revoked_while_parked(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> Iterator[tuple[Any, Any]]:
    """A call parked behind another holder is marked revoked, then handed the key.

    The mark is what a worker that held none of the call's messages writes
    for a revoke. Yields the task and the parked call's result, the worker
    running.
    """
    from celery_redislock.handoff import app_pending

    job, key, waiters, holder = _held_by_another(app, record, lock_client)
    settings = job._lock_settings()
    with embedded_worker(app, "threads", 2):
        parked = job.delay("revoked")
        wait_until(lambda: lock_client.llen(waiters) == 1, timeout=20)
        # Its park has stored RETRY: stored after the copy's REVOKED, it
        # would overwrite it (Celery keeps only SUCCESS; CI saw it once).
        wait_until(lambda: parked.state == "RETRY", timeout=20)
        app_pending(app, settings.backend, settings.app.key_prefix).mark_revoked(parked.id, 60_000)
        settings.backend.release(key, holder)  # hands the key to the parked call, wakes it
        yield job, parked


def test_a_parked_call_revoked_where_no_worker_held_it_never_runs(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    """The revoke's mark, not Celery's memory, withdraws it when a copy arrives (helper-48).

    On quorum queues a parked call's copies wait in the broker: the workers
    the revoke reaches hold none, so they mark the call revoked in the lock
    store; a worker restarted since (Celery keeps revoked ids in memory)
    receives the woken copy without knowing. It must not run: the copy is
    dropped as REVOKED and the key passes on.
    """
    with _revoked_while_parked(app, record, lock_client) as (job, parked):
        wait_until(lambda: parked.state == "REVOKED", timeout=20)
        key = job.lock_key_for(("x",), {})
        wait_until(lambda: not lock_client.exists(key), timeout=20)  # passed on: freed
        assert lock_client.llen(handoff_keys(key)[0]) == 0
        assert job.delay("later").get(timeout=20) == "later"
    assert record.lrange("runs", 0, -1) == ["later"]


class MarkUnreadableOnce(LockStore):
    """A store whose first read of a revoke's mark fails as an unanswered store does."""

    failed: ClassVar[list[str]] = []

    def read_record(self, key: str) -> str | None:
        if key.endswith(":revoked") and not MarkUnreadableOnce.failed:
            MarkUnreadableOnce.failed.append(key)
            raise LockBackendError(f"Redis did not answer reading {key!r} (test)")
        return super().read_record(key)


def test_a_parked_call_whose_revoke_mark_cannot_be_read_is_not_run_for_it(
    app_factory: Any, record: redis.Redis, lock_client: redis.Redis
) -> None:
    """The store fails at the mark's read and answers again after (review helper-50 F1).

    An unreadable mark is a store failure like any other (here: the copy is
    re-sent with backoff and reads it then), not "not revoked": the copy
    that read none was granted the lock and ran.
    """
    MarkUnreadableOnce.failed.clear()
    app = app_factory(redislock_store_class=f"{__name__}:MarkUnreadableOnce")
    with _revoked_while_parked(app, record, lock_client) as (job, parked):
        wait_until(lambda: parked.state == "REVOKED", timeout=30)
        assert MarkUnreadableOnce.failed  # the first copy could not read it
        assert job.delay("later").get(timeout=30) == "later"
    assert record.lrange("runs", 0, -1) == ["later"]


class WithdrawInterrupted(LockStore):
    """A store in whose withdraw (its hand-over's publish) a soft time limit lands once."""

    interrupted: ClassVar[list[str]] = []

    def withdraw(self, key: str, handoff: str, park_ttl_ms: int, limit: int = 1) -> None:
        super().withdraw(key, handoff, park_ttl_ms, limit)
        if not WithdrawInterrupted.interrupted:
            WithdrawInterrupted.interrupted.append(key)
            raise SoftTimeLimitExceeded()


def test_a_soft_time_limit_in_a_revoked_copys_withdraw_is_not_swallowed(
    app_factory: Any, record: redis.Redis, lock_client: redis.Redis
) -> None:
    """Review helper-50 F2: caught with the store's errors, it was logged as a failed withdraw."""
    WithdrawInterrupted.interrupted.clear()
    app = app_factory(redislock_store_class=f"{__name__}:WithdrawInterrupted")
    with _revoked_while_parked(app, record, lock_client) as (job, parked):
        wait_until(lambda: parked.state == "FAILURE", timeout=30)
        assert isinstance(parked.result, SoftTimeLimitExceeded)
        waiters = handoff_keys(job.lock_key_for(("x",), {}))[0]
        assert lock_client.llen(waiters) == 0  # withdrawn before the interruption
        assert job.delay("later").get(timeout=30) == "later"
    assert record.lrange("runs", 0, -1) == ["later"]


def test_a_coalesced_run_interrupted_in_its_withdraw_gives_its_queued_key_back(
    app_factory: Any, record: redis.Redis, lock_client: redis.Redis
) -> None:
    """Review helper-52 F3: the queued key was given back only if the withdraw returned.

    Kept, the next ``delay()`` joined the run that had just ended (it never
    ran) until the enqueue key expired.
    """
    WithdrawInterrupted.interrupted.clear()
    app = app_factory(redislock_store_class=f"{__name__}:WithdrawInterrupted")
    from celery_redislock.handoff import app_pending

    job, key, _, holder = _held_by_another(app, record, lock_client, lock_enqueue="until_start")
    settings = job._lock_settings()
    with embedded_worker(app, "threads", 2):
        parked = job.delay("revoked")
        wait_until(lambda: lock_client.llen(handoff_keys(key)[0]) == 1, timeout=20)
        wait_until(lambda: parked.state == "RETRY", timeout=20)
        assert lock_client.exists(queued_key(key))
        app_pending(app, settings.backend, settings.app.key_prefix).mark_revoked(parked.id, 60_000)
        settings.backend.release(key, holder)
        wait_until(lambda: parked.state == "FAILURE", timeout=30)
        assert isinstance(parked.result, SoftTimeLimitExceeded)
        assert not lock_client.exists(queued_key(key))
        later = job.delay("later")
        assert later.id != parked.id  # published, not joined to the run that ended
        assert later.get(timeout=30) == "later"
    assert record.lrange("runs", 0, -1) == ["later"]


def _revoked_in_worker(app: Celery, task_id: str) -> bool:
    """The worker has recorded the revoke (Celery's in-memory list of revoked ids)."""
    from celery.worker import state

    return task_id in state.revoked


@pytest.mark.parametrize(
    ("policy", "protocol"), [("handoff", 2), ("retry", 2), ("handoff", 1), ("retry", 1)]
)
def test_a_call_sent_with_another_serializer_is_re_sent_with_it(
    app_factory: Any, record: redis.Redis, lock_client: redis.Redis, policy: str, protocol: int
) -> None:
    """``apply_async(serializer="pickle")`` of a json task, its key held: parked or retried.

    The re-sent copy carries what the caller sent (a set, which JSON cannot
    carry): it was packed with the task's serializer, and the call failed
    with EncodeError instead of running.
    """
    from celery_redislock import Retry

    app: Celery = app_factory(accept_content=["json", "pickle"], task_protocol=protocol)
    contention = HandOff(jitter=0.0) if policy == "handoff" else Retry(countdown=0.2, jitter=0)

    @app.task(base=SingletonTask, shared=False, lock_args=("name",), lock_on_contention=contention)
    def job(name: str, payload: Any) -> list[int]:
        record.rpush("runs", name)
        return sorted(payload)

    key = job.lock_key_for(("pickled", []), {})
    holder = "v1|holder|0|elsewhere|1|ab|job|0"
    with embedded_worker(app, "threads", 2):
        lock_client.set(key, holder, px=30_000)
        result = job.apply_async(("pickled", {2, 1}), serializer="pickle")
        if policy == "handoff":
            wait_until(lambda: lock_client.llen(handoff_keys(key)[0]) == 1, timeout=20)
        else:
            wait_until(lambda: result.state == "RETRY", timeout=20)
        job._lock_settings().backend.release(key, holder)
        assert result.get(timeout=20) == [1, 2]
    assert record.lrange("runs", 0, -1) == ["pickled"]


def test_a_coalesced_run_sent_with_another_serializer_runs_once_the_current_one_ends(
    app_factory: Any, record: redis.Redis
) -> None:
    """``lock_enqueue="until_start"``: the queued run, sent with pickle, parks behind the first."""
    app: Celery = app_factory(accept_content=["json", "pickle"])

    @app.task(base=SingletonTask, shared=False, lock_args=("name",), lock_enqueue="until_start")
    def job(name: str, payload: Any) -> list[int]:
        record.rpush("runs", repr(sorted(payload)))
        wait_until(lambda: record.exists("go") or len(payload) > 1, timeout=20)
        return sorted(payload)

    with embedded_worker(app, "threads", 2):
        first = job.apply_async(("c", {0}), serializer="pickle")
        wait_until(lambda: record.llen("runs") == 1, timeout=20)
        queued = job.apply_async(("c", {2, 1}), serializer="pickle")
        record.set("go", 1)
        assert first.get(timeout=20) == [0]
        assert queued.get(timeout=20) == [1, 2]
    assert record.lrange("runs", 0, -1) == ["[0]", "[1, 2]"]
