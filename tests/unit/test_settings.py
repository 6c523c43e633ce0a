"""Settings: lazy app.conf reads, CELERY namespace, per-app isolation, bad values."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from celery import Celery

from celery_redislock import ConfigurationError, HandOff, Retry, SingletonTask, Wait
from celery_redislock.settings import (
    DEFAULTS,
    SETTINGS,
    AppSettings,
    app_settings,
    forget_app_settings,
    validate_app_settings,
)


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


# -- the registry and validate_app_settings (issue 14) ----------------------------


def test_registry_is_the_one_list_of_settings() -> None:
    names = [spec.name for spec in SETTINGS]
    assert len(names) == len(set(names))
    assert all(name.startswith("redislock_") for name in names)
    assert dict(DEFAULTS) == {spec.name: spec.default for spec in SETTINGS}
    assert all(spec.doc and spec.shown_default for spec in SETTINGS)
    # Every AppSettings field (but the store it builds) is one registry entry.
    fields = {field.name for field in dataclasses.fields(AppSettings)} - {
        "backend",
        "enqueue_backend",
        "url",
    }
    assert {f"redislock_{field}" for field in fields} <= set(names)
    # Every task attribute the merge reads is declared on the task class.
    attributes = [spec.task_attribute for spec in SETTINGS if spec.task_attribute]
    assert all(hasattr(SingletonTask, attribute) for attribute in attributes)
    assert "lock_ttl" in attributes


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("redislock_on_contention", "skipp", "did you mean 'skip'?"),
        ("redislock_on_lost", "abrot", "did you mean 'abort'?"),
        ("redislock_on_backend_error", "fial", "did you mean 'fail'?"),
        ("redislock_enabled", "no", "must be True or False"),
        ("redislock_enqueue", "yes", "must be False, True, 'until_done' or 'until_start'"),
        ("redislock_enqueue_raise", 2, "must be True or False"),
        ("redislock_enqueue_ttl", -1, "positive"),
        ("redislock_fence_ttl", "1h", "number of seconds"),
        ("redislock_renew_timeout", 0, "positive"),
        ("redislock_hold_after_success", True, "number of seconds"),
        ("redislock_beat_on_contention", "never", "must be one of"),
        ("redislock_min_replicas", 1.5, "int >= 0"),
        ("redislock_min_replicas_timeout", 0, "positive"),
    ],
)
def test_each_bad_value_is_named_with_its_reason(setting: str, value: Any, message: str) -> None:
    app = new_app(redislock_url="redis://h:1/0", **{setting: value})
    with pytest.raises(ConfigurationError) as info:
        validate_app_settings(app.conf)
    assert str(info.value).startswith(f"{setting} must be")
    assert message in str(info.value)
    with pytest.raises(ConfigurationError, match=setting):
        app_settings(app)  # the same check at first use (a producer's delay())


def test_misspelled_setting_name_gets_a_did_you_mean() -> None:
    app = new_app(redislock_url="redis://h:1/0", redislock_tll=5)
    with pytest.raises(ConfigurationError) as info:
        app_settings(app)
    assert str(info.value) == (
        "redislock_tll is not a celery-redislock setting; did you mean redislock_ttl?"
    )


def test_a_name_like_no_setting_is_reported_without_a_guess() -> None:
    app = new_app(redislock_url="redis://h:1/0", redislock_zzzzqq=1)
    with pytest.raises(ConfigurationError, match="redislock_zzzzqq is not a celery-redislock"):
        validate_app_settings(app.conf)


def test_uppercase_name_without_a_namespace_is_not_read_and_is_reported() -> None:
    app = new_app(redislock_url="redis://h:1/0", REDISLOCK_TTL=5)
    with pytest.raises(ConfigurationError, match=r"REDISLOCK_TTL .* did you mean redislock_ttl\?"):
        validate_app_settings(app.conf)


def test_namespaced_settings_are_named_as_spelled() -> None:
    class DjangoSettings:
        CELERY_REDISLOCK_URL = "redis://:s3cret@ns:1/3"
        CELERY_REDISLOCK_TLL = 12
        CELERY_REDISLOCK_ON_CONTENTION = "skipp"

    app = Celery("config-test", set_as_current=False, set_as_default=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    with pytest.raises(ConfigurationError) as info:
        validate_app_settings(app.conf)
    message = str(info.value)
    assert "CELERY_REDISLOCK_TLL is not a celery-redislock setting" in message
    assert "did you mean CELERY_REDISLOCK_TTL?" in message
    assert "CELERY_REDISLOCK_ON_CONTENTION must be one of" in message
    assert "s3cret" not in message


def test_several_bad_settings_are_reported_together() -> None:
    app = new_app(
        redislock_url="redis://:s3cret@h:1/0",
        redislock_tll=5,
        redislock_on_contention="skipp",
        redislock_enqueue_ttl=0,
        redislock_min_replicas=-1,
    )
    with pytest.raises(ConfigurationError) as info:
        app_settings(app)
    lines = str(info.value).splitlines()
    assert lines[0] == "4 celery-redislock settings are wrong:"
    assert [line.split()[1] for line in lines[1:]] == [
        "redislock_tll",
        "redislock_on_contention",
        "redislock_enqueue_ttl",
        "redislock_min_replicas",
    ]
    assert "s3cret" not in str(info.value)


def test_a_bad_url_never_shows_its_password() -> None:
    app = new_app(redislock_url="h:1:s3cret@x", redislock_ttl=0)
    with pytest.raises(ConfigurationError, match="2 celery-redislock settings") as info:
        validate_app_settings(app.conf)
    assert "s3cret" not in str(info.value)


def test_settings_no_task_inherits_are_still_validated() -> None:
    # No task at all: a bad redislock_enqueue_ttl is still found, not when a
    # lock_enqueue task first inherits it.
    app = new_app(redislock_url="redis://h:1/0", redislock_enqueue_ttl="10m")
    with pytest.raises(ConfigurationError, match="redislock_enqueue_ttl must be a number"):
        validate_app_settings(app.conf)


def test_valid_settings_pass() -> None:
    app = new_app(
        redislock_url="redis://h:1/0",
        redislock_ttl=5,
        redislock_enabled=0,
        redislock_on_contention=Retry(max_retries=1),
        redislock_store_class="celery_redislock.store:LockStore",
    )
    validate_app_settings(app.conf)
    assert app_settings(app).enabled is False


@pytest.mark.parametrize("option", ["lock_enabled", "lock_enqueue", "lock_enqueue_raise"])
def test_bad_flag_task_options_fail_at_registration(option: str) -> None:
    app = new_app(redislock_url="redis://h:1/0")
    with pytest.raises(ConfigurationError, match=f"{option} must be (True or False|False, True)"):

        @app.task(base=SingletonTask, shared=False, **{option: "false"})
        def task(x: int) -> None: ...

        task.name  # noqa: B018


def test_namespaced_spelling_without_the_namespace_is_reported() -> None:
    class DjangoSettings:
        CELERY_REDISLOCK_TTL = 12

    app = Celery("config-test", set_as_current=False, set_as_default=False)
    app.config_from_object(DjangoSettings)
    app.conf.redislock_url = "redis://h:1/0"
    with pytest.raises(ConfigurationError) as info:
        validate_app_settings(app.conf)
    assert str(info.value) == (
        "CELERY_REDISLOCK_TTL is not read: the app's config was loaded without "
        "namespace='CELERY'; did you mean redislock_ttl?"
    )


def test_unprefixed_uppercase_name_under_a_namespace_gets_the_namespaced_spelling() -> None:
    class DjangoSettings:
        CELERY_REDISLOCK_URL = "redis://h:1/0"
        REDISLOCK_TTL = 12

    app = Celery("config-test", set_as_current=False, set_as_default=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    with pytest.raises(ConfigurationError, match=r"REDISLOCK_TTL is not .*CELERY_REDISLOCK_TTL\?"):
        validate_app_settings(app.conf)


def test_both_spellings_celery_reads_under_a_namespace_are_accepted() -> None:
    class DjangoSettings:
        CELERY_REDISLOCK_URL = "redis://h:1/0"
        CELERY_REDISLOCK_TTL = 12

    app = Celery("config-test", set_as_current=False, set_as_default=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    app.conf.redislock_on_contention = "raise"
    validate_app_settings(app.conf)
    settings = app_settings(app)
    assert (settings.ttl, settings.on_contention.name) == (12.0, "raise")


@pytest.mark.parametrize(
    "options",
    [
        {"lock_on_contention": "handoff"},
        {"lock_on_contention": Wait(then=HandOff())},
        {"lock_debounce": 1},
        {"lock_enqueue": "until_start"},
    ],
)
def test_lock_limit_works_with_hand_off_coalescing_and_debounce(options: dict[str, Any]) -> None:
    app = new_app(redislock_url="redis://h:1/0")

    @app.task(base=SingletonTask, shared=False, lock_limit=3, **options)
    def task(x: int) -> None: ...

    assert task._lock_settings().limit == 3


def test_lock_limit_with_enqueue_until_done_is_refused() -> None:
    app = new_app(redislock_url="redis://h:1/0")
    with pytest.raises(ConfigurationError, match="lock_limit=3 cannot be combined with lock_enq"):

        @app.task(base=SingletonTask, shared=False, lock_limit=3, lock_enqueue=True)
        def task(x: int) -> None: ...

        task.name  # noqa: B018


@pytest.mark.parametrize(
    ("conf", "options"),
    [
        ({"redislock_enqueue": True, "redislock_debounce": 2}, {}),
        ({"redislock_debounce": 2}, {"lock_enqueue": True}),
        ({"redislock_enqueue": "until_start"}, {"lock_debounce": 2}),
    ],
)
def test_debounce_with_enqueue_is_refused_however_the_two_are_set(
    conf: dict[str, Any], options: dict[str, Any]
) -> None:
    # Only both on the task class were refused; merged, debounce silently won.
    app = new_app(redislock_url="redis://h:1/0", **conf)

    @app.task(base=SingletonTask, shared=False, **options)
    def task(x: int) -> None: ...

    with pytest.raises(ConfigurationError, match="set lock_debounce or lock_enqueue, not both"):
        task._lock_settings()


def test_a_task_may_turn_off_the_apps_enqueue_to_debounce() -> None:
    app = new_app(redislock_url="redis://h:1/0", redislock_enqueue=True)

    @app.task(base=SingletonTask, shared=False, lock_debounce=2, lock_enqueue=False)
    def task(x: int) -> None: ...

    settings = task._lock_settings()
    assert settings.debounce == 2 and not settings.enqueue


@pytest.mark.parametrize(
    ("conf", "expected"),
    [
        (
            {"redislock_redis_options": {"socket_timout": 2}},
            "redislock_redis_options: socket_timout is not a redis-py connection option; "
            "did you mean socket_timeout?",
        ),
        (
            {"redislock_redis_options": {"socket_timeout": "abc"}},
            "redislock_redis_options: socket_timeout must be a number of seconds >= 0 or None, "
            "got 'abc'",
        ),
        (
            {"redislock_redis_options": {"max_connections": 0}},
            "redislock_redis_options: max_connections must be an int >= 1 or None, got 0",
        ),
        (
            {"redislock_url": "redis://h:1/2?socket_timout=2"},
            "socket_timout is not a redis-py connection option; did you mean socket_timeout?",
        ),
    ],
)
def test_a_redis_option_redis_py_would_refuse_at_the_first_command_is_refused_now(
    conf: dict[str, Any], expected: str
) -> None:
    # A worker started with these, and every command failed with a TypeError
    # (or the worker exited with a 23-frame traceback) (review helper-29).
    app = new_app(**{"redislock_url": "redis://h:1/0", **conf})
    with pytest.raises(ConfigurationError) as info:
        validate_app_settings(app.conf)
    assert expected in str(info.value)


def test_the_redis_options_users_set_are_accepted() -> None:
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    options = {
        "socket_timeout": 2,
        "socket_connect_timeout": 1.5,
        "health_check_interval": 0,
        "max_connections": 50,
        "retry": Retry(NoBackoff(), 1),
        "ssl_cert_reqs": "none",
        "client_name": "payments",
        "sentinel_kwargs": {"password": "x"},
        "read_from_replicas": False,
        # Sentinel's and Redis.from_url's own (review helper-30: refused, and
        # a worker that started before stopped).
        "force_master_ip": "10.0.0.1",
        "min_other_sentinels": 0,
        "single_connection_client": False,
    }
    app = new_app(
        redislock_url="redis://h:1/0?socket_timeout=2&health_check_interval=10"
        "&single_connection_client=false&protocol=3",
        redislock_redis_options=options,
    )
    validate_app_settings(app.conf)


@pytest.mark.parametrize(
    "conf",
    [
        {"redislock_ttl": 1e17},
        {"redislock_enqueue_ttl": 1e17},
        {"redislock_hold_after_success": 1e12},
        {"redislock_debounce": 1e11},
    ],
)
def test_a_duration_redis_cannot_expire_is_refused(conf: dict[str, Any]) -> None:
    # 1e17 s passed as positive and finite; Redis refused every SET PX
    # ("value is not an integer or out of range"): every run retried, then
    # failed, and lock_enqueue published without its lock (review helper-29).
    app = new_app(redislock_url="redis://h:1/0", **conf)
    with pytest.raises(ConfigurationError, match="at most 10000000000 seconds"):
        validate_app_settings(app.conf)


def test_a_century_long_idempotency_window_is_accepted() -> None:
    # "Once per key, ever": a ten-year cap refused it (review helper-30).
    app = new_app(redislock_url="redis://h:1/0", redislock_hold_after_success=100 * 365 * 86400)
    validate_app_settings(app.conf)
