"""Enqueue-time deduplication (lock_enqueue): one queued-or-running task per key."""

from __future__ import annotations

import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from celery import Celery, chain, group

from celery_redislock import (
    AlreadyQueued,
    HandOff,
    LockContended,
    Retry,
    SingletonTask,
    Wait,
    is_skipped,
    revoked,
)
from celery_redislock.handoff import app_pending
from celery_redislock.keys import queued_key
from celery_redislock.pending import RevocableCall
from celery_redislock.task import QUEUED_TOKEN_HEADER
from celery_redislock.tokens import LockValue
from tests.brokers import QUORUM, RABBITMQ, declare_as_a_worker_would, queue_length
from tests.conftest import LOCK_DB, embedded_worker
from tests.helpers import decoded, hold_lock
from tests.servers import FaultProxy, RedisServer, free_port, wait_until

pytestmark = pytest.mark.worker


def queued(app: Celery) -> int:
    return queue_length(app)


def app_with_a_blocker(app_factory: Any, record: redis.Redis) -> tuple[Celery, Any]:
    """An app whose ``blocker`` task keeps a worker of prefetch 1 busy until ``go`` is set.

    acks_late + prefetch 1: the worker fetches nothing more while it runs.
    """
    app = app_factory(worker_prefetch_multiplier=1)

    @app.task(base=SingletonTask, shared=False, lock_enabled=False, acks_late=True)
    def blocker() -> None:
        wait_until(lambda: record.get("go"), timeout=30)

    return app, blocker


def test_three_concurrent_delays_publish_once_and_share_one_id(
    app: Celery, server: RedisServer, record: redis.Redis, lock_client: redis.Redis
) -> None:
    @app.task(base=SingletonTask, shared=False, lock_enqueue=True)
    def process_payment(webhook_id: str) -> str:
        record.incr("runs")
        return f"processed {webhook_id}"

    barrier = threading.Barrier(3)

    def deliver(_: int) -> Any:
        barrier.wait()
        return process_payment.delay("wh-1")

    with ThreadPoolExecutor(3) as pool:
        handles = list(pool.map(deliver, range(3)))
    assert len({h.id for h in handles}) == 1
    assert queued(app) == 1
    key = process_payment.lock_key_for(("wh-1",), {})
    value = decoded(lock_client.get(key))
    assert value is not None and value.owner.task_id == handles[0].id
    with embedded_worker(app, "threads", 2):
        assert [h.get(timeout=20) for h in handles] == ["processed wh-1"] * 3
    assert record.get("runs") == "1"
    assert lock_client.exists(key) == 0


def test_raise_mode_gives_a_picklable_already_queued(app: Celery, lock_client: redis.Redis) -> None:
    @app.task(base=SingletonTask, shared=False, lock_enqueue=True, lock_enqueue_raise=True)
    def job(n: int) -> None: ...

    first = job.delay(1)
    with pytest.raises(AlreadyQueued) as info:
        job.delay(1)
    error = pickle.loads(pickle.dumps(info.value))
    assert error.holder_task_id == first.id and error.key == job.lock_key_for((1,), {})
    assert error.ttl_remaining is not None and error.ttl_remaining > 500
    assert job.delay(2).id != first.id  # other arguments are not duplicates


def test_the_worker_adopts_the_queued_lock(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False, lock_enqueue=True, lock_ttl=7)
    def job(self: Any) -> None:
        value = decoded(lock_client.get(self.lock.key))
        assert value is not None
        record.set("owner", f"{value.owner.task_id}|{value.owner.hostname}")
        record.set("pttl", lock_client.pttl(self.lock.key))

    result = job.delay()
    with embedded_worker(app, "prefork", 1):
        result.get(timeout=20)
    task_id, host = record.get("owner").split("|")
    assert task_id == result.id and host != "<queued>"  # the running value replaced the queued one
    assert 0 < int(record.get("pttl")) <= 7000  # the run TTL, not the queue TTL


def test_publish_failure_leaves_no_lock(
    app_factory: Any, redis_server_factory: Any, lock_client: redis.Redis
) -> None:
    dead_broker: RedisServer = redis_server_factory()
    app = app_factory(
        broker_url=dead_broker.url,
        task_publish_retry=False,
        broker_connection_timeout=0.5,
        broker_transport_options={"socket_connect_timeout": 0.5, "socket_timeout": 0.5},
    )

    @app.task(base=SingletonTask, shared=False, lock_enqueue=True)
    def job(n: int) -> None: ...

    dead_broker.kill()
    with pytest.raises(Exception):  # noqa: B017  (kombu's OperationalError or a redis error)
        job.delay(1)
    assert lock_client.exists(job.lock_key_for((1,), {})) == 0


