"""Bad input and misconfiguration: a clear error naming the problem; nothing lost."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery
from kombu.exceptions import EncodeError

from celery_redislock import ConfigurationError, LockBackendError, LockKeyError, SingletonTask
from tests.brokers import queue_length
from tests.conftest import embedded_worker
from tests.servers import RedisServer

pytestmark = pytest.mark.worker


class Opaque:
    """An object with only a default repr (a memory address)."""


def test_unkeyable_argument_fails_the_task_visibly(app_factory: Any, record: redis.Redis) -> None:
    app = app_factory(accept_content=["json", "pickle"])

    @app.task(base=SingletonTask, shared=False)
    def job(thing: Any) -> None:
        record.incr("runs")

    # pickle lets the object reach the worker; the key cannot be built there.
    with embedded_worker(app, "threads", 2):
        result = job.apply_async((Opaque(),), serializer="pickle")
        with pytest.raises(LockKeyError, match=r"argument 'thing' of type .*Opaque"):
            result.get(timeout=20)
    assert result.state == "FAILURE" and record.get("runs") is None


def test_unkeyable_argument_at_enqueue_raises_and_publishes_nothing(
    app: Celery, server: RedisServer
) -> None:
    @app.task(base=SingletonTask, shared=False, lock_enqueue=True)
    def job(thing: Any) -> None: ...

    with pytest.raises(LockKeyError, match="no stable encoding"):
        job.apply_async((Opaque(),), serializer="pickle")
    assert queue_length(app) == 0


def test_a_non_json_argument_raises_kombus_encode_error_with_or_without_the_lock(
    app: Celery, server: RedisServer
) -> None:
    # Code that catches EncodeError around delay() must catch it for every task.
    @app.task(shared=False)
    def plain(thing: Any) -> None: ...

    @app.task(base=SingletonTask, shared=False)
    def locked(thing: Any) -> None: ...

    @app.task(base=SingletonTask, shared=False, lock_enqueue="until_start")
    def queued_once(thing: Any) -> None: ...

    @app.task(base=SingletonTask, shared=False, lock_debounce=5)
    def debounced(thing: Any) -> None: ...

    for task in (plain, locked, queued_once, debounced):
        with pytest.raises(EncodeError) as info:
            task.delay(Opaque())
        assert "Opaque" in str(info.value), task.name
    # The lock's own error is still the one it was (a LockKeyError, a TypeError).
    with pytest.raises(LockKeyError, match="cannot be sent with the 'json' serializer"):
        queued_once.delay(Opaque())
    with pytest.raises(EncodeError):
        queued_once.lock_key_for((Opaque(),), {})
    assert queue_length(app) == 0


def test_huge_arguments_run_with_a_fixed_size_key(app: Celery, lock_client: redis.Redis) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: Any, blob: str) -> int:
        return len(self.lock.key)

    small = job.apply(("x",)).get()
    assert job.apply(("x" * 2_000_000,)).get() == small


def test_arguments_that_do_not_fit_run_fail_with_the_reason(app: Celery) -> None:
    @app.task(base=SingletonTask, shared=False, typing=False)
    def job(a: int) -> None: ...

    result = job.apply((1, 2, 3))
    assert result.state == "FAILURE"
    assert isinstance(result.result, LockKeyError)
    assert "arguments do not match run()" in str(result.result)


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"redislock_ttl": 0}, "redislock_ttl must be a positive"),
        ({"redislock_on_contention": "sometimes"}, "redislock_on_contention must be one of"),
        ({"redislock_url": "not a url"}, "redislock_url must be a redis:// URL"),
    ],
    ids=["zero-ttl", "unknown-policy", "malformed-url"],
)
def test_misconfigured_app_raises_at_the_call_and_publishes_nothing(
    app_factory: Any, server: RedisServer, conf: dict[str, Any], message: str
) -> None:
    app = app_factory(**conf)

    @app.task(base=SingletonTask, shared=False)
    def job() -> None: ...

    with pytest.raises(ConfigurationError, match=message):
        job.delay()
    assert queue_length(app) == 0


def test_unreachable_lock_store_fails_the_task_visibly(
    app_factory: Any, record: redis.Redis
) -> None:
    app = app_factory(
        redislock_url="redis://127.0.0.1:1/0",
        redislock_backend_error_max_retries=0,
        redislock_redis_options={"socket_connect_timeout": 0.3, "socket_timeout": 0.3},
    )

    @app.task(base=SingletonTask, shared=False)
    def job() -> None:
        record.incr("runs")

    with embedded_worker(app, "threads", 2):
        result = job.delay()
        with pytest.raises(
            LockBackendError, match=r"Redis at redis://127.0.0.1:1/0 is unavailable"
        ):
            result.get(timeout=20)
    assert result.state == "FAILURE" and record.get("runs") is None


def test_wrong_password_fails_visibly(
    app_factory: Any, redis_server_factory: Any, record: redis.Redis
) -> None:
    secured: RedisServer = redis_server_factory("--requirepass", "right")
    app = app_factory(
        redislock_url=f"redis://:wrong@127.0.0.1:{secured.port}/0",
        redislock_backend_error_max_retries=0,
    )

    @app.task(base=SingletonTask, shared=False)
    def job() -> None:
        record.incr("runs")

    with embedded_worker(app, "threads", 2):
        result = job.delay()
        with pytest.raises(LockBackendError) as info:
            result.get(timeout=20)
    assert "wrong" not in str(info.value) and record.get("runs") is None


def test_store_refusing_scripts_fails_visibly(app_factory: Any, redis_server_factory: Any) -> None:
    locked_down: RedisServer = redis_server_factory()
    locked_down.client().acl_setuser(
        "app",
        enabled=True,
        passwords=["+pw"],
        keys=["*"],
        channels=["*"],
        commands=["+@all", "-eval", "-evalsha"],
    )
    app = app_factory(
        redislock_url=f"redis://app:pw@127.0.0.1:{locked_down.port}/0",
        redislock_backend_error_max_retries=0,
    )

    @app.task(base=SingletonTask, shared=False)
    def job() -> None: ...

    # A free key is taken with a plain SET (issue 24), but every release is a
    # script: the worker's start-up check finds the refusal and does not start.
    with (
        pytest.raises(ConfigurationError, match=r"refuses the package's commands.*must allow EVAL"),
        embedded_worker(app, "threads", 2),
    ):
        job.delay().get(timeout=20)


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3cret-pw@127.0.0.1:notaport/0",  # malformed: the error quotes the URL
        "redis://user:s3cret-pw@127.0.0.1:1/0",  # unreachable
        "sentinel://:s3cret-pw@127.0.0.1:1,127.0.0.1:2/mymaster",  # no sentinel answers
        "redis://user:Zx81kQ/s3cret-pw@127.0.0.1:1/0",  # an unencoded / in the password
        "redis://user:s3cret-pw?x@127.0.0.1:1/0",  # an unencoded ? in the password
    ],
)
def test_the_password_never_appears_in_errors_or_logs(
    app_factory: Any, caplog: pytest.LogCaptureFixture, url: str
) -> None:
    app = app_factory(
        redislock_url=url,
        redislock_backend_error_max_retries=0,
        redislock_redis_options={"socket_timeout": 0.3, "socket_connect_timeout": 0.3},
    )

    @app.task(base=SingletonTask, shared=False)
    def job() -> None: ...

    caplog.set_level("DEBUG")
    with pytest.raises(Exception) as info:  # the type depends on the fault
        job.apply().get()
    for fragment in ("s3cret-pw", "Zx81kQ"):
        assert fragment not in str(info.value)
        assert fragment not in caplog.text
    assert "127.0.0.1" in str(info.value)  # still says where


def test_eager_mode_says_it_retries_at_once(app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    app.conf.redislock_url = "redis://127.0.0.1:1/0"
    app.conf.redislock_backend_error_max_retries = 2

    @app.task(base=SingletonTask, shared=False)
    def job() -> None: ...

    caplog.set_level("WARNING", logger="celery_redislock")
    with pytest.raises(LockBackendError):
        job.apply().get()
    retries = [r.getMessage() for r in caplog.records if "retr" in r.getMessage()]
    assert len(retries) == 3 and "gives up" in retries[-1]
    for message in retries[:2]:
        assert "at once" in message and "will retry in" not in message, message
