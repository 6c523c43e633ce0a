"""Which broker the delivery-dependent tests run on: read here, and only here.

``REDISLOCK_TEST_BROKER`` selects it:

* ``redis`` (the default): the test's own redis-server, database 0.
* ``rabbitmq``: RabbitMQ at ``REDISLOCK_TEST_RABBITMQ`` (default
  ``amqp://guest:guest@127.0.0.1:5672``), classic queues, Celery's defaults
  otherwise (as a new user would run it).
* ``rabbitmq-quorum``: the same RabbitMQ with quorum queues, configured as
  Celery >= 5.5 documents them (see :data:`QUORUM_CONF`).

The result backend and the lock store stay on the test's own redis-server.
On RabbitMQ every test gets a virtual host of its own, never used before:
made ahead with ``rabbitmqctl`` (permissions for guest), taken on the
test's first use and deleted when it ends (``tests/conftest.py``; the ones
made ahead and never taken, when the run ends). Nothing is ever declared on
``/``, and parallel pytest-xdist processes never share a queue. A ``celery worker``
subprocess learns its test's vhost from ``REDISLOCK_TEST_VHOST``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import types
import uuid
from typing import Any
from urllib.parse import quote, unquote

import pytest

BROKERS = ("redis", "rabbitmq", "rabbitmq-quorum")

BROKER = os.environ.get("REDISLOCK_TEST_BROKER", "redis") or "redis"
if BROKER not in BROKERS:
    raise RuntimeError(f"REDISLOCK_TEST_BROKER={BROKER!r}: expected one of {', '.join(BROKERS)}")

#: Messages travel through RabbitMQ (classic or quorum queues).
RABBITMQ = BROKER != "redis"
#: Task queues are quorum queues (countdowns use native delayed delivery).
QUORUM = BROKER == "rabbitmq-quorum"

RABBITMQ_URL = os.environ.get("REDISLOCK_TEST_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672")
RABBITMQ_USER = os.environ.get("REDISLOCK_TEST_RABBITMQ_USER", "guest")

#: The variable that tells a ``celery worker`` subprocess its test's vhost.
VHOST_ENV = "REDISLOCK_TEST_VHOST"
#: Every vhost the tests create starts with this (a leftover is easy to find).
VHOST_PREFIX = "redislock-test-"

#: Quorum queues as a user sets them up for Celery >= 5.5: the task queues
#: are quorum queues (Celery's docs: ``task_default_queue_type``), also those
#: created on first use (a route to another queue); topic exchanges, because
#: native delayed delivery (which countdown and ETA messages need once global
#: QoS is off) skips direct exchanges (Celery warns); publisher confirms (our
#: choice, RabbitMQ's advice for quorum queues), so that a publish RabbitMQ
#: refuses raises (the delay queues reject-publish on overflow) instead of
#: vanishing. Celery detects the quorum queues (``worker_detect_quorum_queues``,
#: on by default) and turns global QoS off by itself.
QUORUM_CONF: dict[str, Any] = {
    "task_default_queue_type": "quorum",
    "task_default_exchange_type": "topic",
    "task_create_missing_queue_type": "quorum",
    "task_create_missing_queue_exchange_type": "topic",
    "broker_transport_options": {"confirm_publish": True},
}


def rabbitmqctl(*args: str) -> str:
    """Run ``rabbitmqctl`` (about 0.4 s of CPU a call); return its output, raise on failure."""
    binary = shutil.which("rabbitmqctl")
    if binary is None:
        raise RuntimeError(
            f"REDISLOCK_TEST_BROKER={BROKER}: rabbitmqctl is not on PATH "
            "(the broker tests create a vhost per test with it)"
        )
    # An embedded prefork pool may fork a new child while this call starts
    # it; the fork copies every pipe open at that moment into a process that
    # lives as long as the worker, and a read from such a pipe never ends (a
    # CI run hung 120 s in Popen's read of its exec-error pipe). So: no pipes.
    # Output goes to files, and close_fds=False lets Popen use posix_spawn,
    # which has no exec-error pipe (descriptors still close on exec).
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        done = subprocess.run(
            [binary, "-q", *args],
            stdout=out,
            stderr=err,
            close_fds=False,
            timeout=60,
            check=False,
        )
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if done.returncode:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {stderr or stdout}")
    return stdout


#: Fresh vhosts made per ``rabbitmqctl`` call: each test still gets its own,
#: never used before, and deletes it when it ends; making them in batches
#: saves most of the CPU ``rabbitmqctl`` costs (the machine has 2 cores).
VHOST_BATCH = 8

#: The "acting user" RabbitMQ records for what the tests create and delete.
_ACTOR = '<<"redislock-tests">>'


def _erlang_binaries(names: list[str]) -> str:
    return "[" + ",".join(f'<<"{name}">>' for name in names) + "]"


def create_vhosts(count: int) -> list[str]:
    """Create ``count`` vhosts of our own, usable by the test user; return their names.

    One ``rabbitmqctl eval`` for all of them (RabbitMQ's own functions, as
    ``add_vhost`` and ``set_permissions`` call them); if that fails (another
    RabbitMQ version), one ``add_vhost`` and one ``set_permissions`` each.
    """
    names = [f"{VHOST_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:10]}" for _ in range(count)]
    user, everything = f'<<"{RABBITMQ_USER}">>', '<<".*">>'
    try:
        rabbitmqctl(
            "eval",
            f"[begin ok = rabbit_vhost:add(V, {_ACTOR}), "
            f"ok = rabbit_auth_backend_internal:set_permissions({user}, V, {everything}, "
            f"{everything}, {everything}, {_ACTOR}) end || V <- {_erlang_binaries(names)}], ok.",
        )
    except RuntimeError:
        delete_vhosts(names, missing_ok=True)  # what the batch made before it failed
        for name in names:
            rabbitmqctl("add_vhost", name)
            try:
                rabbitmqctl("set_permissions", "-p", name, RABBITMQ_USER, ".*", ".*", ".*")
            except BaseException:
                delete_vhosts([name])
                raise
    return names


def delete_vhosts(names: list[str], missing_ok: bool = False) -> None:
    """Delete vhosts the tests created (with every queue and exchange in them)."""
    for name in names:
        if not name.startswith(VHOST_PREFIX):  # never "/", never another's
            raise ValueError(f"refusing to delete vhost {name!r}: not one of the tests'")
    if missing_ok:
        existing = set(rabbitmqctl("list_vhosts", "--no-table-headers", "name").split())
        names = [name for name in names if name in existing]
    if len(names) == 1:
        rabbitmqctl("delete_vhost", names[0])
    elif names:
        rabbitmqctl(
            "eval",
            f"[ok = rabbit_vhost:delete(V, {_ACTOR}) || V <- {_erlang_binaries(names)}], ok.",
        )


class _Vhosts:
    """This process's vhosts: the running test's, and fresh ones made ahead."""

    current: str | None = None
    fresh: list[str] = []


_vhosts = _Vhosts()


def current_vhost() -> str:
    """The running test's vhost, taken (never used before) on its first use."""
    if _vhosts.current is None:
        if not _vhosts.fresh:
            _vhosts.fresh = create_vhosts(VHOST_BATCH)
        _vhosts.current = _vhosts.fresh.pop()
    return _vhosts.current


