"""Fixtures: our own redis-server processes, Celery apps and embedded workers."""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import itertools
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import celery.contrib.testing.tasks  # noqa: F401  (registers celery.ping for the ping check)
import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import TestWorkController, start_worker
from celery.worker import state as worker_state

from celery_redislock.settings import forget_app_settings
from tests import brokers
from tests.servers import FaultProxy, RedisServer, wait_until

BROKER_DB, RESULT_DB, LOCK_DB, RECORD_DB = 0, 1, 2, 3

POOLS = ["solo", "threads", "prefork"]

_app_counter = itertools.count()


@pytest.fixture(scope="session", autouse=True)
def _broker_vhosts_made_ahead() -> Iterator[None]:
    """On RabbitMQ: delete, once the run ends, the vhosts made ahead and never used."""
    yield
    brokers.end_session()


@pytest.fixture(autouse=True)
def _broker_vhost() -> Iterator[None]:
    """On RabbitMQ: delete the vhost the test used (created on first use), once it ended.

    Autouse, so set up before and torn down after every other fixture of the
    test: its workers and apps are gone by then.
    """
    yield
    brokers.end_test()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the whole run; each test starts from an empty server."""
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """Start extra servers a test may kill, pause or restart; all stopped afterwards."""
    servers: list[RedisServer] = []

    def make(*args: str) -> RedisServer:
        server = RedisServer(*args)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def server(redis_server: RedisServer) -> RedisServer:
    redis_server.client().flushall()
    return redis_server


@pytest.fixture
def proxy(server: RedisServer) -> Iterator[FaultProxy]:
    """A TCP proxy in front of ``server`` that can delay or cut its traffic."""
    fault = FaultProxy(server.port)
    yield fault
    fault.close()


@pytest.fixture
def lock_client(server: RedisServer) -> Iterator[redis.Redis]:
    client = server.client(LOCK_DB)
    yield client
    client.close()


@pytest.fixture
def record(server: RedisServer) -> Iterator[redis.Redis]:
    """A client on the database where test tasks record what they did."""
    client = server.client(RECORD_DB, decode_responses=True)
    yield client
    client.close()


def make_app(server: RedisServer, **conf: Any) -> Celery:
    app = Celery(f"redislock_test_{next(_app_counter)}", set_as_current=False)
    app.conf.update(
        **brokers.broker_conf(server.url_for(BROKER_DB)),
        result_backend=server.url_for(RESULT_DB),
        redislock_url=server.url_for(LOCK_DB),
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        task_default_queue="tests",
        result_expires=600,
    )
    app.conf.update(conf)
    return app


@pytest.fixture
def app_factory(server: RedisServer) -> Iterator[Callable[..., Celery]]:
    apps: list[Celery] = []

    def make(**conf: Any) -> Celery:
        app = make_app(server, **conf)
        apps.append(app)
        return app

    yield make
    # Let AsyncResult.__del__ unsubscribe while the server is still up.
    gc.collect()
    for app in apps:
        forget_app_settings(app)
        app.close()


@pytest.fixture
def app(app_factory: Callable[..., Celery]) -> Celery:
    return app_factory()


class _WorkController(TestWorkController):
    """Celery's embedded worker, remembering the thread it runs in."""

    thread: threading.Thread | None = None

    def start(self) -> Any:
        self.thread = threading.current_thread()
        return super().start()


@contextlib.contextmanager
def embedded_worker(
    app: Celery, pool: str = "solo", concurrency: int = 1, **options: Any
) -> Iterator[Any]:
    """Run an embedded worker (a thread of this process; prefork forks children).

    ``options`` go to ``start_worker`` (e.g. ``hostname``, the node name).
    """
    app.loader.import_default_modules()
    if pool == "solo":
        concurrency = 1
    # If the worker thread does not stop, print every thread's stack (the
    # failure alone says nothing about where it hangs).
    stack_dump = threading.Timer(
        15, faulthandler.dump_traceback, kwargs={"file": sys.stderr, "all_threads": True}
    )
    stack_dump.daemon = True
    worker: Any = None
    try:
        with start_worker(
            app,
            pool=pool,
            concurrency=concurrency,
            perform_ping_check=True,
            shutdown_timeout=20,
            loglevel="WARNING",
            WorkController=_WorkController,
            **options,
        ) as worker:
            try:
                yield worker
            finally:
                if pool == "prefork":
                    _let_children_finish(worker)
                stack_dump.start()
                _stop_now(worker)
    except RuntimeError as exc:
        if "failed to exit" not in str(exc) or not _stopped_by_killing_children(worker):
            raise
    finally:
        stack_dump.cancel()
        # Celery leaves should_terminate set when its worker thread fails to stop;
        # every later embedded worker in this process would then stop at once.
        worker_state.should_terminate = None


def _stop_now(worker: Any) -> None:
    """Tell the worker to stop (as ``start_worker`` is about to) and wake its event loop.

    The loop checks for a stop between two polls of its sockets; an idle
    AMQP connection has nothing to read, so the poll would only return at
    the next timer, up to 10 s later (the Redis transport polls every second).
    """
    worker_state.should_terminate = 0
    hub = getattr(worker, "hub", None)
    if hub is not None:
        hub.call_soon(lambda: None)


def _let_children_finish(worker: Any, timeout: float = 3.0) -> None:
    """Wait (a bounded time) until no task is running in the worker's pool.

    Celery's embedded worker stops by terminating its pool: its children get
    SIGTERM wherever they are. A child killed while it writes a task's result
    leaves half a message in its pipe, and the parent's shutdown then blocks
    reading the rest for ever (it holds the pipe's write end, so no EOF comes:
    celery/concurrency/asynpool.py, ``_flush_outqueue``, says so). A test
    usually ends as soon as the task did what it checks, before its result is
    written: so let running tasks finish first. A task still running after
    ``timeout`` (one a test leaves behind on purpose) is terminated as before.
    """
    with contextlib.suppress(AssertionError):  # still running: terminated as before
        wait_until(lambda: not worker_state.active_requests, timeout=timeout, interval=0.02)


def _stopped_by_killing_children(worker: Any) -> bool:
    """Unblock a prefork worker stuck stopping; True if its thread then stops.

    The stack printed at 15 s shows where it stuck; seen: the parent reading
    the rest of a result message a child killed at shutdown had half written
    (see :func:`_let_children_finish`). Kill the children and close the
    parent's write end of each result pipe, so that the read gets EOF and the
    pool's shutdown goes on. What the test asserts happened while the worker
    ran; its stop is Celery's. Reported as a warning (which Celery's worker
    logging turns into a ``py.warnings`` log line).
    """
    asyn_pool = getattr(getattr(worker, "pool", None), "_pool", None)
    thread = getattr(worker, "thread", None)
    if asyn_pool is None or thread is None:
        return False
    processes = {
        *getattr(asyn_pool, "_pool", ()),
        *getattr(asyn_pool, "_fileno_to_outq", {}).values(),
    }
    for process in processes:
        if process.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
        outq = getattr(process, "outq", None)
        if outq is not None:
            with contextlib.suppress(OSError):
                outq._writer.close()
    worker_state.should_terminate = 0
    thread.join(10)
    if thread.is_alive():
        return False
    warnings.warn(
        "Celery's embedded prefork worker did not stop in 20 s; it stopped once its "
        "pool processes were killed and their result pipes closed",
        stacklevel=2,
    )
    return True


@pytest.fixture(params=POOLS)
def pool(request: pytest.FixtureRequest) -> str:
    return str(request.param)
