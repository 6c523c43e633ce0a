"""What Flower shows for a skipped task: the worker's real task events, read into
celery.events.State (the model Flower keeps), as Flower would receive them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.events.state import State

from celery_redislock import SingletonTask
from celery_redislock.task import CONTENTION_EVENT
from tests.conftest import embedded_worker
from tests.helpers import hold_lock
from tests.servers import wait_until

pytestmark = pytest.mark.worker


@pytest.fixture
def monitor(
    app_factory: Callable[..., Celery],
) -> Iterator[tuple[Celery, State, list[dict[str, Any]], threading.Lock]]:
    app = app_factory(worker_send_task_events=True, task_send_sent_event=True)
    state = app.events.State()
    events: list[dict[str, Any]] = []
    guard = threading.Lock()  # State is not thread-safe; the test reads it too

    def on_event(event: dict[str, Any]) -> None:
        with guard:
            state.event(event)
            events.append(dict(event))

    receivers: list[Any] = []

    def capture() -> None:
        with app.connection_for_read() as connection:
            receiver = app.events.Receiver(connection, handlers={"*": on_event})
            receivers.append(receiver)
            receiver.capture(limit=None, timeout=None, wakeup=False)  # until should_stop

    thread = threading.Thread(target=capture, daemon=True)
    thread.start()

    def subscribed() -> bool:  # the fanout only reaches receivers already listening
        with app.events.default_dispatcher() as dispatcher:
            dispatcher.send("test-ping")
        return any(event["type"] == "test-ping" for event in events)

    wait_until(subscribed, timeout=20, interval=0.2, message="the event receiver")
    yield app, state, events, guard
    receivers[0].should_stop = True
    thread.join(5)


def test_a_skipped_task_shows_as_success_with_the_skip_marker_and_the_holder(
    monitor: tuple[Celery, State, list[dict[str, Any]], threading.Lock], lock_client: redis.Redis
) -> None:
    app, state, events, guard = monitor

    @app.task(base=SingletonTask, shared=False, name="flower.job")
    def job(n: int) -> int:
        return n

    hold_lock(lock_client, job, (1,), holder_task_id="the-holder")
    with embedded_worker(app, "solo"):
        skipped = job.delay(1)
        assert skipped.get(timeout=20)["holder"] == "the-holder"
        ran = job.delay(2)
        assert ran.get(timeout=20) == 2

        def shown(task_id: str) -> Any:
            with guard:
                task = state.tasks.get(task_id)
            return task if task is not None and task.state == "SUCCESS" else None

        task = wait_until(lambda: shown(skipped.id), timeout=20, message="task-succeeded")
        plain = wait_until(lambda: shown(ran.id), timeout=20, message="task-succeeded")
    # Flower's task list: state SUCCESS, result column with the skip marker.
    assert "'__redislock__': 'skipped'" in task.result and "the-holder" in task.result
    # Flower's task page also lists the fields of the custom event.
    (contended,) = [event for event in events if event["type"] == CONTENTION_EVENT]
    # It names its task: a monitor may receive it before the worker's own
    # task-received (another connection), and Flower counts it under this name.
    assert contended["name"] == "flower.job"
    assert (task.redislock_holder, task.redislock_policy) == ("the-holder", "skip")
    assert task.redislock_key == job.lock_key_for((1,), {})
    assert not hasattr(plain, "redislock_holder")