def end_test() -> None:
    """Delete the vhost the test that just ended used, if it took one."""
    name, _vhosts.current = _vhosts.current, None
    if name is not None:
        delete_vhosts([name])


def end_session() -> None:
    """Delete the vhosts made ahead and never used."""
    fresh, _vhosts.fresh = _vhosts.fresh, []
    delete_vhosts(fresh)


def broker_conf(redis_broker_url: str, vhost: str | None = None) -> dict[str, Any]:
    """The broker settings of a test app.

    Args:
        redis_broker_url: The broker URL on the Redis broker (the test's
            own redis-server).
        vhost: The RabbitMQ vhost; default: the running test's.
    """
    if not RABBITMQ:
        return {"broker_url": redis_broker_url}
    conf: dict[str, Any] = {"broker_url": f"{RABBITMQ_URL}/{quote(vhost or current_vhost(), '')}"}
    if QUORUM:
        conf.update(QUORUM_CONF)
    return conf


def subprocess_broker_conf(redis_broker_url: str) -> dict[str, Any]:
    """:func:`broker_conf` in a ``celery worker`` subprocess (vhost from the environment).

    The test process imports the subprocess apps too, without a vhost: it
    gets a name that does not exist, so nothing it does reaches a broker.
    """
    if not RABBITMQ:
        return broker_conf(redis_broker_url)
    return broker_conf(redis_broker_url, os.environ.get(VHOST_ENV) or f"{VHOST_PREFIX}none")


