"""Issue 13 in a real worker: N distinct no-op tasks leave at most N/100 keys in the lock store."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import SingletonTask
from tests.conftest import embedded_worker
from tests.helpers import held_locks
from tests.servers import wait_until

pytestmark = pytest.mark.worker

N = 2000
#: The option variants run fewer tasks (the suite's time): still at most N/100 = 5 keys.
N_VARIANT = 500


def run_distinct(
    app: Celery, record: redis.Redis, lock_client: redis.Redis, n: int = N, **options: Any
) -> int:
    """Run ``n`` no-op tasks, each with a key of its own; return the lock store's DBSIZE after."""

    @app.task(base=SingletonTask, shared=False, ignore_result=True, **options)
    def webhook(delivery: int) -> None:
        record.incr("runs")

    with embedded_worker(app, "threads", 2):
        for delivery in range(n):
            webhook.delay(delivery)
        wait_until(lambda: int(record.get("runs") or 0) == n, timeout=120, message=f"{n} runs")
        # The body ends before its release: wait for the last releases.
        wait_until(lambda: not held_locks(lock_client), timeout=10, message="releases")
    return int(lock_client.dbsize())


def test_distinct_no_op_tasks_leave_at_most_one_key_per_hundred(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    assert run_distinct(app, record, lock_client) <= N // 100


@pytest.mark.parametrize(
    "options",
    [
        {"lock_enqueue": True},
        {"lock_enqueue": "until_start"},
        {"lock_on_contention": "handoff"},
        {"lock_limit": 3},
        {"lock_debounce": 0.05},
    ],
    ids=["enqueue", "until_start", "handoff", "limit3", "debounce"],
)
def test_nor_with_enqueue_time_locks_hand_off_slots_or_debounce(
    app: Celery, record: redis.Redis, lock_client: redis.Redis, options: dict[str, Any]
) -> None:
    assert run_distinct(app, record, lock_client, N_VARIANT, **options) <= N_VARIANT // 100
