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
