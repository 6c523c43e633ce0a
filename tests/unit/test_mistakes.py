"""Mistakes that used to pass without a word (issue 25): each is an error, with a hint.

A misspelled task option, an enumerated value one character off, and a
lock-store URL that cannot name a Redis server are refused where they are
made: the task class when it is created, the settings when they are first
read (a worker does that at start, see tests/processes/test_startup.py).
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_redislock import ConfigurationError, SingletonTask
from celery_redislock.settings import app_settings, validate_app_settings


def new_app(**conf: Any) -> Celery:
    app = Celery("mistakes-test", set_as_current=False, set_as_default=False)
    app.conf.update(redislock_url="redis://h:1/0", **conf)
    return app


def make_task(app: Celery, base: type = SingletonTask, **options: Any) -> Any:
    @app.task(base=base, shared=False, **options)
    def job(x: int) -> None: ...

    return job.name  # the class is created here: the app is finalized on first use


# -- task options ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        (
            "lock_tll",
            10,
            "lock_tll=10 is not a celery-redislock task option; did you mean lock_ttl?",
        ),
        (
            "lock_arg",
            ("x",),
            "lock_arg=('x',) is not a celery-redislock task option; did you mean lock_args?",
        ),
        (
            "lock_enque",
            True,
            "lock_enque=True is not a celery-redislock task option; did you mean lock_enqueue?",
        ),
        (
            "lock_contention",
            "skip",
            "lock_contention='skip' is not a celery-redislock task option; "
            "did you mean lock_on_contention?",
        ),
    ],
)
def test_a_misspelled_task_option_is_an_error_with_a_guess(
    option: str, value: Any, message: str
) -> None:
    with pytest.raises(ConfigurationError) as info:
        make_task(new_app(), **{option: value})
    assert str(info.value) == f"task tests.unit.test_mistakes.job: {message}"


def test_a_lock_name_like_no_option_lists_the_options() -> None:
    with pytest.raises(ConfigurationError) as info:
        make_task(new_app(), lock_zzqqxx=1)
    message = str(info.value)
    assert "lock_zzqqxx=1 is not a celery-redislock task option" in message
    assert "lock_args, lock_key, lock_ttl" in message


def test_a_misspelled_option_fails_when_the_class_is_made_even_on_a_finalized_app() -> None:
    app = new_app()
    app.finalize()
    with pytest.raises(ConfigurationError, match="did you mean lock_ttl"):

        @app.task(base=SingletonTask, shared=False, lock_tll=10)
        def job(x: int) -> None: ...


def test_a_misspelled_attribute_of_a_task_class_fails_at_the_class_statement() -> None:
    with pytest.raises(ConfigurationError) as info:

        class Base(SingletonTask):  # type: ignore[type-arg]
            lock_on_contentoin = "retry"

    assert "did you mean lock_on_contention?" in str(info.value)
    assert str(info.value).startswith("task ")


def test_a_method_named_like_an_option_is_refused_too() -> None:
    # lock_* names belong to the options: a helper named so would shadow a
    # future option, and a typo of one looks the same.
    with pytest.raises(ConfigurationError, match="lock_helper is not a celery-redislock"):

        class Base(SingletonTask):  # type: ignore[type-arg]
            def lock_helper(self) -> str:
                return "x"


def test_the_known_options_and_the_classes_own_names_pass() -> None:
    class Base(SingletonTask):  # type: ignore[type-arg]
        lock_ttl = 5
        lock_args = ("x",)

        def lock_key_for(self, args: Any, kwargs: Any) -> str:  # overrides the helper
            return super().lock_key_for(args, kwargs)

    assert make_task(new_app(), base=Base, lock_enqueue="until_start", lock_limit=2)


def test_several_task_option_mistakes_are_reported_together() -> None:
    with pytest.raises(ConfigurationError) as info:
        make_task(new_app(), lock_tll=10, lock_ttl=-1, lock_on_contention="skipp")
    lines = str(info.value).splitlines()
    assert lines[0] == "3 options of task tests.unit.test_mistakes.job are wrong:"
    assert "  - lock_tll=10 is not a celery-redislock task option; did you mean lock_ttl?" in lines
    assert any(line.startswith("  - lock_ttl must be a positive") for line in lines)
    assert any("did you mean 'skip'?" in line for line in lines)


# -- enumerated values -----------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "guess"),
    [
        ("lock_enqueue", "until-start", "did you mean 'until_start'?"),
        ("lock_enqueue", "until_don", "did you mean 'until_done'?"),
        ("lock_enqueue", "true", "did you mean True?"),
        ("lock_on_contention", "handof", "did you mean 'handoff'?"),
        ("lock_beat_on_contention", "Skipp", "did you mean 'skip'?"),
        ("lock_on_backend_error", "runn", "did you mean 'run'?"),
        ("lock_on_lost", "reprot", "did you mean 'report'?"),
        ("lock_enabled", "false", "did you mean False?"),
        ("lock_enqueue_raise", "yes", "did you mean True?"),
    ],
)
def test_an_enumerated_task_option_one_step_off_gets_a_guess(
    option: str, value: str, guess: str
) -> None:
    with pytest.raises(ConfigurationError) as info:
        make_task(new_app(), **{option: value})
    message = str(info.value)
    assert message.startswith(f"task tests.unit.test_mistakes.job: {option} must be")
    assert repr(value) in message and message.endswith(guess)


@pytest.mark.parametrize(
    ("setting", "value", "guess"),
    [
        ("redislock_enqueue", "until-start", "did you mean 'until_start'?"),
        ("redislock_on_contention", "wiat", "did you mean 'wait'?"),
        ("redislock_beat_on_contention", "retyr", "did you mean 'retry'?"),
        ("redislock_on_backend_error", "fial", "did you mean 'fail'?"),
        ("redislock_on_lost", "abrot", "did you mean 'abort'?"),
        ("redislock_enabled", "off", "did you mean False?"),
        ("redislock_recover_on_start", "1", "did you mean True?"),
    ],
)
def test_an_enumerated_setting_one_step_off_gets_a_guess(
    setting: str, value: str, guess: str
) -> None:
    with pytest.raises(ConfigurationError) as info:
        validate_app_settings(new_app(**{setting: value}).conf)
    assert str(info.value).startswith(f"{setting} must be")
    assert str(info.value).endswith(guess)


# -- the lock-store URL ----------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (
            "http://localhost:6379/0",
            "redislock_url 'http://localhost:6379/0' cannot name a Redis server: use "
            "redis://, rediss:// (TLS), unix://, sentinel:// or redis+cluster://",
        ),
        ("reddis://localhost:6379/0", "did you mean 'redis://'?"),
        # redis-py reads the scheme case-sensitively: it would fail at the first lock.
        ("REDIS://localhost:6379/0", "did you mean 'redis://'?"),
        ("redis+cluster://h:7000/2", "Redis Cluster has only database 0"),
        ("amqp://guest@localhost//", "cannot name a Redis server"),
        ("redis://localhost:63a9/0", "is not a valid Redis URL"),
        ("redis://localhost:6379/zero", "is not a valid Redis URL"),
        ("redis+cluster://localhost:port", "is not a valid Redis URL"),
        ("sentinel://localhost:26379", "is not a valid Redis URL"),
        ("sentinel://localhost/mymaster", "is not a valid Redis URL"),
    ],
)
def test_a_url_that_cannot_name_a_redis_server_is_a_configuration_error(
    url: str, message: str
) -> None:
    app = new_app()
    app.conf.redislock_url = url
    with pytest.raises(ConfigurationError, match="redislock_url") as info:
        validate_app_settings(app.conf)
    assert message in str(info.value)
    with pytest.raises(ConfigurationError):
        app_settings(app)  # the producer's first delay() says the same


def test_a_bad_url_never_shows_its_password() -> None:
    for url in (
        "http://user:s3cret@h:1/0",
        "redis://:s3cret@h:port/0",
        "redis://:s3cret@h:1/x",
        "redis://user:Zx81kQ/s3cret@127.0.0.1:1/0",  # an unencoded / in the password
        "redis://user:s3cret?x@127.0.0.1:1/0",  # an unencoded ? in the password
    ):
        app = new_app()
        app.conf.redislock_url = url
        with pytest.raises(ConfigurationError) as info:
            validate_app_settings(app.conf)
        assert "s3cret" not in str(info.value), url


@pytest.mark.parametrize(
    "url",
    [
        "redis://localhost:6379/2",
        "redis://",
        "rediss://:pw@h:6380/0?ssl_cert_reqs=required",
        "unix:///run/redis.sock?db=2",
        "sentinel://h1:26379,h2:26379/mymaster/2",
        "redis+cluster://h:7000",
        "rediss+cluster://h:7000",
    ],
)
def test_urls_that_name_a_redis_server_pass_without_connecting(url: str) -> None:
    app = new_app()
    app.conf.redislock_url = url
    validate_app_settings(app.conf)  # no server runs at any of them
    assert app_settings(app).url == url
