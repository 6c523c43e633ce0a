"""Settings: lazy app.conf reads, CELERY namespace, per-app isolation, bad values."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_redislock import ConfigurationError, Retry, SingletonTask, Wait
from celery_redislock.settings import app_settings, forget_app_settings


def new_app(**conf: Any) -> Celery:
    app = Celery("config-test", set_as_current=False, set_as_default=False)
    app.conf.update(conf)
    return app


def test_defaults() -> None:
    settings = app_settings(new_app(redislock_url="redis://h:1/2"))
    assert settings.url == "redis://h:1/2"
    assert settings.ttl == 30.0
    assert settings.key_prefix == "redislock"
    assert settings.on_contention.name == "skip"
    assert settings.on_backend_error == "fail"
    assert settings.enabled is True


def test_celery_namespace_spelling_is_read() -> None:
    class DjangoSettings:
        CELERY_REDISLOCK_URL = "redis://ns:1/3"
        CELERY_REDISLOCK_TTL = 12
        CELERY_REDISLOCK_ON_CONTENTION = "retry"

    app = Celery("config-test", set_as_current=False, set_as_default=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    settings = app_settings(app)
    assert (settings.url, settings.ttl, settings.on_contention) == ("redis://ns:1/3", 12.0, Retry())


def test_two_apps_keep_their_own_settings_and_backends() -> None:
    first = app_settings(new_app(redislock_url="redis://one:1/0"))
    second = app_settings(new_app(redislock_url="redis://two:2/0"))
    assert first.url != second.url
    assert first.backend is not second.backend


def test_broker_fallback_only_for_redis_brokers(caplog: pytest.LogCaptureFixture) -> None:
    assert app_settings(new_app(broker_url="redis://b:1/0")).url == "redis://b:1/0"
    assert "redislock_url is not set" in caplog.text
    with pytest.raises(ConfigurationError, match="redislock_url is not set"):
        app_settings(new_app(broker_url="amqp://guest@localhost//"))


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("redislock_ttl", 0, "positive"),
        ("redislock_ttl", -5, "positive"),
        ("redislock_ttl", "30", "number of seconds"),
        ("redislock_on_contention", "later", "must be one of"),
        ("redislock_on_backend_error", "ignore", "'fail' or 'run'"),
        ("redislock_key_prefix", "", "non-empty"),
        ("redislock_redis_options", "socket_timeout=1", "must be a dict"),
        ("redislock_url", "localhost:6379", "redis:// URL"),
        ("redislock_backend_error_max_retries", -1, "int >= 0"),
        ("redislock_store_class", "no_such_module:Store", "cannot be imported"),
        ("redislock_store_class", "collections:OrderedDict", "subclass of LockStore"),
        ("redislock_store_class", dict, "subclass of LockStore"),
        ("redislock_limit", 0, "positive int"),
        ("redislock_limit", "3", "positive int"),
        ("redislock_limit", True, "positive int"),
    ],
)
def test_bad_settings_name_the_problem(setting: str, value: Any, message: str) -> None:
    conf = {"redislock_url": "redis://h:1/0", setting: value}
    with pytest.raises(ConfigurationError, match=setting) as info:
        app_settings(new_app(**conf))
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("lock_ttl", 0, "lock_ttl must be a positive"),
        ("lock_on_contention", "sometimes", "lock_on_contention must be one of"),
        ("lock_on_backend_error", "maybe", "lock_on_backend_error must be 'fail' or 'run'"),
        ("lock_key", "not-callable", "lock_key must be callable"),
        ("lock_limit", 0, "lock_limit must be a positive int"),
        ("lock_limit", 2.5, "lock_limit must be a positive int"),
        ("lock_limit", "3", "lock_limit must be a positive int"),
    ],
)
def test_bad_task_options_fail_at_registration(option: str, value: Any, message: str) -> None:
    app = new_app(redislock_url="redis://h:1/0")
    with pytest.raises(ConfigurationError, match=message):

        @app.task(base=SingletonTask, shared=False, **{option: value})
        def task(x: int) -> None: ...

        task.name  # noqa: B018


def test_task_attributes_override_app_settings() -> None:
    app = new_app(redislock_url="redis://h:1/0", redislock_ttl=10, redislock_on_contention="raise")

    @app.task(base=SingletonTask, shared=False, lock_ttl=3, lock_on_contention=Wait(timeout=1))
    def custom(x: int) -> None: ...

    @app.task(base=SingletonTask, shared=False)
    def inherited(x: int) -> None: ...

    assert (custom._lock_settings().ttl, custom._lock_settings().policy) == (3.0, Wait(timeout=1))
    assert (inherited._lock_settings().ttl, inherited._lock_settings().policy.name) == (
        10.0,
        "raise",
    )


def test_settings_are_read_lazily_and_can_be_forgotten() -> None:
    app = new_app()
    app.conf.redislock_url = "redis://late:1/0"  # set after the app was created
    assert app_settings(app).url == "redis://late:1/0"
    app.conf.redislock_url = "redis://later:1/0"
    forget_app_settings(app)
    assert app_settings(app).url == "redis://later:1/0"
