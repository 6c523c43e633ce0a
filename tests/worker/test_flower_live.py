"""A real Flower process against a real worker: what it shows of a skipped task.

Flower (``celery flower``) runs as a subprocess on the test's own Redis and is
read through its HTTP API, as a user or a dashboard would; the worker is an
embedded one sending task events. What the docs' Flower section
(docs/_parts/observability.md) promises is checked here:

* the skipped task is SUCCESS, its result is the skip value with the holder;
* ``raise`` is a FAILURE with ``LockContended``; ``retry`` shows its retry,
  then (budget spent, ``then=Raise()``) the same FAILURE;
* the ``task-redislock-contended`` event reaches Flower and is counted in its
  Prometheus endpoint (``flower_events_total{type="task-redislock-contended"}``).

Flower's task page and ``/api/task/info`` list only celery's fixed task
fields, so the custom event's own fields (``redislock_key``...) are not shown
there; the docs say so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import LockContended, Raise, Retry, SingletonTask, is_skipped
from celery_redislock.task import CONTENTION_EVENT
from tests.brokers import worker_env
from tests.conftest import embedded_worker
from tests.helpers import hold_lock
from tests.servers import ROOT, RedisServer, free_port, wait_until

pytest.importorskip("flower")

pytestmark = [pytest.mark.worker, pytest.mark.subprocess]


class Flower:
    """A ``celery flower`` subprocess on a free port, read through its HTTP API."""

    def __init__(self, server: RedisServer) -> None:
        self.port = free_port()
        self.log_file = tempfile.NamedTemporaryFile(prefix="redislock-flower-", suffix=".log")
        env = {
            **os.environ,
            **worker_env(),
            "PYTHONPATH": str(ROOT),
            "REDISLOCK_TEST_URL": server.url,
            # Flower 2 serves its API only with authentication or this.
            "FLOWER_UNAUTHENTICATED_API": "true",
        }
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "tests.processes.app",
                "flower",
                f"--port={self.port}",
                "--address=127.0.0.1",
            ],
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(ROOT),
        )

    def log(self) -> str:
        return Path(self.log_file.name).read_text(errors="replace")

    def get(self, path: str) -> tuple[int, str]:
        if self.process.poll() is not None:
            raise RuntimeError(f"flower exited with {self.process.returncode}:\n{self.log()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(errors="replace")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, ""

    def task(self, task_id: str) -> dict[str, Any] | None:
        status, body = self.get(f"/api/task/info/{task_id}")
        return json.loads(body) if status == 200 else None

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.log_file.close()


@pytest.fixture
def flower(server: RedisServer, app_factory: Callable[..., Celery]) -> Iterator[Flower]:
    process = Flower(server)
    try:
        wait_until(
            lambda: process.get("/healthcheck") == (200, "OK"),
            timeout=60,
            interval=0.2,
            message="flower's HTTP server",
        )
        # Events are a fanout: only a receiver already listening gets them.
        # Flower is listening once a probe event shows up in its API.
        probe_app = app_factory()

        def listening() -> bool:
            probe = f"flower-probe-{uuid.uuid4()}"
            with probe_app.events.default_dispatcher() as dispatcher:
                dispatcher.send("task-sent", uuid=probe, name="flower.probe")
            return bool(wait_until_or_none(lambda: process.task(probe), timeout=1.0))

        wait_until(listening, timeout=60, interval=0.1, message="flower's event receiver")
        yield process
    except BaseException:
        print(process.log())
        raise
    finally:
        process.close()


def wait_until_or_none(condition: Callable[[], Any], timeout: float) -> Any:
    try:
        return wait_until(condition, timeout=timeout, interval=0.1)
    except AssertionError:
        return None


def test_flower_shows_skip_raise_retry_and_counts_the_contention_events(
    flower: Flower, app_factory: Callable[..., Celery], lock_client: redis.Redis
) -> None:
    app = app_factory(worker_send_task_events=True, task_send_sent_event=True)

    @app.task(base=SingletonTask, shared=False, name="flower.live.job")
    def job(n: int) -> int:
        return n

    @app.task(
        base=SingletonTask, shared=False, name="flower.live.strict", lock_on_contention="raise"
    )
    def strict(n: int) -> int:
        return n

    @app.task(
        base=SingletonTask,
        shared=False,
        name="flower.live.patient",
        lock_on_contention=Retry(countdown=0.1, max_retries=1, jitter=0, then=Raise()),
    )
    def patient(n: int) -> int:
        return n

    hold_lock(lock_client, job, (1,), holder_task_id="the-holder")
    hold_lock(lock_client, strict, (1,), holder_task_id="the-holder")
    hold_lock(lock_client, patient, (1,), holder_task_id="the-holder")
    with embedded_worker(app, "solo"):
        skipped = job.delay(1)
        assert is_skipped(skipped.get(timeout=30))
        ran = job.delay(2)
        assert ran.get(timeout=30) == 2
        raised = strict.delay(1)
        with pytest.raises(LockContended):
            raised.get(timeout=30)
        retried = patient.delay(1)
        with pytest.raises(LockContended):
            retried.get(timeout=30)

        def shown_as(task_id: str, state: str) -> dict[str, Any] | None:
            task = flower.task(task_id)
            return task if task is not None and task["state"] == state else None

        shown = wait_until(lambda: shown_as(skipped.id, "SUCCESS"), timeout=30, message="skip")
        plain = wait_until(lambda: shown_as(ran.id, "SUCCESS"), timeout=30, message="plain")
        failed = wait_until(lambda: shown_as(raised.id, "FAILURE"), timeout=30, message="raise")
        spent = wait_until(lambda: shown_as(retried.id, "FAILURE"), timeout=30, message="retry")

    # /api/task/info (and the task page): SUCCESS, the skip value with the holder.
    assert shown["name"] == "flower.live.job"
    assert "'__redislock__': 'skipped'" in shown["result"], shown
    assert "'holder': 'the-holder'" in shown["result"], shown
    assert plain["result"] == "2"

    # raise: FAILURE with LockContended; retry: a RETRY, then (budget spent) FAILURE.
    assert "LockContended" in failed["exception"], failed
    assert "LockContended" in spent["exception"], spent
    assert spent["retried"] is not None, spent  # Flower saw its task-retried event

    # /api/tasks, the task list: the same state and result column.
    status, body = flower.get("/api/tasks?taskname=flower.live.job")
    assert status == 200, body
    listed = json.loads(body)
    assert listed[skipped.id]["state"] == "SUCCESS"
    assert "'__redislock__': 'skipped'" in listed[skipped.id]["result"]

    # The contention event: counted per task and worker on Flower's /metrics,
    # once per contended run (the plain run was not contended; the retried
    # task was contended twice: its first run and its one retry).
    def contention_count(task_name: str) -> float | None:
        _status, metrics = flower.get("/metrics")
        for line in metrics.splitlines():
            if (
                line.startswith("flower_events_total{")
                and f'type="{CONTENTION_EVENT}"' in line
                and f'task="{task_name}"' in line
            ):
                return float(line.rsplit(" ", 1)[1])
        return None

    for task_name, expected in [
        ("flower.live.job", 1.0),
        ("flower.live.strict", 1.0),
        ("flower.live.patient", 2.0),
    ]:
        counted = wait_until(
            lambda name=task_name, want=expected: contention_count(name) == want and want,
            timeout=30,
            message=f"{expected} contention event(s) of {task_name}",
        )
        assert counted == expected
