"""Values that passed every check and then failed (or did nothing) at use (review helper-44 F4).

Each is refused where it is made, with a message that names it: the
settings when they are read, a task class when it is created, a
standalone lock when it is constructed.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import ConfigurationError, RedisLock, SingletonTask
from celery_redislock.settings import app_settings, validate_app_settings


def new_app(**conf: Any) -> Celery:
    app = Celery("unusable-values-test", set_as_current=False, set_as_default=False)
    app.conf.update({"redislock_url": "redis://h:1/0", **conf})
    return app


def locked_task(app: Celery, base: type = SingletonTask, **options: Any) -> Any:
    @app.task(base=base, shared=False, name=f"job{len(app.tasks)}", **options)
    def job(x: int) -> None: ...

    return job


@pytest.mark.parametrize(
    ("conf", "named"),
    [
        # 0 makes the socket non-blocking: every read failed with EAGAIN.
        ({"redislock_redis_options": {"socket_timeout": 0}}, "socket_timeout"),
        ({"redislock_redis_options": {"socket_connect_timeout": 0}}, "socket_connect_timeout"),
        ({"redislock_redis_options": {"protocol": 7}}, "protocol"),
        ({"redislock_redis_options": {"retry_on_timeout": "yes"}}, "retry_on_timeout"),
        ({"redislock_url": "unix://"}, "redislock_url"),
        # One renewal round may wait this long: every lock would expire meanwhile.
        ({"redislock_renew_timeout": 100, "redislock_ttl": 30}, "redislock_renew_timeout"),
    ],
)
def test_an_unusable_setting_is_refused_when_the_settings_are_read(
    conf: dict[str, Any], named: str
) -> None:
    app = new_app(**conf)
    with pytest.raises(ConfigurationError, match=named):
        validate_app_settings(app.conf)
    with pytest.raises(ConfigurationError, match=named):
        app_settings(app)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"lock_key": lambda: "k"}, "lock_key"),  # called with (args, kwargs)
        ({"lock_key": lambda args: "k"}, "lock_key"),
        ({"lock_debounce": 5, "lock_debounce_max_wait": 1}, "lock_debounce_max_wait"),
        ({"locks_args": ("x",)}, "lock_args"),  # a typo of a lock_ option, "s" and all
    ],
)
def test_an_unusable_task_option_is_refused_when_the_task_is_made(
    options: dict[str, Any], named: str
) -> None:
    app = new_app()
    with pytest.raises(ConfigurationError, match=named):
        locked_task(app, **options).name  # noqa: B018 - the class is created here


@pytest.mark.parametrize(
    ("conf", "options", "named"),
    [
        # Known only once the app's settings are merged in: at the first use
        # (an app-wide redislock_debounce or redislock_enqueue may turn them on).
        ({}, {"lock_debounce_max_wait": 3}, "lock_debounce_max_wait"),
        ({}, {"lock_enqueue_raise": True}, "lock_enqueue_raise"),
        ({"redislock_debounce": 5}, {"lock_debounce_max_wait": 1}, "lock_debounce_max_wait"),
        ({"redislock_debounce_max_wait": 1}, {"lock_debounce": 5}, "debounce_max_wait"),
    ],
)
def test_an_option_that_clashes_with_an_app_setting_is_refused_at_the_first_use(
    conf: dict[str, Any], options: dict[str, Any], named: str
) -> None:
    task = locked_task(new_app(**conf), **options)
    with pytest.raises(ConfigurationError, match=named):
        task.lock_settings()


def test_usable_neighbours_still_pass() -> None:
    app = new_app(
        redislock_redis_options={"socket_timeout": 0.2, "protocol": 2, "retry_on_timeout": True},
        redislock_renew_timeout=0.5,
        redislock_debounce_max_wait=30,  # a default for the tasks that debounce
        redislock_enqueue_raise=True,  # the same, for the tasks that enqueue
    )
    validate_app_settings(app.conf)
    plain = locked_task(app)
    assert plain.lock_settings().debounce == 0
    debounced = locked_task(app, lock_debounce=5, lock_debounce_max_wait=5)
    assert debounced.lock_settings().debounce_max_wait == 5
    raising = locked_task(app, lock_enqueue=True, lock_enqueue_raise=True)
    assert raising.lock_settings().enqueue_raise


@pytest.mark.parametrize("timeout", ["2", float("nan"), -1, float("inf"), True])
def test_a_standalone_lock_with_an_unusable_timeout_is_refused_when_made(timeout: Any) -> None:
    client = redis.Redis(port=1)  # never connected
    with pytest.raises(ConfigurationError, match="timeout"):
        RedisLock(client, "report", timeout=timeout)
    lock = RedisLock(client, "report")
    with pytest.raises(ConfigurationError, match="timeout"):
        lock.acquire(timeout=timeout)


def test_an_option_a_shared_base_class_sets_is_a_default_not_a_mistake() -> None:
    # Like an app-wide setting: for the tasks of the base that enqueue or
    # debounce (review helper-45 F4: the worker refused to start).
    class ProjectTask(SingletonTask):
        abstract = True
        lock_enqueue_raise = True
        lock_debounce_max_wait = 30

    app = new_app()
    plain = locked_task(app, base=ProjectTask)
    assert plain.lock_settings().debounce == 0
    with pytest.raises(ConfigurationError, match="lock_enqueue_raise"):
        locked_task(app, base=ProjectTask, lock_enqueue_raise=True).lock_settings()


def test_a_lock_key_adapter_made_with_functools_wraps_is_accepted() -> None:
    # inspect.signature follows __wrapped__ to the adapted function's own
    # arguments; the adapter itself takes (args, kwargs) (helper-45 F5).
    def by_account(account: int) -> str:
        return f"account:{account}"

    @functools.wraps(by_account)
    def adapter(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return by_account(*args, **kwargs)

    task = locked_task(new_app(), lock_key=adapter)
    assert task.lock_key_for((7,), {}).endswith("{account:7}")


@pytest.mark.parametrize("option", ["socket_timeout", "socket_connect_timeout"])
def test_a_socket_timeout_of_0_in_the_url_is_refused_too(option: str) -> None:
    app = new_app(redislock_url=f"redis://h:1/0?{option}=0")
    with pytest.raises(ConfigurationError, match=option):
        validate_app_settings(app.conf)


@pytest.mark.parametrize(
    ("conf", "ttl"), [({}, 0.3), ({"redislock_renew_timeout": 2}, 2), ({}, 0.5)]
)
def test_a_task_ttl_not_longer_than_the_renewal_timeout_is_logged_at_first_use(
    conf: dict[str, Any], ttl: float, caplog: pytest.LogCaptureFixture
) -> None:
    """One renewal round may wait that long: the task's locks would expire meanwhile.

    Logged, not refused (an app-wide TTL that short is): such a lock works
    while Redis answers quickly, and its loss is detected.
    """
    task = locked_task(new_app(**conf), lock_ttl=ttl)
    with caplog.at_level(logging.WARNING, logger="celery_redislock.config"):
        assert task.lock_settings().ttl == ttl
    assert f"lock_ttl={ttl:g}" in caplog.text and "redislock_renew_timeout" in caplog.text
    caplog.clear()
    locked_task(new_app(**conf), lock_ttl=0.6 if not conf else 2.5).lock_settings()
    assert "renew_timeout" not in caplog.text
