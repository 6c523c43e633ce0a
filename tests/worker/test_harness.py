"""The embedded-worker fixture itself: a prefork worker stuck stopping is freed.

Celery's embedded prefork worker stops by terminating its pool. A child killed
while it writes a result leaves half a message in its pipe, and the parent's
shutdown blocks reading the rest for ever (seen in CI after a task that raised
``Ignore``). ``embedded_worker`` then kills the children and closes the
parent's write end of their pipes; this reproduces the stuck read.
"""

from __future__ import annotations

import os
import signal
import struct
import threading
import time

import pytest
import redis
from billiard.pool import TERMINATE
from celery import Celery

from tests.brokers import RABBITMQ, rabbitmqctl
from tests.conftest import embedded_worker
from tests.servers import wait_until

pytestmark = [pytest.mark.worker, pytest.mark.slow]


def test_a_prefork_worker_stuck_on_a_half_written_result_is_stopped(
    app: Celery, record: redis.Redis
) -> None:
    @app.task(shared=False)
    def stubborn() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # survives the pool's terminate
        record.set("started", 1)
        time.sleep(300)

    with embedded_worker(app, "prefork", 1) as worker:
        stubborn.delay()
        wait_until(lambda: record.get("started"), timeout=10, message="the task to start")
        pool = worker.pool._pool
        children = list(pool._pool)

        def half_write_a_result() -> None:
            # Once the pool is being terminated (the event loop no longer reads
            # the pipes): a header announcing 1,000 bytes, and 10 of them (what
            # a child killed mid-write leaves).
            wait_until(lambda: pool._state == TERMINATE, timeout=60, message="the pool's stop")
            for child in children:
                os.write(child.outq._writer.fileno(), struct.pack("!i", 1000) + b"x" * 10)

        threading.Thread(target=half_write_a_result, daemon=True).start()
    # Celery's own join gave up after 20 s (RuntimeError); the fixture freed it.
    assert worker.thread is not None and not worker.thread.is_alive()


@pytest.mark.skipif(not RABBITMQ, reason="rabbitmqctl runs only for the RabbitMQ brokers")
def test_rabbitmqctl_returns_although_a_process_forked_during_the_call_lives_on() -> None:
    """A prefork pool replaces a killed child while the test runs ``rabbitmqctl``.

    The fork copies the call's output pipe into the new pool process, which
    lives as long as the worker; the call must end when ``rabbitmqctl`` does
    (CI: a redelivery test hung 120 s on a pipe that never saw end-of-file).
    """
    forked: list[int] = []
    stop = threading.Event()

    def fork_while_the_call_runs() -> None:
        while not stop.is_set():
            pid = os.fork()
            if pid == 0:  # the "pool process": holds every inherited descriptor
                time.sleep(60)
                os._exit(0)
            forked.append(pid)
            time.sleep(0.002)

    forker = threading.Thread(target=fork_while_the_call_runs, daemon=True)
    forker.start()
    started = time.monotonic()
    try:
        assert rabbitmqctl("list_vhosts", "--no-table-headers").strip()
    finally:
        stop.set()
        forker.join()
        for pid in forked:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert time.monotonic() - started < 30
