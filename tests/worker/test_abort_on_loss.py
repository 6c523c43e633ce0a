"""lock_on_lost="abort": a running body is stopped as soon as its lock is lost."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import LockLost, SingletonTask
from tests.conftest import embedded_worker
from tests.servers import wait_until

pytestmark = pytest.mark.worker


def test_abort_interrupts_a_blocking_body_in_the_main_thread(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    # A prefork child runs the body in its main thread (as `celery worker -P
    # solo` does; the embedded test worker runs solo in a side thread).
    pool = "prefork"

    @app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=0.6, lock_on_lost="abort")
    def job(self: Any) -> None:
        record.set("key", self.lock.key)
        time.sleep(30)  # blocked in a syscall: the signal interrupts it
        record.set("finished", 1)

    with embedded_worker(app, pool, 1):
        result = job.delay()
        key = wait_until(lambda: record.get("key"), timeout=20)
        stolen_at = time.monotonic()
        lock_client.set(key, "v1|thief|0|h|1|n|t|0", px=60000)
        with pytest.raises(LockLost, match="aborted"):
            result.get(timeout=20)
        print(f"\n[measured] {pool}: aborted {time.monotonic() - stolen_at:.2f}s after the theft")
    assert record.get("finished") is None
    assert lock_client.get(key) == b"v1|thief|0|h|1|n|t|0"  # the thief's lock untouched


@pytest.mark.parametrize("pool", ["threads", "solo"])
def test_abort_interrupts_a_busy_body_in_a_worker_thread(
    app: Celery, record: redis.Redis, lock_client: redis.Redis, pool: str
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=0.6, lock_on_lost="abort")
    def job(self: Any) -> None:
        record.set("key", self.lock.key)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # Python code runs: the async exception lands
            time.sleep(0.01)
        record.set("finished", 1)

    with embedded_worker(app, pool, 2):
        result = job.delay()
        key = wait_until(lambda: record.get("key"), timeout=20)
        lock_client.delete(key)
        with pytest.raises(LockLost):
            result.get(timeout=20)
    assert record.get("finished") is None


def test_report_mode_lets_the_body_decide_and_calls_the_hook(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    class Careful(SingletonTask):
        def on_lock_lost(self, handle: Any) -> None:
            record.set("hook", handle.lost_reason)

    @app.task(base=Careful, bind=True, shared=False, lock_ttl=0.6)
    def job(self: Any) -> str:
        record.set("key", self.lock.key)
        wait_until(lambda: self.lock.lost, timeout=20)
        return "stopped cleanly"

    with embedded_worker(app, "threads", 2):
        result = job.delay()
        key = wait_until(lambda: record.get("key"), timeout=20)
        lock_client.delete(key)
        assert result.get(timeout=20) == "stopped cleanly"
    assert record.get("hook") == "gone"


def test_a_finished_execution_is_never_hit_by_a_late_abort(
    app: Celery, record: redis.Redis
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=0.6, lock_on_lost="abort")
    def quick(self: Any, n: int) -> int:
        return n

    with embedded_worker(app, "solo"):
        assert [quick.delay(n).get(timeout=20) for n in range(20)] == list(range(20))
