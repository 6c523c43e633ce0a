"""Under gevent monkey-patching the renewer is still a native OS thread."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import LOCK_DB
from tests.servers import ROOT, RedisServer

pytest.importorskip("gevent")

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
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, server.url_for(LOCK_DB)],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    renewals, lost, exists = out.stdout.split()
    assert int(renewals) >= 5
    assert (lost, exists) == ("False", "1")