def test_expired_before_start_frees_the_key(
    app_factory: Any, record: redis.Redis, lock_client: redis.Redis
) -> None:
    app, blocker = app_with_a_blocker(app_factory, record)

    @app.task(base=SingletonTask, shared=False, lock_enqueue=True)
    def job(n: int) -> int:
        return n

    with embedded_worker(app, "threads", 1):
        busy = blocker.delay()
        first = job.apply_async((1,), expires=0.2)
        key = job.lock_key_for((1,), {})
        queued_for = lock_client.pttl(key)
        assert queued_for > 0
        wait_until(lambda: lock_client.pttl(key) < queued_for - 300, timeout=5)  # past expiry
        record.set("go", 1)
        busy.get(timeout=20)
        wait_until(lambda: lock_client.exists(key) == 0, timeout=20, message="expired task's key")
        # The worker revokes an expired message it receives; RabbitMQ drops it
        # itself (Celery sets its expiration), so no worker ever sees it: the
        # key then frees itself when the message expires. The key is freed
        # before REVOKED is stored.
        expected = "PENDING" if RABBITMQ else "REVOKED"
        wait_until(lambda: first.state == expected, timeout=10, message=expected)
        assert job.delay(1).get(timeout=20) == 1


@pytest.mark.parametrize("enqueue", [True, "until_start"])
def test_a_call_made_after_a_revoke_of_a_queued_call_is_published_at_once(
    app_factory: Any, record: redis.Redis, lock_client: redis.Redis, enqueue: Any
) -> None:
    # The revoked message still waits in the queue (acks_late + prefetch 1,
    # the blocker runs): no worker holds it to give its key back yet.
    app, blocker = app_with_a_blocker(app_factory, record)

    @app.task(base=SingletonTask, shared=False, lock_enqueue=enqueue)
    def job(n: int) -> int:
        record.incr("runs")
        return n

    with embedded_worker(app, "threads", 1):
        busy = blocker.delay()
        first = job.delay(1)
        assert job.delay(1).id == first.id
        assert app.control.revoke(first.id, reply=True, timeout=5)  # the worker knows
        second = job.delay(1)
        assert second.id != first.id  # published, not joined to the revoked call
        assert job.delay(1).id == second.id  # and the next calls join it
        record.set("go", 1)
        busy.get(timeout=20)
        assert second.get(timeout=20) == 1
        wait_until(lambda: first.state == "REVOKED", timeout=20, message="REVOKED stored")
        key = job.lock_key_for((1,), {})
        wait_until(lambda: lock_client.exists(key, queued_key(key)) == 0, timeout=10)
    assert record.get("runs") == "1"


def test_a_call_after_a_revoked_run_handed_its_key_to_a_discarded_retry_is_published(
    app_factory: Any, record: redis.Redis, lock_client: redis.Redis
) -> None:
    """Revoked while it runs, it retries; Celery discards the retry (review helper-33 F3).

    The run hands its key to the retry (for the enqueue TTL + the countdown)
    after the retry was discarded: the mark of the revoke must outlive the
    enqueue TTL.
    """
    app = app_factory(redislock_enqueue_ttl=2)

    @app.task(base=SingletonTask, bind=True, shared=False, lock_enqueue=True)
    def job(self: Any, n: int) -> int:
        record.rpush("attempts", self.request.retries)
        if record.setnx("retried", 1):  # the first call only
            wait_until(lambda: record.get("revoked"), timeout=20)
            try:
                raise self.retry(countdown=30)
            finally:  # the retry is discarded before this run hands it the key
                if not QUORUM:  # there the countdown waits in the broker
                    wait_until(lambda: job.AsyncResult(self.request.id).state == "REVOKED")
        return n

    key = job.lock_key_for((1,), {})
    with embedded_worker(app, "threads", 2):
        first = job.delay(1)
        wait_until(lambda: record.llen("attempts") == 1, timeout=20)
        assert app.control.revoke(first.id, reply=True, timeout=5)
        record.set("revoked", 1)
        # The run handed the key to its retry, for the enqueue TTL + the 30 s
        # countdown; then wait past the enqueue TTL.
        wait_until(
            lambda: b"%3Cqueued%3E" in (lock_client.get(key) or b""),
            timeout=30,
            message="the hand-over to the retry",
        )
        wait_until(lambda: 0 < lock_client.pttl(key) < 32_000 - 2_500, timeout=10)
        second = job.delay(1)
        assert second.id != first.id
        assert second.get(timeout=20) == 1
    assert record.lrange("attempts", 0, -1) == ["0", "0"]


@pytest.mark.skipif(RABBITMQ, reason="RabbitMQ drops an expired message itself")
# Not "until_start": a coalesced call that may expire takes no key (it is
# published as a run of its own: tests/worker/test_coalesce_expiry.py).
@pytest.mark.parametrize("enqueue", [True])
def test_an_expired_call_frees_its_key_before_revoked_is_stored(
    app_factory: Any,
    record: redis.Redis,
    lock_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    enqueue: Any,
) -> None:
    # A call made once the result says REVOKED must be published, never
    # joined to the run that will not happen.
    app, blocker = app_with_a_blocker(app_factory, record)

    @app.task(base=SingletonTask, shared=False, lock_enqueue=enqueue)
    def job(n: int) -> int:
        return n

    key = job.lock_key_for((1,), {})
    if enqueue == "until_start":
        key = queued_key(key)
    held_at_revoked: list[int] = []
    # Each thread has a backend of its own (app.backend): observe its class.
    backend_class = type(app.backend)
    mark_as_revoked = backend_class.mark_as_revoked

    def observed(backend: Any, *args: Any, **kwargs: Any) -> Any:
        held_at_revoked.append(lock_client.exists(key))
        return mark_as_revoked(backend, *args, **kwargs)

    monkeypatch.setattr(backend_class, "mark_as_revoked", observed)
    with embedded_worker(app, "threads", 1):
        busy = blocker.delay()
        first = job.apply_async((1,), expires=0.2)
        queued_for = lock_client.pttl(key)
        assert queued_for > 0
        wait_until(lambda: lock_client.pttl(key) < queued_for - 300, timeout=5)  # past expiry
        record.set("go", 1)
        busy.get(timeout=20)
        wait_until(lambda: first.state == "REVOKED", timeout=20, message="REVOKED stored")
        assert held_at_revoked == [0]
        second = job.delay(1)
        assert second.id != first.id
        assert second.get(timeout=20) == 1


