"""The example Celery app used by the demo, docker-compose and the README.

Run a worker against it with::

    REDIS_URL=redis://localhost:6379 celery -A examples.app worker -l info

Every task records what it did in Redis (database 3) so the demo can count
executions and prove that no two ran at once for one key.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import redis
from celery import Celery
from celery.signals import task_revoked

from celery_redislock import Retry, SingletonTask, Skip, lock_contended

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379").rstrip("/")
#: Seconds between runs of the periodic report (beat); it takes 3 s to run.
REPORT_INTERVAL = float(os.environ.get("DEMO_REPORT_INTERVAL", "1.0"))

app = Celery("examples")
app.conf.update(
    broker_url=f"{REDIS_URL}/0",
    result_backend=f"{REDIS_URL}/1",
    redislock_url=f"{REDIS_URL}/2",
    redislock_ttl=30,  # renewed every 10 s while a task runs
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    result_expires=3600,
    beat_schedule={
        "hourly-report": {
            "task": "examples.app.build_report",
            "schedule": timedelta(seconds=REPORT_INTERVAL),
            # A backlog behind a long run is dropped, not run late.
            "options": {"expires": REPORT_INTERVAL},
        }
    },
)

_stats: redis.Redis | None = None


def stats() -> redis.Redis:
    """Where the examples record executions (one client per process)."""
    global _stats
    if _stats is None:
        _stats = redis.Redis.from_url(f"{REDIS_URL}/3", decode_responses=True)
    return _stats


def _enter(name: str) -> None:
    db = stats()
    running = db.incr(f"running:{name}")
    db.hset("max_concurrent", name, max(running, int(db.hget("max_concurrent", name) or 0)))
    db.hincrby("executed", name.split(":")[0], 1)
    db.hincrby("executed_per_key", name, 1)


def _leave(name: str) -> None:
    stats().decr(f"running:{name}")


@app.task(
    base=SingletonTask,
    bind=True,
    lock_args=("payment_id",),
    lock_enqueue=True,  # a duplicate delay() is not even published
    lock_hold_after_success=60,  # a late redelivery within a minute is dropped too
    lock_on_contention=Skip(),
)
def process_payment(self: Any, payment_id: str, payload: dict[str, Any] | None = None) -> str:
    """Handle a payment provider's webhook exactly once per payment.

    The provider may deliver the same webhook several times within a second,
    and again later; only ``payment_id`` makes up the lock key, so the payload
    can differ. Every caller gets a handle to the one task that runs.
    """
    _enter(f"payment:{payment_id}")
    try:
        time.sleep(1.0)  # talk to the ledger
        return f"processed {payment_id}"
    finally:
        _leave(f"payment:{payment_id}")


@app.task(base=SingletonTask, lock_args=())
def build_report() -> str:
    """A periodic job (beat) that runs longer than its interval; never overlaps.

    ``lock_args=()``: one lock for the task, whatever the arguments. The
    default policy, skip, drops a run while the previous one still holds it.
    """
    _enter("report")
    try:
        time.sleep(3.0)
        return "report built"
    finally:
        _leave("report")


@app.task(
    base=SingletonTask,
    bind=True,
    lock_args=("account_id",),
    lock_ttl=3,
    lock_on_contention=Retry(countdown=1, jitter=0.5),
)
def sync_account(self: Any, account_id: int, full: bool = False) -> int:
    """A long task kept alive by renewal: it runs 8 s with a 3 s TTL.

    A duplicate sync of the same account is retried later, not dropped.
    """
    _enter(f"account:{account_id}")
    try:
        for _ in range(8):
            time.sleep(1.0)
            if self.lock is not None and self.lock.lost:
                raise RuntimeError("lost the account lock; stopping before writing")
        return int(self.lock.renewals if self.lock is not None else 0)
    finally:
        _leave(f"account:{account_id}")


@lock_contended.connect
def _count_contention(sender: Any = None, **kwargs: Any) -> None:
    outcome = {"skip": "skipped", "retry": "retried"}.get(kwargs["policy"], kwargs["policy"])
    stats().hincrby(outcome, kwargs["task_name"].rsplit(".", 1)[-1], 1)


@task_revoked.connect
def _count_expired(sender: Any = None, expired: bool = False, **kwargs: Any) -> None:
    if expired and sender is not None:
        stats().hincrby("expired", str(sender.name).rsplit(".", 1)[-1], 1)