def worker_env() -> dict[str, str]:
    """What a ``celery worker`` subprocess needs to reach the running test's broker."""
    if not RABBITMQ:
        return {}
    return {"REDISLOCK_TEST_BROKER": BROKER, VHOST_ENV: current_vhost()}


def declare_as_a_worker_would(app: Any) -> None:
    """Declare ``app``'s queues, and on quorum queues its delay queues, as a worker starting does.

    For a test that publishes a countdown before any worker ran in its
    vhost: with quorum queues the message goes to the delay exchanges a
    worker declares (Celery's ``DelayedDelivery`` step, run here as is),
    and RabbitMQ refuses a publish to an exchange that does not exist.
    """
    if not RABBITMQ:
        return
    from celery.worker.consumer.delayed_delivery import DelayedDelivery

    with app.connection_for_write() as connection:
        for queue in app.amqp.queues.values():
            queue(connection.default_channel).declare()
    if QUORUM:
        consumer = types.SimpleNamespace(app=app)
        DelayedDelivery(consumer)._setup_delayed_delivery(consumer, app.conf.broker_url)


def queue_length(app: Any, queue: str = "tests") -> int:
    """Messages waiting for ``queue`` (not those a worker holds unacknowledged).

    On quorum queues a countdown message waits in the delay queues until it
    is due: those count too (each test has a vhost, so they are its own).
    0 if the queue was never declared.
    """
    if not RABBITMQ:
        with app.connection_for_write() as connection:
            return int(connection.default_channel.client.llen(queue))
    from amqp.exceptions import NotFound
    from kombu.transport.native_delayed_delivery import MAX_LEVEL, level_name

    names = [queue, *(level_name(level) for level in range(MAX_LEVEL + 1))] if QUORUM else [queue]
    waiting = 0
    with app.connection_for_write() as connection:
        for name in names:
            channel = connection.channel()
            try:
                waiting += int(channel.queue_declare(name, passive=True).message_count)
            except NotFound:
                pass  # never declared (a 404 closes the channel)
            else:
                channel.close()
    return waiting


def queue_settled(app: Any, queue: str = "tests") -> bool:
    """True once ``queue`` holds no message, waiting or delivered and not yet acknowledged."""
    if not RABBITMQ:
        with app.connection_for_write() as connection:
            client = connection.default_channel.client
            return not client.llen(queue) and not client.hlen("unacked")
    vhost = app.conf.broker_url.rsplit("/", 1)[1]
    rows = rabbitmqctl(
        "list_queues", "-p", unquote(vhost), "--no-table-headers", "name", "messages"
    )
    counts = dict(row.split("\t") for row in rows.splitlines() if row.strip())
    return int(counts.get(queue, 0)) == 0


def message_reserved(app: Any, queue: str = "tests") -> bool:
    """True once no message waits in ``queue`` and one is out: reserved by a worker.

    On quorum queues a countdown message waits in the delay queues until it
    is due, reserved by nobody: that counts as out too.
    """
    if not RABBITMQ:
        with app.connection_for_write() as connection:
            client = connection.default_channel.client
            return not client.llen(queue) and bool(client.hlen("unacked"))
    vhost = app.conf.broker_url.rsplit("/", 1)[1]
    rows = rabbitmqctl(
        "list_queues",
        "-p",
        unquote(vhost),
        "--no-table-headers",
        "name",
        "messages_ready",
        "messages_unacknowledged",
    )
    ready, out = 0, 0
    for row in rows.splitlines():
        if not row.strip():
            continue
        name, waiting, unacked = row.split("\t")
        if name == queue:
            ready, out = int(waiting), out + int(unacked)
        elif QUORUM and name.startswith("celery_delayed_"):
            out += int(waiting)
    return ready == 0 and out > 0


def redis_broker_only(why: str) -> pytest.MarkDecorator:
    """Skip on the other brokers: the test is about the Redis broker itself."""
    return pytest.mark.skipif(RABBITMQ, reason=f"Redis broker only: {why}")