def test_retry_keeps_ownership_and_is_delivered(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False, lock_enqueue=True)
    def job(self: Any, n: int) -> int:
        record.rpush("attempts", self.request.retries)
        if self.request.retries == 0:
            raise self.retry(countdown=1.5)
        return int(self.request.retries)

    key = job.lock_key_for((1,), {})
    with embedded_worker(app, "threads", 2):
        first = job.delay(1)
        wait_until(lambda: record.llen("attempts") == 1, timeout=20)
        wait_until(lambda: app.AsyncResult(first.id).state == "RETRY", timeout=10)
        # During the retry countdown the key still belongs to this task.
        assert job.delay(1).id == first.id
        assert first.get(timeout=20) == 1
    assert record.lrange("attempts", 0, -1) == ["0", "1"]
    assert lock_client.exists(key) == 0


def test_countdown_longer_than_the_queue_ttl_is_covered(
    app: Celery, lock_client: redis.Redis
) -> None:
    @app.task(base=SingletonTask, shared=False, lock_enqueue=True, lock_enqueue_ttl=1)
    def job(n: int) -> int:
        return n

    declare_as_a_worker_would(app)  # no worker ran yet: on quorum queues, the delay queues
    first = job.apply_async((1,), countdown=5)
    key = job.lock_key_for((1,), {})
    assert lock_client.pttl(key) > 5000  # queue TTL 1 s + the 5 s countdown
    assert job.delay(1).id == first.id


def test_hold_after_success_drops_a_late_duplicate(app: Celery, record: redis.Redis) -> None:
    @app.task(base=SingletonTask, shared=False, lock_enqueue=True, lock_hold_after_success=60)
    def webhook(event_id: str) -> str:
        record.incr("runs")
        return f"handled {event_id}"

    @app.task(base=SingletonTask, shared=False, lock_enqueue=True)
    def no_window(event_id: str) -> str:
        record.incr("runs-no-window")
        return event_id

    with embedded_worker(app, "threads", 2):
        first = webhook.delay("evt")
        assert first.get(timeout=20) == "handled evt"
        late = webhook.delay("evt")  # the provider's redelivery, after success
        assert late.id == first.id and late.get(timeout=20) == "handled evt"
        assert no_window.delay("x").get(timeout=20) == "x"
        assert no_window.delay("x").get(timeout=20) == "x"
    assert record.get("runs") == "1"
    assert record.get("runs-no-window") == "2"


@pytest.mark.parametrize("lock_enqueue", [True, False])
def test_the_longest_idempotency_window_a_setting_takes_works_end_to_end(
    app: Celery, record: redis.Redis, lock_client: redis.Redis, lock_enqueue: bool
) -> None:
    """``MAX_SECONDS`` (about 317 years): every script that keeps the key takes its milliseconds."""
    from celery_redislock.validators import MAX_SECONDS

    @app.task(
        base=SingletonTask,
        shared=False,
        lock_enqueue=lock_enqueue,
        lock_hold_after_success=MAX_SECONDS,
        lock_ttl=MAX_SECONDS,
    )
    def once_ever(event_id: str) -> str:
        record.incr("runs")
        return event_id

    with embedded_worker(app, "threads", 2):
        assert once_ever.delay("evt").get(timeout=20) == "evt"
        again = once_ever.delay("evt").get(timeout=20)
        assert again == "evt" if lock_enqueue else is_skipped(again)
    assert record.get("runs") == "1"
    assert lock_client.pttl(once_ever.lock_key_for(("evt",), {})) > (MAX_SECONDS - 60) * 1000


def test_canvas_members_are_published_and_complete(app: Celery, record: redis.Redis) -> None:
    @app.task(
        base=SingletonTask,
        shared=False,
        lock_enqueue=True,
        lock_on_contention=Retry(countdown=0.1, jitter=0.1),
    )
    def step(n: int) -> int:
        record.incr("steps")
        return n + 1

    @app.task(shared=False)
    def total(values: list[int]) -> int:
        return sum(values)

    with embedded_worker(app, "threads", 3):
        # Identical group members: all published, none dropped, group completes.
        assert group(step.s(1) for _ in range(3)).apply_async().get(timeout=30) == [2, 2, 2]
        # A task carrying the rest of a chain is published, so the chain runs.
        assert chain(step.s(1), step.s(), step.s()).apply_async().get(timeout=30) == 4
        assert (group(step.s(n) for n in range(3)) | total.s()).apply_async().get(timeout=30) == 6
    assert int(record.get("steps")) == 3 + 3 + 3


