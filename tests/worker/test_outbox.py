"""A re-send the broker refuses is kept in the lock store and published when it takes it."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult
from celery.worker import state as worker_state

from celery_redislock import HandOff, LockBackendError, Retry, SingletonTask, lock_contended
from celery_redislock.keys import pending_keys
from celery_redislock.settings import app_settings
from tests.conftest import embedded_worker
from tests.servers import RedisServer, wait_until
from tests.worker.test_handoff import _held_by_another

pytestmark = pytest.mark.worker


def _acknowledged(task_id: str) -> bool:
    """Whether the worker's early ack of ``task_id`` is done.

    The consumer acks as the run starts, in its own thread. A broker killed
    before that ack lands leaves the delivery unacked, and Celery 5.7's
    reconnect then stops the worker ("Unrecoverable error: AttributeError
    ... 'hostname'": it restores the unacked message through the connection
    it has just closed). That is Celery's, not what these tests are about.
    """
    return any(r.id == task_id and r.acknowledged for r in tuple(worker_state.active_requests))


@contextlib.contextmanager
def _a_lock_retry_whose_broker_dies(
    app_factory: Any,
    redis_server_factory: Any,
    record: redis.Redis,
    lock_client: redis.Redis,
    sweep_interval: float,
) -> Iterator[tuple[Celery, RedisServer, AsyncResult]]:
    """A worker whose broker dies as its one call meets a held key (policy: retry).

    Yields the app, the broker (dead by the time the call is in RETRY) and
    the call's result.
    """
    broker: RedisServer = redis_server_factory()
    app: Celery = app_factory(
        broker_url=broker.url_for(0),
        redislock_sweep_interval=sweep_interval,
        # Celery warns of its own default here (the broker drops mid-task).
        worker_cancel_long_running_tasks_on_connection_loss=True,
    )

    @app.task(
        base=SingletonTask,
        shared=False,
        lock_args=(),
        lock_on_contention=Retry(countdown=0.5, jitter=0, max_retries=5),
    )
    def job(label: str) -> str:
        record.rpush("runs", label)
        return label

    def broker_dies(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "name", None) == job.name and not record.getset("broker-killed", 1):
            wait_until(lambda: _acknowledged(sender.request.id), timeout=10)
            broker.kill()

    lock_contended.connect(broker_dies, weak=False)
    try:
        # Solo: the early ack is sent from the consumer's own thread. A pool
        # thread's ack shares the consumer's broker connection, and under load
        # it failed ("Couldn't ack"), after which Celery 5.7's reconnect
        # stopped the worker (CI, quorum suite) and nothing was left to sweep.
        with embedded_worker(app, "solo"):
            # Held once the worker is up, so its start-up cannot eat the TTL.
            key = job.lock_key_for(("only",), {})
            lock_client.set(key, "v1|holder|0|elsewhere|1|ab|job|0", px=1500)
            yield app, broker, job.delay("only")
    finally:
        lock_contended.disconnect(broker_dies)


def test_a_lock_retry_whose_publish_fails_runs_once_the_broker_is_back(
    app_factory: Any,
    redis_server_factory: Any,
    record: redis.Redis,
    lock_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The broker dies between the delivery and the lock retry's re-send.

    The message was acknowledged when the run started (no ``acks_late``):
    the re-send is the call's only copy. Kept in the lock store, a worker's
    sweep publishes it once the broker is back; the call runs, once.
    """
    with (
        caplog.at_level("WARNING", logger="celery_redislock"),
        _a_lock_retry_whose_broker_dies(
            app_factory, redis_server_factory, record, lock_client, sweep_interval=0.2
        ) as (app, broker, result),
    ):
        wait_until(lambda: app.AsyncResult(result.id).state == "RETRY", timeout=30)
        assert "kept in the lock store" in caplog.text
        assert record.llen("runs") == 0
        broker.start()
        assert result.get(timeout=60) == "only"
    assert record.lrange("runs", 0, -1) == ["only"]


def test_a_worker_that_does_not_sweep_fails_a_refused_re_send_visibly(
    app_factory: Any, redis_server_factory: Any, record: redis.Redis, lock_client: redis.Redis
) -> None:
    """``redislock_sweep_interval=0``: nothing here would publish it, so nothing is kept.

    The call fails (FAILURE naming both refusals) instead of waiting in an
    outbox no worker reads.
    """
    with _a_lock_retry_whose_broker_dies(
        app_factory, redis_server_factory, record, lock_client, sweep_interval=0
    ) as (app, _, result):
        wait_until(lambda: app.AsyncResult(result.id).state == "FAILURE", timeout=30)
        error = app.AsyncResult(result.id).result
        assert isinstance(error, LockBackendError)
        assert "does not sweep" in str(error) and "broker refused" in str(error)
    assert lock_client.hlen(pending_keys("redislock", app.main or "")[1]) == 0
    assert record.llen("runs") == 0


def test_a_hand_over_the_broker_refuses_runs_at_the_next_sweep_not_after_the_hold(
    app: Celery, record: redis.Redis, lock_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The release that hands the key over publishes through a broker that refuses it.

    Logged only, the parked call ran when the hold (the lock TTL, 30 s here)
    expired and a sweep handed the key over again (review helper-50 F3:
    about 31 s). Kept in the outbox, a worker's sweep publishes it at once.
    """
    app.conf.redislock_sweep_interval = 0.2
    job, key, _, holder = _held_by_another(app, record, lock_client, lock_on_contention=HandOff())
    # The releasing process: the same app (same pending index), a broker that refuses.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    releasing = Celery(app.main, set_as_current=False)
    releasing.conf.update(
        app.conf.changes,
        broker_url=f"redis://127.0.0.1:{port}/0",
        task_publish_retry=False,
        broker_connection_timeout=0.5,
    )
    try:
        with embedded_worker(app, "threads", 2):
            parked = job.delay("parked")
            wait_until(lambda: app.AsyncResult(parked.id).state == "RETRY", timeout=20)
            store = app_settings(releasing).backend
            assert store is not job.lock_settings().backend
            with caplog.at_level("WARNING", logger="celery_redislock"):
                store.release(key, holder)  # hands the key over; its publish is refused
            assert "could not publish" in caplog.text
            assert parked.get(timeout=10) == "parked"  # not after the 30 s hold
    finally:
        releasing.close()
    assert record.lrange("runs", 0, -1) == ["parked"]
