"""Worker start with a real `celery worker`: bad settings refuse to start; a dead store does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.brokers import worker_env
from tests.servers import ROOT, CeleryWorkerProcess, RedisServer, free_port

pytestmark = [pytest.mark.subprocess]

APP = "tests.processes.startup_app"


def test_bad_settings_stop_celery_worker_before_ready(server: RedisServer) -> None:
    conf = {"redislock_tll": 5, "redislock_on_contention": "skipp"}
    env = {
        **os.environ,
        **worker_env(),
        "PYTHONPATH": str(ROOT),
        "REDISLOCK_TEST_URL": server.url,
        "REDISLOCK_TEST_CONF": json.dumps(conf),
    }
    command = [sys.executable, "-m", "celery", "-A", APP, "worker", "-P", "solo", "-l", "info"]
    command += ["--without-heartbeat", "--without-mingle", "--without-gossip"]
    done = subprocess.run(
        command, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, done.stderr
    assert "celery-redislock: the worker cannot start: 2 celery-redislock settings" in done.stderr
    assert "redislock_tll is not a celery-redislock setting; did you mean redislock_ttl?" in (
        done.stderr
    )
    assert "redislock_on_contention must be one of" in done.stderr
    assert "did you mean 'skip'?" in done.stderr
    assert "Traceback" not in done.stderr
    assert "ready." not in done.stdout + done.stderr


def test_unreachable_store_is_logged_once_and_celery_worker_still_starts(
    server: RedisServer,
) -> None:
    closed_port = free_port()
    env = {
        "REDISLOCK_TEST_URL": server.url,
        "REDISLOCK_TEST_LOCK_URL": f"redis://:s3cret@127.0.0.1:{closed_port}/0",
    }
    worker = CeleryWorkerProcess(APP, env, pool="prefork", concurrency=2, name="startup")
    try:
        worker.wait_ready()
        log = worker.log()
    finally:
        worker.close()
    warnings = [line for line in log.splitlines() if "celery-redislock:" in line]
    assert len(warnings) == 1, log
    assert "WARNING/MainProcess" in warnings[0]
    assert f"redis://127.0.0.1:{closed_port}/0 is unavailable" in warnings[0]
    assert "The worker starts anyway" in warnings[0]
    assert "s3cret" not in log


def _start_and_fail(server: RedisServer, **env: str) -> subprocess.CompletedProcess[str]:
    """Run `celery worker` on the start-up app until it exits (it must, before ready)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "REDISLOCK_TEST_URL": server.url, **env}
    command = [sys.executable, "-m", "celery", "-A", APP, "worker", "-P", "solo", "-l", "info"]
    command += ["--without-heartbeat", "--without-mingle", "--without-gossip"]
    return subprocess.run(
        command, env=full_env, cwd=str(ROOT), capture_output=True, text=True, timeout=60
    )


def _the_one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The worker's one CRITICAL line; it must have exited 1, before ready, without a traceback."""
    assert done.returncode == 1, done.stdout + done.stderr
    output = done.stdout + done.stderr
    assert "Traceback" not in output and "ready." not in output, output
    lines = [line for line in output.splitlines() if "celery-redislock" in line]
    assert len(lines) == 1, output
    assert "CRITICAL/MainProcess] celery-redislock: the worker cannot start: " in lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"lock_ttl": -1}, "task tests.processes.startup_app.job: lock_ttl must be a positive"),
        (
            {"lock_on_contention": "skipp"},
            "task tests.processes.startup_app.job: lock_on_contention must be one of",
        ),
        (
            {"lock_tll": 10},
            "task tests.processes.startup_app.job: lock_tll=10 is not a celery-redislock "
            "task option; did you mean lock_ttl?",
        ),
        (
            {"lock_enqueue": "until-start"},
            "lock_enqueue must be False, True, 'until_done' or 'until_start', got "
            "'until-start'; did you mean 'until_start'?",
        ),
    ],
)
def test_a_bad_task_option_stops_celery_worker_with_one_line(
    server: RedisServer, options: dict[str, object], expected: str
) -> None:
    # The @app.task class is made when the worker finalizes the app, before
    # it set up logging: it used to print a 57-line traceback.
    line = _the_one_line(_start_and_fail(server, REDISLOCK_TEST_TASK_OPTIONS=json.dumps(options)))
    assert expected in line
    if "lock_on_contention" in options:
        assert line.endswith("got 'skipp'; did you mean 'skip'?")


def test_a_bad_attribute_of_a_task_class_stops_celery_worker_with_one_line(
    server: RedisServer,
) -> None:
    # This class is made while Celery's command line imports the app module,
    # which reports an Exception there with its traceback (and status 2).
    done = _start_and_fail(server, REDISLOCK_TEST_BASE_OPTIONS=json.dumps({"lock_arg": ["x"]}))
    line = _the_one_line(done)
    assert line.endswith(
        "task Base: lock_arg=['x'] is not a celery-redislock task option; did you mean lock_args?"
    )


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:{port}/2", "cannot name a Redis server: use redis://, rediss://"),
        ("redis://127.0.0.1:{port}/two", "the database must be a number"),
    ],
)
def test_a_url_that_cannot_name_a_redis_server_stops_celery_worker(
    server: RedisServer, url: str, expected: str
) -> None:
    # It used to start, and every task retried for 204 s before failing.
    lock_url = url.format(port=server.port)
    line = _the_one_line(_start_and_fail(server, REDISLOCK_TEST_LOCK_URL=lock_url))
    assert f"redislock_url {lock_url!r}" in line and expected in line


@pytest.mark.parametrize(
    ("conf", "options", "named"),
    [
        ({"redislock_limit": 2, "redislock_hold_after_success": 5}, {}, "lock_limit"),
        ({"redislock_enqueue": True}, {"lock_limit": 2}, "lock_limit"),
        ({"redislock_enqueue": "until_start"}, {"lock_debounce": 2}, "lock_debounce"),
        ({"redislock_debounce": 2, "redislock_enqueue": True}, {}, "lock_debounce"),
    ],
)
def test_a_combination_refused_only_once_merged_stops_celery_worker(
    server: RedisServer, conf: dict[str, object], options: dict[str, object], named: str
) -> None:
    # Each setting is fine alone; the task's merged settings are refused.
    # They were checked only when a task ran: the worker started, and every
    # run failed with the ConfigurationError.
    done = _start_and_fail(
        server,
        REDISLOCK_TEST_CONF=json.dumps(conf),
        REDISLOCK_TEST_TASK_OPTIONS=json.dumps(options),
    )
    line = _the_one_line(done)
    assert "task tests.processes.startup_app.job" in line and named in line, line


def test_a_misspelled_redis_option_stops_celery_worker_with_one_line(server: RedisServer) -> None:
    # It exited 1 with redis-py's TypeError and a 23-frame traceback.
    conf = {"redislock_redis_options": {"socket_timout": 2}}
    line = _the_one_line(_start_and_fail(server, REDISLOCK_TEST_CONF=json.dumps(conf)))
    assert line.endswith(
        "redislock_redis_options: socket_timout is not a redis-py connection option; "
        "did you mean socket_timeout?"
    )


def test_a_database_the_server_does_not_have_stops_celery_worker(server: RedisServer) -> None:
    # The server answers "DB index is out of range": no wait mends that. The
    # worker started with a warning, and every task retried, then failed.
    lock_url = f"redis://127.0.0.1:{server.port}/99"
    line = _the_one_line(_start_and_fail(server, REDISLOCK_TEST_LOCK_URL=lock_url))
    assert "DB index is out of range" in line and "databases" in line, line