@pytest.mark.parametrize("shape", ["chain", "replace", "link"])
@pytest.mark.parametrize(
    "options",
    [
        {"lock_enqueue": True, "lock_hold_after_success": 60},
        {"lock_enqueue": "until_start"},
        {"lock_debounce": 2},
    ],
    ids=["idempotency_window", "coalescing", "debounce"],
)
def test_celerys_own_sends_of_a_workflow_member_are_published_whatever_its_key_holds(
    app: Celery, record: redis.Redis, options: dict[str, Any], shape: str
) -> None:
    """Celery's own sends are members: a chain's last (``chain=[]``), a replacement, a callback.

    The caller waits on the id Celery gave it: joined to another run, it
    would stay PENDING for ever.
    """

    @app.task(base=SingletonTask, shared=False, lock_args=("account",), **options)
    def settle(account: int, label: str = "") -> str:
        record.rpush("runs", label)
        if label == "running":
            time.sleep(2)  # the work: a coalesced call meanwhile queues the next run
        return f"settled {account}"

    @app.task(shared=False)
    def first() -> str:
        return "first"

    @app.task(shared=False, bind=True)
    def router(self: Any) -> Any:
        return self.replace(settle.si(1, "chained"))

    def start_workflow() -> Any:
        if shape == "chain":
            return chain(first.si(), settle.si(1, "chained")).apply_async()
        if shape == "replace":
            return chain(first.si(), router.si()).apply_async()
        callback = settle.si(1, "chained")
        callback.freeze()
        first.apply_async(link=callback)
        return app.AsyncResult(callback.id)

    with embedded_worker(app, "threads", 3):
        if "lock_hold_after_success" in options:
            # A success keeps the key: a later delay() joins it, a chain member must not.
            assert settle.delay(1, "alone").get(timeout=20) == "settled 1"
        elif "lock_enqueue" in options:
            settle.delay(1, "running")
            wait_until(lambda: record.lrange("runs", 0, -1) == ["running"], timeout=10)
            settle.delay(1, "queued")  # the next run: later calls join it
        else:
            settle.delay(1, "alone")  # a debounce burst is open for 2 s
        outcome = start_workflow().get(timeout=20)
    # Run, or skipped at run time (the idempotency window): never left unpublished.
    assert outcome == "settled 1" or is_skipped(outcome), outcome
    if "lock_hold_after_success" not in options:
        assert "chained" in record.lrange("runs", 0, -1)


def test_calls_made_in_a_task_body_are_deduplicated_like_any_other(
    app: Celery, record: redis.Redis
) -> None:
    """Celery adds ``parent_id`` to them after ``apply_async``: they are not workflow sends."""

    @app.task(base=SingletonTask, shared=False, lock_args=("account",), lock_enqueue=True)
    def settle(account: int) -> str:
        # Not done before the body's last call: a finished run frees the key
        # (the other pool thread may run it at once: 2 ids on RabbitMQ in CI).
        wait_until(lambda: record.get("fanned"), timeout=20)
        record.rpush("runs", account)
        return f"settled {account}"

    @app.task(shared=False)
    def fan_out() -> list[str]:
        ids = [settle.delay(1).id, settle.apply_async((1,)).id, settle.s(1).delay().id]
        record.set("fanned", 1)
        return ids

    with embedded_worker(app, "threads", 2):
        ids = fan_out.delay().get(timeout=20)
        assert len(set(ids)) == 1
        assert app.AsyncResult(ids[0]).get(timeout=20) == "settled 1"
    assert record.lrange("runs", 0, -1) == ["1"]


def test_beat_runs_skip_even_when_the_task_retries(app: Celery, lock_client: redis.Redis) -> None:
    @app.task(base=SingletonTask, shared=False, lock_on_contention="retry")
    def nightly() -> str:
        return "ran"

    hold_lock(lock_client, nightly, ttl=30)
    with embedded_worker(app, "threads", 2):
        assert is_skipped(nightly.apply_async(headers={"celery_beat_task": True}).get(timeout=20))


def test_send_task_is_still_protected_at_run_time(app: Celery, record: redis.Redis) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False, lock_enqueue=True, name="enq.job")
    def job(self: Any) -> str:
        record.set("started", 1)
        wait_until(lambda: record.get("go"), timeout=30)
        return "first"

    with embedded_worker(app, "threads", 2):
        first = job.delay()
        wait_until(lambda: record.get("started"), timeout=20)
        assert is_skipped(app.send_task("enq.job").get(timeout=20))  # bypassed apply_async
        record.set("go", 1)
        assert first.get(timeout=20) == "first"


