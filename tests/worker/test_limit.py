"""``lock_limit=N``: at most N executions per key, in real workers."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import (
    ConfigurationError,
    LockContended,
    Retry,
    SingletonTask,
    Wait,
    is_skipped,
    lock_lost,
)
from celery_redislock.admin import LockInventory
from celery_redislock.cli import _COLUMNS, _row
from celery_redislock.keys import slot_key, task_key
from celery_redislock.lease import LockHandle
from celery_redislock.renewer import renewer
from celery_redislock.settings import app_settings
from celery_redislock.tokens import LockOwner, LockValue
from tests.conftest import LOCK_DB, embedded_worker
from tests.servers import FaultProxy, RedisServer, wait_until

pytestmark = pytest.mark.worker


def fill_slots(
    client: redis.Redis, key: str, limit: int, ttls: list[float] | None = None
) -> list[str]:
    """Make every slot of ``key`` look held by other tasks; return their values."""
    values = []
    for slot in range(1, limit + 1):
        value = LockValue.new(
            LockOwner(f"holder-{slot}", 0, "celery@elsewhere", slot), "other"
        ).encode()
        ttl = (ttls or [30.0] * limit)[slot - 1]
        assert client.set(slot_key(key, slot), value, nx=True, px=int(ttl * 1000))
        values.append(value)
    return values


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_at_most_n_bodies_at_once_per_key_and_other_keys_unaffected(
    app: Celery, record: redis.Redis, lock_client: redis.Redis, pool: str
) -> None:
    @app.task(
        base=SingletonTask,
        shared=False,
        lock_args=("tenant",),
        lock_limit=3,
        lock_on_contention=Wait(timeout=60),
    )
    def export(tenant: str, n: int) -> int:
        active = record.incr(f"active:{tenant}")
        everyone = record.incr("active")
        record.rpush(f"peak:{tenant}", active)
        record.rpush("peak", everyone)
        if tenant == "a":
            # Hold the three slots until the other tenant's runs are done:
            # they must not wait for tenant a.
            wait_until(lambda: record.get("b-done") == "2", timeout=15, interval=0.02)
        else:
            time.sleep(0.2)
        record.decr("active")
        record.decr(f"active:{tenant}")
        if tenant == "b":
            record.incr("b-done")
        return n

    with embedded_worker(app, pool, 6):
        results = [export.delay("a", n) for n in range(4)]
        wait_until(lambda: record.llen("peak:a") >= 3, timeout=30, message="three a's to start")
        results += [export.delay("b", n) for n in range(2)]
        assert sorted(r.get(timeout=60) for r in results) == [0, 0, 1, 1, 2, 3]
    peaks_a = [int(p) for p in record.lrange("peak:a", 0, -1)]
    assert max(peaks_a) == 3 and len(peaks_a) == 4
    assert max(int(p) for p in record.lrange("peak:b", 0, -1)) == 2
    assert max(int(p) for p in record.lrange("peak", 0, -1)) == 5  # b ran beside a's three
    assert [k for k in lock_client.scan_iter() if not k.endswith(b":fence")] == []


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_skip_and_raise_when_every_slot_is_held(
    app: Celery, lock_client: redis.Redis, policy: str
) -> None:
    @app.task(base=SingletonTask, shared=False, lock_limit=2, lock_on_contention=policy)
    def job(n: int) -> int:
        return n

    key = job.lock_key_for((1,), {})
    fill_slots(lock_client, key, 2, ttls=[30.0, 10.0])
    with embedded_worker(app, "threads", 2):
        result = job.delay(1)
        if policy == "raise":
            with pytest.raises(LockContended) as raised:
                result.get(timeout=20)
            assert raised.value.holder_task_id == "holder-2"  # the slot that frees first
            assert 9.0 < (raised.value.ttl_remaining or 0) <= 10.0
        else:
            skipped = result.get(timeout=20)
            assert is_skipped(skipped) and skipped["holder"] == "holder-2"
        assert job.delay(2).get(timeout=20) == 2  # another key is free


def test_retry_comes_back_when_a_slot_frees(app: Celery, lock_client: redis.Redis) -> None:
    @app.task(
        base=SingletonTask, shared=False, lock_limit=2, lock_on_contention=Retry(max_retries=5)
    )
    def job(n: int) -> str:
        assert job.lock is not None
        return job.lock.key

    key = job.lock_key_for((1,), {})
    fill_slots(lock_client, key, 2, ttls=[30.0, 0.5])
    started = time.monotonic()
    with embedded_worker(app, "threads", 2):
        assert job.delay(1).get(timeout=30) == slot_key(key, 2)
    # The countdown is the shortest holder's TTL (0.5 s), not the 30 s one.
    assert time.monotonic() - started < 20


def test_wait_takes_the_first_slot_released(app: Celery, lock_client: redis.Redis) -> None:
    @app.task(base=SingletonTask, shared=False, lock_limit=3, lock_on_contention=Wait(timeout=20))
    def job(n: int) -> str:
        assert job.lock is not None
        return job.lock.key

    key = job.lock_key_for((1,), {})
    values = fill_slots(lock_client, key, 3)
    with embedded_worker(app, "threads", 2):
        result = job.delay(1)
        wait_until(lambda: lock_client.pubsub_numsub(f"{key}:released")[0][1] > 0, timeout=20)
        started = time.monotonic()
        # A real release of slot 2 (compare-and-delete, publishes on the key's channel).
        app_settings(app).backend.release(slot_key(key, 2), values[1])
        assert result.get(timeout=20) == slot_key(key, 2)
        assert time.monotonic() - started < 10  # woken, not the 30 s TTL


def test_one_renewal_round_trip_per_tick_for_all_slots_and_a_lost_slot_reported_once(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    handles: list[LockHandle] = []
    lost: list[dict[str, Any]] = []

    def on_lost(sender: Any = None, **kwargs: Any) -> None:
        if kwargs.get("task_id"):  # not a standalone lock another test dropped
            lost.append(kwargs)

    @app.task(base=SingletonTask, shared=False, lock_args=(), lock_limit=3, lock_ttl=0.6)
    def hold(n: int) -> int:
        assert hold.lock is not None
        assert hold.lock.fence > 0  # a holder that fences (issued on demand)
        handles.append(hold.lock)
        record.incr("holding")
        wait_until(lambda: record.get("go") == "1", timeout=20, interval=0.02)
        return n

    lock_lost.connect(on_lost, weak=False)
    try:
        with embedded_worker(app, "threads", 3):
            results = [hold.delay(n) for n in range(3)]
            wait_until(lambda: record.get("holding") == "3", timeout=20)
            trips_before = renewer().round_trips
            renewals_before = [h.renewals for h in handles]
            time.sleep(1.5)  # measuring window: about 7 renewal ticks of TTL/3 = 0.2 s
            trips = renewer().round_trips - trips_before
            renewals = [h.renewals - b for h, b in zip(handles, renewals_before, strict=True)]
            # Lose slot 2 (a flush, a failover): reported once, the others keep going.
            victim = next(h for h in handles if h.key.endswith(":slot:2"))
            lock_client.delete(victim.key)
            wait_until(lambda: victim.lost, timeout=10)
            # Ticks go on (a second loss report would show): each other slot renews twice.
            others = {h: h.renewals for h in handles if h is not victim}
            wait_until(lambda: all(h.renewals >= n + 2 for h, n in others.items()), timeout=10)
            assert all(h.owned for h in handles if h is not victim)
            record.set("go", "1")
            assert sorted(r.get(timeout=20) for r in results) == [0, 1, 2]
    finally:
        lock_lost.disconnect(on_lost)
    assert sorted(h.key for h in handles) == sorted(
        slot_key(hold.lock_key_for((0,), {}), s) for s in (1, 2, 3)
    )
    assert min(renewals) >= 4
    assert trips <= max(renewals) + 2  # the three slots share each round trip
    assert [event["key"] for event in lost] == [victim.key]
    fences = [h.fence or 0 for h in handles]
    assert len(set(fences)) == 3


def test_limit_one_keeps_todays_key_and_value(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    @app.task(base=SingletonTask, shared=False, lock_limit=1)
    def job(n: int) -> str:
        assert job.lock is not None
        record.set("stored", lock_client.get(job.lock.key) or b"")
        return job.lock.key

    @app.task(base=SingletonTask, shared=False)
    def default(n: int) -> str:
        assert default.lock is not None
        return default.lock.key

    with embedded_worker(app, "threads", 2):
        key = job.delay(5).get(timeout=20)
        assert default.delay(5).get(timeout=20) == default.lock_key_for((5,), {})
    assert key == job.lock_key_for((5,), {})
    assert key == task_key("redislock", job.name, {"n": 5})  # today's key, byte for byte
    assert ":slot:" not in key
    stored = LockValue.decode(record.get("stored") or "")
    assert stored is not None and stored.task_name == job.name


def test_eager_apply_uses_the_slots(app: Celery, lock_client: redis.Redis) -> None:
    @app.task(base=SingletonTask, shared=False, lock_limit=2)
    def job(n: int) -> str:
        assert job.lock is not None
        return job.lock.key

    key = job.lock_key_for((1,), {})
    fill_slots(lock_client, key, 1)
    assert job.apply((1,)).get() == slot_key(key, 2)
    lock_client.set(slot_key(key, 2), "v1|x|0|h|1|n|t|0", px=30000)
    assert is_skipped(job.apply((1,)).get())


def test_ls_shows_each_slot_as_a_row(app: Celery, lock_client: redis.Redis) -> None:
    @app.task(base=SingletonTask, shared=False, lock_limit=3)
    def job(n: int) -> None:
        pass

    key = job.lock_key_for((1,), {})
    fill_slots(lock_client, key, 2)
    records = LockInventory(app).locks()
    assert sorted((r.key, r.slot) for r in records) == [(key, 1), (slot_key(key, 2), 2)]
    assert {r.task_id for r in records} == {"holder-1", "holder-2"}
    slot_column = _COLUMNS.index("SLOT")
    assert sorted(_row(r)[slot_column] for r in records) == ["1", "2"]
    found = LockInventory(app).find(slot_key(key, 2))
    assert found is not None and found.slot == 2 and found.task_id == "holder-2"


def test_limit_with_enqueue_or_hold_after_success_is_refused(app_factory: Any) -> None:
    app = app_factory()
    with pytest.raises(ConfigurationError, match="lock_limit=3 cannot be combined with lock_enq"):

        @app.task(base=SingletonTask, shared=False, lock_limit=3, lock_enqueue=True)
        def queued() -> None:
            pass

        queued.name  # noqa: B018  (the task class is made on first use)

    with pytest.raises(ConfigurationError, match="lock_hold_after_success"):

        @app.task(base=SingletonTask, shared=False, lock_limit=2, lock_hold_after_success=60)
        def held() -> None:
            pass

        held.name  # noqa: B018

    other = app_factory(redislock_limit=2, redislock_enqueue=True)

    @other.task(base=SingletonTask, shared=False)
    def from_app() -> None:
        pass

    with pytest.raises(ConfigurationError, match="lock_limit=2 cannot be combined"):
        from_app.delay()


@pytest.mark.parametrize("mode", ["run", "fail"])
def test_an_acquire_whose_reply_was_lost_is_taken_back_or_adopted_in_its_slot(
    app_factory: Any, server: RedisServer, record: redis.Redis, mode: str
) -> None:
    """The acquire times out, then lands in slot 2 later.

    ``run``: the body ran unprotected; the late value is taken back from
    whichever slot it reached. ``fail``: the re-sent task takes it over.
    Either way slot 2 is free well before its 30 s TTL.
    """
    proxy = FaultProxy(server.port)
    try:
        app: Celery = app_factory(
            redislock_url=f"{proxy.url}/{LOCK_DB}",
            redislock_on_backend_error=mode,
            redislock_redis_options={"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
        )

        @app.task(base=SingletonTask, shared=False, lock_args=(), lock_limit=2)
        def job(n: int) -> str:
            record.rpush("runs", n)
            return job.lock.key if job.lock is not None else "unlocked"

        key = job.lock_key_for((1,), {})
        locks = server.client(LOCK_DB)
        with embedded_worker(app, "threads", 1):
            assert job.delay(0).get(timeout=20) == key  # connections open
            fill_slots(locks, key, 1)
            proxy.blackhole()
            result = job.delay(1)
            if mode == "run":
                assert result.get(timeout=30) == "unlocked"
                proxy.heal_and_flush()  # the held acquire reaches Redis now
            else:
                wait_until(lambda: app.AsyncResult(result.id).state == "RETRY", timeout=20)
                proxy.heal_and_flush()
                # Slot 2: its own late value, adopted (or taken back just before).
                assert result.get(timeout=30) == slot_key(key, 2)
            locks.ping()
            wait_until(
                lambda: locks.exists(slot_key(key, 2)) == 0, timeout=20, message="the late value"
            )
        assert locks.exists(key) == 1  # the other holder's slot is left alone
    finally:
        proxy.close()


def test_a_second_delivery_never_runs_beside_its_first_even_with_free_slots(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    """A visibility-timeout redelivery: the first delivery (another worker) holds slot 1."""

    @app.task(base=SingletonTask, shared=False, lock_limit=3, lock_on_contention="skip")
    def job(n: int) -> str:
        held = [lock_client.get(slot_key(key, slot)) for slot in (1, 2, 3)]
        record.set("first-still-held", int(first.encode() in held))
        assert job.lock is not None
        return job.lock.key

    key = job.lock_key_for((1,), {})
    first = LockValue.new(LockOwner("dup-id", 0, "celery@elsewhere", 1), job.name).encode()
    lock_client.set(key, first, px=1500)
    with embedded_worker(app, "threads", 2):
        result = job.apply_async((1,), task_id="dup-id")
        # Not skipped (that would store a result under the running delivery's
        # id) and not run beside it: retried until the first delivery's slot is gone.
        assert result.get(timeout=30) == key
    assert record.get("first-still-held") == "0"
