"""A producer never hangs on its lock store: ``delay()`` against a frozen (SIGSTOP) Redis.

``delay()`` runs inside web requests. With ``lock_enqueue`` or a debounce,
it makes a lock-store call before publishing; against a store that accepts
connections and never answers that call used to take the lock store's
client timeouts and retries (15.1 s at the package defaults). Now it is
bounded by ``redislock_enqueue_timeout`` (default 1 s), after which the call
is published without its enqueue lock: never dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from celery_redislock import SingletonTask
from tests.brokers import declare_as_a_worker_would, queue_length
from tests.servers import RedisServer, free_port

pytestmark = [pytest.mark.fault]

# What the publish itself may take on a busy 2-core machine, over the bound.
PUBLISH_SLACK = 0.5

OPTIONS = {
    "until_done": {"lock_enqueue": True},
    "until_start": {"lock_enqueue": "until_start"},
    "debounce": {"lock_debounce": 2},
}


@pytest.fixture
def store(redis_server_factory: Callable[..., RedisServer]) -> Iterator[RedisServer]:
    """A lock store of its own, which the test freezes; resumed afterwards."""
    server = redis_server_factory()
    yield server
    server.resume()


def timed_delay(task: Any, *args: Any) -> tuple[float, Any]:
    started = time.monotonic()
    result = task.delay(*args)
    return time.monotonic() - started, result


@pytest.mark.parametrize("mode", list(OPTIONS))
@pytest.mark.parametrize("connection", ["open", "new"])
def test_delay_against_a_frozen_store_returns_within_the_bound_and_publishes(
    app_factory: Callable[..., Celery],
    server: RedisServer,
    store: RedisServer,
    mode: str,
    connection: str,
) -> None:
    # The package's client defaults (5 s timeouts, 2 retries) for everything else.
    app = app_factory(redislock_url=store.url)

    @app.task(base=SingletonTask, shared=False, **OPTIONS[mode])
    def job(n: int) -> None: ...

    declare_as_a_worker_would(app)  # a debounced call is a countdown message
    if connection == "open":
        job.delay(0)  # the producer's lock-store connection is open, idle
    published = queue_length(app)
    store.pause()
    elapsed, result = timed_delay(job, 1)
    print(f"\n{mode}, {connection} connection: delay() returned after {elapsed:.3f} s")
    assert elapsed < 1.0 + PUBLISH_SLACK, f"delay() blocked {elapsed:.2f} s"
    assert queue_length(app) == published + 1, "the call was not published"
    assert result.id


def test_the_bound_is_a_setting(
    app_factory: Callable[..., Celery], server: RedisServer, store: RedisServer
) -> None:
    app = app_factory(redislock_url=store.url, redislock_enqueue_timeout=0.2)

    @app.task(base=SingletonTask, shared=False, lock_enqueue=True)
    def job(n: int) -> None: ...

    store.pause()
    elapsed, _ = timed_delay(job, 1)
    assert elapsed < 0.2 + PUBLISH_SLACK, f"delay() blocked {elapsed:.2f} s"
    elapsed, _ = timed_delay(job, 2)  # again, on the connection the first one dropped
    assert elapsed < 0.2 + PUBLISH_SLACK, f"delay() blocked {elapsed:.2f} s"
    assert queue_length(app) == 2


@pytest.mark.parametrize("mode", list(OPTIONS))
def test_delay_against_an_unreachable_cluster_publishes(
    app_factory: Callable[..., Celery], server: RedisServer, mode: str
) -> None:
    # redis-py's cluster client raises RedisClusterException (not a
    # RedisError) when no startup node answers: it escaped delay() (helper-44).
    app = app_factory(redislock_url=f"redis+cluster://127.0.0.1:{free_port()}")

    @app.task(base=SingletonTask, shared=False, **OPTIONS[mode])
    def job(n: int) -> None: ...

    declare_as_a_worker_would(app)
    elapsed, result = timed_delay(job, 1)
    assert queue_length(app) == 1, "the call was not published"
    assert result.id and elapsed < 1.0 + PUBLISH_SLACK