def test_token_header_of_another_task_is_not_adopted(app: Celery, lock_client: redis.Redis) -> None:
    @app.task(base=SingletonTask, shared=False, lock_enqueue=True)
    def job() -> str:
        return "ran"

    _, value = hold_lock(lock_client, job, holder_task_id="someone-else", ttl=30)
    # A message forging another task's queued value must not take its lock.
    result = job.apply(headers={QUEUED_TOKEN_HEADER: value})
    assert is_skipped(result.get())


@pytest.mark.parametrize(
    "policy", [Retry(jitter=0.2), Wait(timeout=0.1, then=Retry(jitter=0.2))], ids=["retry", "wait"]
)
def test_a_lock_retry_is_published_even_while_the_key_is_held(
    app: Celery, record: redis.Redis, policy: Any
) -> None:
    """A contended duplicate's re-send goes through apply_async: it must not be deduplicated."""

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="enq.retried",
        lock_enqueue=True,
        lock_ttl=3,
        lock_on_contention=policy,
    )
    def job(self: Any) -> str:
        record.rpush("runs", self.request.id)
        if record.get("hold") is None:
            record.set("hold", 1)
            wait_until(lambda: record.get("go"), timeout=30)
        return self.request.id

    with embedded_worker(app, "threads", 2):
        holder = job.delay()
        wait_until(lambda: record.get("hold"), timeout=20)
        duplicate = app.send_task("enq.retried")  # bypasses apply_async: no enqueue lock
        wait_until(lambda: app.AsyncResult(duplicate.id).state == "RETRY", timeout=20)
        threading.Timer(2.0, lambda: record.set("go", 1)).start()
        assert holder.get(timeout=20) == holder.id
        assert duplicate.get(timeout=20) == duplicate.id  # re-sent, then ran once
    assert record.lrange("runs", 0, -1) == [holder.id, duplicate.id]


def test_a_naive_eta_is_read_as_utc_as_celery_reads_it(
    app: Celery, lock_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datetime
    import time

    @app.task(base=SingletonTask, shared=False, lock_enqueue=True, lock_enqueue_ttl=10)
    def job(n: int) -> int:
        return n

    declare_as_a_worker_would(app)  # no worker ran yet: on quorum queues, the delay queues
    monkeypatch.setenv("TZ", "Asia/Tokyo")  # local time 9 h ahead of UTC
    time.tzset()
    try:
        eta = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)
        job.apply_async((1,), eta=eta + datetime.timedelta(seconds=120))
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    # Celery runs it 120 s from now: the queued key must last that long too.
    assert lock_client.pttl(job.lock_key_for((1,), {})) > (10 + 110) * 1000


def test_a_release_retried_after_a_hand_over_reports_released(lock_client: redis.Redis) -> None:
    """The first attempt's reply was lost after it handed the key over."""
    from celery_redislock.store import LockStore, ReleaseOutcome

    backend = LockStore.for_client(lock_client)
    assert backend.acquire("handed", "running-value", 30_000).acquired
    assert backend.release("handed", "running-value", "queued-value", 30_000) == (
        ReleaseOutcome.RELEASED
    )
    # The same release sent again (a client retry) finds the hand-over done.
    assert backend.release("handed", "running-value", "queued-value", 30_000) == (
        ReleaseOutcome.RELEASED
    )
    assert lock_client.get("handed") == b"queued-value"


def test_a_retry_with_other_arguments_does_not_hand_the_old_key_to_itself(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False, lock_enqueue=True)
    def step(self: Any, n: int) -> int:
        record.rpush("runs", f"{n}:{self.request.retries}")
        if self.request.retries == 0:
            # Celery's retry with new arguments (its own re-send: on quorum
            # queues Celery refuses a countdown under a second).
            raise self.retry(args=(n + 100,), countdown=1 if QUORUM else 0.2)
        return n

    with embedded_worker(app, "threads", 2):
        first = step.delay(1)
        assert first.get(timeout=20) == 101
        assert lock_client.exists(step.lock_key_for((1,), {})) == 0
        again = step.delay(1)
        assert again.id != first.id and again.get(timeout=20) == 101
    assert record.lrange("runs", 0, -1) == ["1:0", "101:1", "1:0", "101:1"]


