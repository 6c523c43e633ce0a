"""Under gevent monkey-patching the renewer is still a native OS thread."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import LOCK_DB
from tests.servers import ROOT, RedisServer

pytest.importorskip("gevent")


def _run(script: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter (its own monkey-patching); it must exit 0."""
    out = subprocess.run(
        [sys.executable, "-c", script, *argv],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=timeout,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out


SCRIPT = textwrap.dedent(
    """
    from gevent import monkey
    monkey.patch_all()

    import sys, time
    import redis
    from celery_redislock import RedisLock

    client = redis.Redis.from_url(sys.argv[1])
    lock = RedisLock(client, "gevent-cpu", ttl=0.6)
    assert lock.acquire(blocking=False)
    # A CPU-bound greenlet that never yields for 5 TTLs: a green renewer
    # would get no ticks and the key would expire.
    deadline = time.perf_counter() + 3.0
    n = 0
    while time.perf_counter() < deadline:
        n += 1
    print(lock.handle.renewals, lock.lost, client.exists("gevent-cpu"))
    lock.release()
    """
)


def test_renewer_runs_while_a_greenlet_hogs_the_cpu(server: RedisServer) -> None:
    out = _run(SCRIPT, server.url_for(LOCK_DB))
    renewals, lost, exists = out.stdout.split()
    assert int(renewals) >= 5
    assert (lost, exists) == ("False", "1")


GREENLETS = textwrap.dedent(
    """
    from gevent import monkey
    monkey.patch_all()

    import json, logging, random, sys
    import gevent
    import redis
    from celery_redislock import RedisLock, lock_released

    class Count(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []
        def emit(self, record):
            self.messages.append(record.getMessage())

    complaints = Count()
    logging.getLogger("celery_redislock").addHandler(complaints)
    outcomes = []
    lock_released.connect(lambda sender=None, **kw: outcomes.append(kw["outcome"]), weak=False)
    client = redis.Redis.from_url(sys.argv[1])

    def cycles(n):
        for i in range(20):
            lock = RedisLock(client, f"gevent:{n}:{i % 3}", ttl=0.3)
            assert lock.acquire(blocking=False)
            gevent.sleep(random.uniform(0.0, 0.25))  # some holds outlive TTL/3: renewed
            lock.release()

    gevent.joinall([gevent.spawn(cycles, n) for n in range(50)], raise_error=True)
    left = [key.decode() for key in client.scan_iter("gevent:*")]
    print(json.dumps({
        "released": outcomes.count("released"),
        "other_outcomes": [o for o in outcomes if o != "released"],
        "complaints": complaints.messages[:5],
        "complaint_count": len(complaints.messages),
        "keys_left": left,
    }))
    """
)


def test_greenlets_and_the_native_renewer_never_share_a_connection(server: RedisServer) -> None:
    out = _run(GREENLETS, server.url_for(LOCK_DB), timeout=120)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n[measured] gevent 50 greenlets x 20 cycles: {result['released']} releases")
    assert result["released"] == 1000
    assert result["other_outcomes"] == []
    assert result["complaint_count"] == 0, result["complaints"]
    assert result["keys_left"] == []


PRELOADED = textwrap.dedent(
    """
    import os, sys, time
    import celery_redislock.takeback as takeback  # imported in the master (--preload)

    pid = os.fork()  # a worker process, which then patches
    if pid == 0:
        from gevent import monkey
        monkey.patch_all()
        import gevent
        from celery_redislock.store import LockStore

        backend = LockStore(sys.argv[1])
        beats = []

        def beat():
            for _ in range(4):
                beats.append(time.monotonic())
                gevent.sleep(0.3)

        def take_back():
            takeback.take_back_value(backend, "never-there", "v", now=False)

        gevent.joinall([gevent.spawn(take_back), gevent.spawn(beat)], timeout=10)
        os._exit(0 if len(beats) == 4 else 3)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            sys.exit(os.WEXITSTATUS(status))
        time.sleep(0.1)
    os.kill(pid, 9)
    sys.exit("the worker process hung: its gevent hub was blocked")
    """
)


def test_a_take_back_under_gevent_never_blocks_the_hub(server: RedisServer) -> None:
    """The package imported before monkey-patching (gunicorn --preload -k gevent)."""
    _run(PRELOADED, server.url_for(LOCK_DB))  # exits 0: the take-back never blocked the hub


REENTRANT_PRELOADED = textwrap.dedent(
    """
    import json, sys
    import celery_redislock  # imported before patching (gunicorn --preload -k gevent)
    from gevent import monkey
    monkey.patch_all()

    import gevent
    import redis
    from celery_redislock import RedisLock

    client = redis.Redis.from_url(sys.argv[1])
    inside, overlaps, depths = [], [], []

    def body(n):
        gevent.sleep(0.05 * n)  # each starts while the previous one holds it
        with RedisLock(client, "gevent:reentrant", ttl=5, reentrant=True, timeout=10) as lock:
            inside.append(n)
            overlaps.append(len(inside) > 1)
            depths.append(lock.depth)
            gevent.sleep(0.2)
            inside.remove(n)

    gevent.joinall([gevent.spawn(body, n) for n in range(3)], raise_error=True)
    print(json.dumps({"overlaps": overlaps, "depths": depths,
                      "left": client.exists("gevent:reentrant")}))
    """
)


def test_a_reentrant_lock_is_owned_per_greenlet_whatever_the_import_order(
    server: RedisServer,
) -> None:
    out = _run(REENTRANT_PRELOADED, server.url_for(LOCK_DB))
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"overlaps": [False] * 3, "depths": [1] * 3, "left": 0}


TIMEOUT = textwrap.dedent(
    """
    import socket, sys, time
    if sys.argv[2] == "patch-first":
        from gevent import monkey
        monkey.patch_all()
    from celery_redislock.store import LockStore, _Kind
    from celery_redislock.transport import NO_RETRY
    if sys.argv[2] == "import-first":
        from gevent import monkey
        monkey.patch_all()
    import redis

    store = LockStore(sys.argv[1], {"socket_timeout": 0.3, "retry": NO_RETRY})
    endpoint = store._topology(_Kind.COMMANDS).endpoint_for("k")
    assert endpoint.call("PING") == b"PONG"
    (connection,) = endpoint._idle
    kept = connection._sock.gettimeout()
    host, port = connection.host, connection.port
    sleeper = socket.create_connection((host, port))
    sleeper.sendall(b"DEBUG SLEEP 2\\r\\n")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # until the server stops answering: it sleeps
        probe = socket.create_connection((host, port), timeout=0.05)
        try:
            probe.sendall(b"PING\\r\\n")
            probe.recv(16)
        except socket.timeout:
            break
        finally:
            probe.close()
    started = time.monotonic()
    try:
        endpoint.call("PING")
        outcome = "answered"
    except redis.TimeoutError:
        outcome = "timed out"
    print(kept, outcome.replace(" ", "-"), round(time.monotonic() - started, 2))
    """
)


@pytest.mark.parametrize("order", ["patch-first", "import-first"])
def test_a_green_socket_keeps_its_timeout_in_the_hub(server: RedisServer, order: str) -> None:
    """gevent's sockets wait in the hub: their timeout is never moved into the kernel."""
    out = _run(TIMEOUT, server.url_for(LOCK_DB), order)
    kept, outcome, seconds = out.stdout.strip().splitlines()[-1].rsplit(" ", 2)
    assert (kept, outcome) == ("0.3", "timed-out")
    assert float(seconds) < 1.5
