"""Worker start: bad settings stop an embedded worker; the lock store is checked once."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from celery import Celery

from celery_redislock import ConfigurationError, SingletonTask, is_skipped, scripts
from celery_redislock.recovery import process_started_ms
from celery_redislock.task import SingletonTaskMixin
from celery_redislock.tokens import LockOwner, LockValue
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
    # Tasks other test modules declared with the default shared=True join
    # every app; this app must have none of the package's.
    app.finalize()
    for name, task in list(app.tasks.items()):
        if isinstance(task, SingletonTaskMixin):
            app.tasks.unregister(name)
    try:
        with caplog.at_level(logging.INFO, logger=STARTUP_LOGGER), embedded_worker(app):
            pass
    finally:
        app.close()
    assert _startup_lines(caplog) == []


# -- start-up recovery (issue 13) ---------------------------------------------


def _left_by_a_dead_run(client: Any, key: str, node: str) -> str:
    """Store a lock value as a killed earlier run of worker ``node`` left it."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its pid runs no more
    owner = LockOwner("dead-run", 0, node, child.pid)
    # Taken before this process (the embedded worker's) started: only such
    # locks can be a previous run's.
    this_process = process_started_ms(os.getpid()) or int(time.time() * 1000)
    value = LockValue(owner, "cd" * 16, "job", this_process - 5_000).encode()
    assert client.set(key, value, px=60_000)
    return value


@pytest.mark.parametrize("recover", [True, False])
def test_an_embedded_worker_frees_its_previous_runs_locks_before_it_starts(
    app_factory: Any, lock_client: Any, caplog: pytest.LogCaptureFixture, recover: bool
) -> None:
    app = app_factory(redislock_recover_on_start=recover)

    @app.task(base=SingletonTask, shared=False)
    def job() -> str:
        return "ran"

    node = "recovering@embedded"
    ours = _left_by_a_dead_run(lock_client, job.lock_key_for((), {}), node)
    elsewhere = _left_by_a_dead_run(lock_client, "redislock:other:{x}", "recovering@elsewhere")
    with (
        caplog.at_level(logging.INFO, logger="celery_redislock.recovery"),
        embedded_worker(app, "threads", 2, hostname=node),
    ):
        # start_worker returns once the worker answered a ping: after the bootstep.
        if recover:
            assert lock_client.exists(job.lock_key_for((), {})) == 0
            assert job.delay().get(timeout=10) == "ran"
        else:
            assert lock_client.get(job.lock_key_for((), {})).decode() == ours
            assert is_skipped(job.delay().get(timeout=10))
    assert lock_client.get("redislock:other:{x}").decode() == elsewhere
    lines = [r.getMessage() for r in caplog.records if r.name == "celery_redislock.recovery"]
    if recover:
        assert len(lines) == 2
        assert lines[1].startswith(
            f"celery-redislock: recovered 1 lock left by a previous run of {node}"
        )
    else:
        assert lines == []
