"""lock_on_lost="abort": a running body is stopped as soon as its lock is lost."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import LockLost, SingletonTask
from tests.conftest import embedded_worker
from tests.servers import wait_until

pytestmark = pytest.mark.worker

ITERATIONS = int(os.environ.get("REDISLOCK_ABORT_RACE_ITERATIONS", "3000"))


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


def test_a_threads_pool_abort_never_reaches_code_outside_its_execution(
    app: Celery, lock_client: redis.Redis
) -> None:
    """The renewer's abort races the end of the execution it was meant for.

    A non-main thread runs executions back to back, as the threads pool
    does; another thread marks each execution's lock lost (as the renewer
    would) at a random moment around the end of its body. LockLost may end
    the execution it was sent for, never the code after it or the next one.
    """
    import random
    import threading

    @app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=30, lock_on_lost="abort")
    def job(self: Any, n: int) -> int:
        current["handle"] = self.lock
        spin = time.perf_counter() + random.uniform(0, 0.0002)
        while time.perf_counter() < spin:
            pass
        return n

    current: dict[str, Any] = {}
    done = threading.Event()
    leaks: list[str] = []
    aborted = 0

    def chaos() -> None:
        seen = None
        while not done.is_set():
            handle = current.get("handle")
            if handle is None or handle is seen:
                continue
            seen = handle
            end = time.perf_counter() + random.uniform(0, 0.0006)
            while time.perf_counter() < end:
                pass
            handle._mark_lost("gone")  # what the renewer does on loss

    def executions() -> None:
        nonlocal aborted
        for n in range(ITERATIONS):
            job.push_request(id=f"t{n}", retries=0, hostname="w@h", called_directly=False)
            try:
                try:
                    job(n)
                except LockLost:
                    aborted += 1  # ended its own execution: allowed
                finally:
                    job.pop_request()
                # Code after the execution (Celery's trace, the next task): no
                # abort may land here.
                spin = time.perf_counter() + 0.0005
                while time.perf_counter() < spin:
                    pass
            except LockLost as exc:
                leaks.append(f"after execution {n}: {exc}")
            # An abort landing inside the release would cut it short: key left.
            if lock_client.exists(job.lock_key_for((n,), {})):
                leaks.append(f"execution {n} left its key behind")

    import sys

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # interleave the two threads finely, as a busy worker does
    try:
        spinner = threading.Thread(target=chaos, daemon=True)
        spinner.start()
        worker = threading.Thread(target=executions)
        worker.start()
        worker.join(120)
        done.set()
        spinner.join(5)
    finally:
        sys.setswitchinterval(interval)
    print(f"\n[measured] {ITERATIONS} executions, {aborted} aborted inside, {len(leaks)} leaked")
    assert leaks == [], leaks[:5]
