"""``revoke(terminate=True)`` with a signal the child survives: no ready state while it holds."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import states

from tests.processes.test_crash import Cluster
from tests.servers import wait_until

pytestmark = [pytest.mark.subprocess, pytest.mark.slow, pytest.mark.fault]


@pytest.fixture
def workers(redis_server_factory: Any) -> Iterator[Cluster]:
    started = Cluster(redis_server_factory())
    yield started
    started.close()


def test_a_sigusr1_terminate_stores_no_ready_state_while_the_child_holds_the_lock(
    workers: Cluster,
) -> None:
    """SIGUSR1 is billiard's soft time limit: the body catches it and runs on, locked, 2 s.

    Celery stores REVOKED as soon as it sent the signal; ``result.get()``
    raising ``TaskRevokedError`` must mean the lock is free, so nothing is
    stored until the child released. Its own outcome is stored then.
    """
    workers.worker(ttl=30)
    result = workers.send("survives_soft_limit", "usr1")
    key = workers.started(result.id)["key"]
    workers.producer.control.revoke(result.id, terminate=True, signal="SIGUSR1")
    deadline = time.monotonic() + 20
    while True:
        state = result.state  # read before the key: a ready state must find it free
        held = workers.locks.exists(key)
        if state in states.READY_STATES:
            assert held == 0, f"{state} stored while the child still held {key}"
            break
        assert time.monotonic() < deadline, "the task never ended"
        time.sleep(0.005)
    wait_until(lambda: workers.record.lrange("events:usr1", 0, -1) == ["soft"], timeout=5)
    assert result.get(timeout=10) == "usr1"


def test_soft_cancels_of_surviving_tasks_never_stall_the_workers_main_process(
    workers: Cluster,
) -> None:
    """The revoke handler looks once at each lock, never waits for a child that survives.

    Waiting up to 1 s per such task in the main process (the code before)
    delayed a control ping sent right after 4 of them by over 4 s.
    """
    workers.worker(ttl=30, concurrency=4)
    results = [workers.send("survives_soft_limit", f"usr1-{n}") for n in range(4)]
    for result in results:
        workers.started(result.id)
    started = time.monotonic()
    workers.producer.control.revoke([r.id for r in results], terminate=True, signal="SIGUSR1")
    replies = workers.producer.control.ping(timeout=10, limit=1)
    answered = time.monotonic() - started
    print(f"\n[measured] ping after 4 SIGUSR1 revokes answered in {answered:.2f}s")
    assert replies and answered < 2.0
    assert [r.get(timeout=20) for r in results] == [f"usr1-{n}" for n in range(4)]


def test_a_sigterm_revoke_ends_a_task_that_survived_a_sigusr1_revoke(workers: Cluster) -> None:
    """The first revoke's signal did not stop it: the second one is sent, not ignored."""
    workers.worker(ttl=30)
    result = workers.send("survives_soft_limit", "usr1-then-term")
    key = workers.started(result.id)["key"]
    workers.producer.control.revoke(result.id, terminate=True, signal="SIGUSR1")
    wait_until(lambda: workers.record.lrange("events:usr1-then-term", 0, -1) == ["soft"])
    workers.producer.control.revoke(result.id, terminate=True, signal="SIGTERM")
    wait_until(lambda: result.state in states.READY_STATES, timeout=20, interval=0.005)
    assert result.state == states.REVOKED and workers.locks.exists(key) == 0
