"""Worker start: bad settings stop an embedded worker; the lock store is checked once."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from celery import Celery

from celery_redislock import ConfigurationError, SingletonTask, scripts
from tests.conftest import LOCK_DB, embedded_worker
from tests.servers import RedisServer, free_port

pytestmark = pytest.mark.worker

STARTUP_LOGGER = "celery_redislock.startup"
SHAS = [scripts.ACQUIRE.sha, scripts.RELEASE.sha, scripts.RENEW.sha]


def _startup_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == STARTUP_LOGGER]


def test_bad_settings_stop_an_embedded_worker_before_it_starts(app_factory: Any) -> None:
    app = app_factory(redislock_tll=5, redislock_on_contention="skipp")

    @app.task(base=SingletonTask, shared=False)
    def job() -> None: ...

    with pytest.raises(ConfigurationError) as info, embedded_worker(app):
        pytest.fail("the worker started")
    message = str(info.value)
    assert "redislock_tll is not a celery-redislock setting; did you mean redislock_ttl?" in message
    assert "redislock_on_contention must be one of" in message
    assert "did you mean 'skip'?" in message


def test_reachable_store_loads_the_scripts_and_says_so_once(
    app_factory: Any, server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    server.client().script_flush()
    app = app_factory()

    @app.task(base=SingletonTask, shared=False)
    def job() -> str:
        return "ran"

    with caplog.at_level(logging.INFO, logger=STARTUP_LOGGER), embedded_worker(app, "threads", 2):
        assert server.client(LOCK_DB).script_exists(*SHAS) == [True, True, True]
        assert job.delay().get(timeout=10) == "ran"
    (line,) = _startup_lines(caplog)
    assert line.levelno == logging.INFO
    assert line.getMessage() == (
        f"celery-redislock: lock store {server.url_for(LOCK_DB)} answers; "
        "acquire, release and renew scripts loaded."
    )


def test_unreachable_store_is_logged_once_and_the_worker_still_starts(
    app_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    closed_port = free_port()
    app = app_factory(redislock_url=f"redis://:s3cret@127.0.0.1:{closed_port}/0")

    @app.task(base=SingletonTask, shared=False)
    def job() -> None: ...

    with caplog.at_level(logging.INFO, logger=STARTUP_LOGGER), embedded_worker(app) as worker:
        assert worker.app is app  # start_worker returned: the worker answered its ping
    (line,) = _startup_lines(caplog)
    assert line.levelno == logging.WARNING
    message = line.getMessage()
    assert f"redis://127.0.0.1:{closed_port}/0 is unavailable" in message
    assert "The worker starts anyway (Redis may come up later)" in message
    assert "redislock_on_backend_error='fail'" in message
    assert "s3cret" not in caplog.text


def test_an_app_without_singleton_tasks_or_settings_is_not_checked(
    caplog: pytest.LogCaptureFixture, server: RedisServer
) -> None:
    app = Celery("plain", set_as_current=False)
    app.conf.update(
        broker_url=server.url_for(0),
        result_backend=server.url_for(1),
        task_default_queue="tests",
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
    )
    try:
        with caplog.at_level(logging.INFO, logger=STARTUP_LOGGER), embedded_worker(app):
            pass
    finally:
        app.close()
    assert _startup_lines(caplog) == []