def test_a_late_enqueue_lock_after_a_failed_publish_is_taken_back(
    app_factory: Any, redis_server_factory: Any
) -> None:
    """The lock store froze (the acquire gave up, its script ran later) and the broker was down."""
    store: RedisServer = redis_server_factory()
    dead_broker: RedisServer = redis_server_factory()
    app = app_factory(
        broker_url=dead_broker.url,
        redislock_url=store.url,
        redislock_redis_options={"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
        task_publish_retry=False,
        broker_connection_timeout=0.5,
        broker_transport_options={"socket_connect_timeout": 0.5, "socket_timeout": 0.5},
    )

    @app.task(base=SingletonTask, shared=False, lock_enqueue=True)
    def job(n: int) -> None: ...

    dead_broker.kill()
    with pytest.raises(Exception):  # noqa: B017  (warms the lock-store connection up)
        job.delay(2)
    key = job.lock_key_for((1,), {})
    store.pause()
    try:
        with pytest.raises(Exception):  # noqa: B017  (kombu's OperationalError)
            job.delay(1)
    finally:
        store.resume()  # the frozen acquire's script runs now
    locks = store.client()
    wait_until(lambda: locks.exists(key) == 0, timeout=30, message="the phantom queued key")


def test_a_late_enqueue_lock_after_a_successful_publish_is_taken_back(
    app_factory: Any, server: RedisServer, record: redis.Redis
) -> None:
    """The producer's acquire times out, the task is published and runs; then the acquire lands."""
    proxy = FaultProxy(server.port)
    try:
        producer = app_factory(
            redislock_url=f"{proxy.url}/{LOCK_DB}",
            redislock_redis_options={"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
        )
        worker_app = app_factory()  # the worker reaches the lock store directly

        def report(n: int) -> int:
            record.rpush("runs", n)
            return n

        options = {"base": SingletonTask, "shared": False, "name": "late.report"}
        produce = producer.task(lock_enqueue=True, **options)(report)
        worker_app.task(lock_enqueue=True, **options)(report)
        key = produce.lock_key_for((1,), {})
        with embedded_worker(worker_app, "threads", 1):
            assert produce.delay(0).get(timeout=20) == 0  # connections open
            proxy.blackhole()  # the producer's packets to the lock store are held up
            first = produce.delay(1)  # published without its enqueue lock
            assert first.get(timeout=20) == 1
            proxy.heal_and_flush()  # the held acquire reaches Redis now
            locks = server.client(LOCK_DB)
            locks.ping()  # queued behind it
            wait_until(lambda: locks.exists(key) == 0, timeout=20, message="the late token")
            again = produce.delay(1)
            assert again.id != first.id and again.get(timeout=20) == 1
    finally:
        proxy.close()


def test_the_take_back_of_a_failed_enqueue_never_frees_a_retrys_hand_off(
    app_factory: Any, redis_server_factory: Any, record: redis.Redis
) -> None:
    """Published without its enqueue lock (store restarting), the task runs and
    calls self.retry(): the key it hands to its queued retry must survive the
    background take-back of the failed enqueue's token."""
    store: RedisServer = redis_server_factory()
    app: Celery = app_factory(
        redislock_url=store.url,
        redislock_redis_options={"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
    )

    @app.task(base=SingletonTask, bind=True, shared=False, lock_enqueue=True)
    def sync(self: Any, account: int) -> str:
        record.rpush("runs", f"{self.request.id}:{self.request.retries}")
        if self.request.retries == 0:
            raise self.retry(countdown=8)
        return f"synced {account}"

    key = sync.lock_key_for((7,), {})
    locks = store.client()
    with embedded_worker(app, "threads", 2):
        store.stop()  # restarting: the enqueue acquire fails
        first = sync.delay(7)  # published without its enqueue lock
        store.start()
        wait_until(lambda: record.llen("runs") == 1, timeout=20, message="the first run")
        wait_until(lambda: locks.exists(key) == 1, timeout=10, message="the hand-off")
        # Through the take-back's attempts at 0.5, 1.5 and 3.5 s: the key stays.
        wait_until(
            lambda: record.llen("runs") == 2 or locks.exists(key) == 0,
            timeout=20,
            message="the retry or a freed key",
        )
        assert record.llen("runs") == 2 or locks.exists(key) == 1, "freed during the countdown"
        again = sync.delay(7)
        assert first.get(timeout=30) == "synced 7"
        assert again.id == first.id or again.get(timeout=30) == "synced 7"
    assert [run.split(":")[0] for run in record.lrange("runs", 0, -1)[:2]] == [first.id] * 2


def test_coalesced_and_debounced_calls_take_every_option_celery_takes(app: Celery) -> None:
    """Their message is kept in the lock store: objects of this process are not kept, but allowed.

    A kombu ``Queue``/``Exchange`` is kept by name; a producer or connection
    only serves this publish.
    """
    from kombu import Exchange, Queue

    @app.task(base=SingletonTask, shared=False, lock_enqueue="until_start")
    def coalesced(n: str) -> None: ...

    @app.task(base=SingletonTask, shared=False, lock_debounce=5)
    def debounced(n: str) -> None: ...

    declare_as_a_worker_would(app)  # a debounced call is a countdown message
    tests_queue = Queue("tests", Exchange("tests"), "tests")
    published = 0
    for task in (coalesced, debounced):
        with app.connection_for_write() as connection, app.producer_or_acquire() as producer:
            task.apply_async(("producer",), producer=producer)
            task.apply_async(("connection",), connection=connection)
        task.apply_async(("queue",), queue=tests_queue)
        task.apply_async(("exchange",), exchange=Exchange("tests"), routing_key="tests")
        published += 4
    wait_until(lambda: queue_length(app) == published, timeout=10)


def test_a_stored_copy_expires_when_the_call_does(app: Celery) -> None:
    """``expires`` in seconds is made absolute: a sweep's copy published later expires on time."""
    from datetime import datetime, timedelta, timezone

    from celery_redislock.handoff import stored_message, unpack_message

    @app.task(base=SingletonTask, shared=False, lock_enqueue="until_start")
    def coalesced(n: str) -> None: ...

    before = datetime.now(timezone.utc)
    _, message = stored_message(coalesced, ("x",), {}, "id-1", {"expires": 60}, {})
    expires = datetime.fromisoformat(unpack_message(message)["options"]["expires"])
    assert (
        before + timedelta(seconds=59)
        < expires
        <= datetime.now(timezone.utc) + timedelta(seconds=60)
    )


#: On quorum queues Celery keeps a countdown's message in RabbitMQ's delay
#: exchanges (native delayed delivery), not in a worker: a revoke then frees
#: its keys when it arrives, at its ETA (docs/_parts/brokers.md).
held_by_the_broker = pytest.mark.skipif(
    QUORUM, reason="on quorum queues a countdown's message waits in the broker, not a worker"
)


def _scheduled(app: Celery, task_id: str) -> bool:
    """True once a worker holds ``task_id`` for its countdown (Celery's ``inspect scheduled``)."""
    replies = app.control.inspect(timeout=1).scheduled() or {}
    return any(entry["request"]["id"] == task_id for rows in replies.values() for entry in rows)


@pytest.mark.parametrize("mode", ["until_done", "until_start", "debounce"])
def test_a_task_revoked_during_its_countdown_frees_its_key_at_once(
    app_factory: Any, record: redis.Redis, mode: str
) -> None:
    """Not when its countdown ends: calls meanwhile would join a run that never comes."""
    app = app_factory()
    options: dict[str, Any] = (
        {"lock_debounce": 60} if mode == "debounce" else {"lock_enqueue": mode}
    )

    @app.task(base=SingletonTask, shared=False, lock_args=("account",), **options)
    def recompute(account: int) -> int:
        record.rpush("runs", account)
        return account

    with embedded_worker(app, "threads", 2):
        if mode == "debounce":
            revoked = recompute.delay(1)  # its countdown is the 60 s window
        else:
            revoked = recompute.apply_async((1,), countdown=60)
        if not QUORUM:  # there the message waits in the broker's delay queues
            wait_until(lambda: _scheduled(app, revoked.id), timeout=20)
        assert app.control.revoke(revoked.id, reply=True, timeout=5)
        later = recompute.delay(1)
        assert later.id != revoked.id  # published (or a new burst), not joined to the revoked run
        if mode != "debounce":
            assert later.get(timeout=20) == 1
            assert record.lrange("runs", 0, -1) == ["1"]
        else:
            later.revoke()


def test_a_revoke_record_is_left_to_a_worker_that_knows_the_task(
    app_factory: Any, lock_client: redis.Redis
) -> None:
    """Every worker gets a revoke: one of another group (same app name) must not drop it."""
    app = app_factory()
    other = app_factory()
    other.main = app.main  # another worker group of the same app, without this task

    @app.task(base=SingletonTask, shared=False, lock_args=("account",), lock_enqueue=True)
    def recompute(account: int) -> int:
        return account

    @other.task(base=SingletonTask, shared=False)
    def unrelated() -> None:
        return None

    key = recompute.lock_key_for((1,), {})
    token = LockValue.queued("t-1", recompute.name).encode()
    assert lock_client.set(key, token, px=60_000)
    settings = recompute.lock_settings()
    index = app_pending(app, settings.backend, settings.app.key_prefix)
    index.keep_revocable("t-1", RevocableCall(recompute.name, key, token, False), 60_000)

    revoked._give_back_recorded(other, "t-1")  # does not know recompute: leaves it all
    assert lock_client.get(key) == token.encode()
    assert index.read_revocable("t-1") is not None
    revoked._give_back_recorded(app, "t-1")
    assert lock_client.exists(key) == 0
    assert index.read_revocable("t-1") is None


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_task_revoked_while_its_retry_waits_for_its_countdown_frees_its_key(
    app_factory: Any, record: redis.Redis, pool: str
) -> None:
    """The retried copy shares the task id; Celery forgets it by id when the first attempt ends."""
    app = app_factory()

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_args=("account",), lock_enqueue=True
    )
    def recompute(self: Any, account: int) -> int:
        record.rpush("runs", self.request.retries)
        if self.request.retries == 0 and record.incr("retried") == 1:
            raise self.retry(countdown=60)
        return account

    with embedded_worker(app, pool, 2):
        first = recompute.delay(1)
        if QUORUM:  # the retry waits in the broker: revoke once the first attempt ended
            wait_until(lambda: first.state == "RETRY", timeout=20)
        else:
            wait_until(lambda: _scheduled(app, first.id), timeout=20)
        assert app.control.revoke(first.id, reply=True, timeout=5)
        later = recompute.delay(1)
        assert later.id != first.id  # published, not joined to the revoked retry
        assert later.get(timeout=20) == 1


@held_by_the_broker
@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_coalesced_run_revoked_after_it_parked_lets_the_next_call_publish(
    app_factory: Any, record: redis.Redis, lock_client: redis.Redis, pool: str
) -> None:
    """Its safety-net copy (same id, a countdown) is what the worker holds: found by the revoke."""
    app = app_factory()

    @app.task(base=SingletonTask, shared=False, lock_args=("account",), lock_enqueue="until_start")
    def recompute(account: int, label: str) -> str:
        record.rpush("runs", label)
        if label == "running":
            wait_until(lambda: record.get("go"), timeout=30)
        return label

    with embedded_worker(app, pool, 2):
        running = recompute.delay(1, "running")
        wait_until(lambda: record.llen("runs") == 1, timeout=20)
        parked = recompute.delay(1, "parked")
        waiters = b"*:waiters"
        wait_until(lambda: any(lock_client.llen(k) for k in lock_client.scan_iter(waiters)))
        assert app.control.revoke(parked.id, reply=True, timeout=5)
        later = recompute.delay(1, "later")
        assert later.id != parked.id  # published: the revoked run gave its queued key back
        record.set("go", 1)
        assert running.get(timeout=20) == "running"
        assert later.get(timeout=20) == "later"
    assert record.lrange("runs", 0, -1) == ["running", "later"]


def test_a_coalesced_call_whose_slow_publish_failed_after_a_sweep_copied_it_is_reported_published(
    app_factory: Any, record: redis.Redis, lock_client: redis.Redis
) -> None:
    """The sweep cannot tell a slow publish from a dead worker: the call runs, so delay() says so.

    Before: delay() raised, and the call ran anyway (the sweep's copy).
    """
    app = app_factory(redislock_ttl=1, redislock_sweep_interval=0.1)

    @app.task(base=SingletonTask, shared=False, lock_args=("account",), lock_enqueue="until_start")
    def recompute(account: int) -> int:
        record.rpush("runs", account)
        return account

    with embedded_worker(app, "threads", 2):
        nowhere = app.connection_for_write(f"redis://127.0.0.1:{free_port()}/0")
        policy = {"max_retries": 3, "interval_start": 1, "interval_step": 0, "interval_max": 1}
        slow = recompute.apply_async((1,), connection=nowhere, retry=True, retry_policy=policy)
        assert slow.get(timeout=20) == 1  # the sweep's copy, under the call's own id
        wait_until(lambda: lock_client.exists(recompute.lock_key_for((1,), {})) == 0, timeout=10)
    assert record.lrange("runs", 0, -1) == ["1"]


@pytest.mark.skipif(RABBITMQ, reason="makes a Redis broker refuse writes")
def test_a_coalesced_call_whose_publish_and_sweep_copy_both_failed_raises_and_is_not_joined(
    app_factory: Any, redis_server_factory: Any, record: redis.Redis
) -> None:
    """A copy the sweep claimed but could not publish is no proof that the call runs (review)."""
    broker: RedisServer = redis_server_factory()
    app = app_factory(
        broker_url=broker.url_for(0),
        redislock_ttl=1,
        redislock_sweep_interval=0.1,
        redislock_enqueue_ttl=6,
    )

    @app.task(base=SingletonTask, shared=False, lock_args=("account",), lock_enqueue="until_start")
    def recompute(account: int) -> int:
        record.rpush("runs", account)
        return account

    with embedded_worker(app, "threads", 2):
        refusing = broker.client()
        refusing.config_set("maxmemory-policy", "noeviction")
        refusing.config_set("maxmemory", 1)  # every publish fails (OOM), the sweep's too
        nowhere = app.connection_for_write(f"redis://127.0.0.1:{free_port()}/0")
        policy = {"max_retries": 3, "interval_start": 1, "interval_step": 0, "interval_max": 1}
        with pytest.raises(Exception):  # noqa: B017  (kombu's OperationalError)
            recompute.apply_async((1,), connection=nowhere, retry=True, retry_policy=policy)
        refusing.config_set("maxmemory", 0)
        later = recompute.delay(1)  # published, not joined to a call that never runs
        assert later.get(timeout=20) == 1
    assert record.lrange("runs", 0, -1) == ["1"]


def test_a_coalesced_run_that_gave_up_parking_lets_the_next_call_publish(
    app_factory: Any, record: redis.Redis, lock_client: redis.Redis
) -> None:
    """Its queued key goes with it: later calls publish, instead of joining a run that ended."""
    app = app_factory(redislock_ttl=2)

    @app.task(
        base=SingletonTask,
        shared=False,
        lock_args=("account",),
        lock_enqueue="until_start",
        lock_on_contention=HandOff(max_wait=1, jitter=0),
    )
    def recompute(account: int, label: str) -> str:
        record.rpush("runs", label)
        if label == "running":
            wait_until(lambda: record.get("go"), timeout=30)
        return label

    with embedded_worker(app, "threads", 2):
        running = recompute.delay(1, "running")
        wait_until(lambda: record.llen("runs") == 1, timeout=20)
        gave_up = recompute.delay(1, "gave up")
        with pytest.raises(LockContended):  # its copy came back past max_wait: HandOff's Raise
            gave_up.get(timeout=30)
        later = recompute.delay(1, "later")
        assert later.id != gave_up.id  # published, not joined to the run that ended
        record.set("go", 1)
        assert running.get(timeout=20) == "running"
        assert later.get(timeout=20) == "later"
    assert record.lrange("runs", 0, -1) == ["running", "later"]
