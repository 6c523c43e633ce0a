"""What the standalone lock's layers cost, against its pieces laid out flat (issue 24, target 6).

``python -m bench.layers [seconds]`` prints the client CPU of one uncontended
cycle (acquire + release, one connection) of:

* ``RedisLock`` as shipped;
* ``flat``: the pieces a ``RedisLock`` cycle needs, in one function each way
  and no layer between them: an owner-carrying value (``LockValue``), the
  store's pooled connection, ``SET NX PX GET`` and the release script
  written straight to the socket, a ``LockHandle`` registered with the
  renewer, the ``lock_acquired``/``lock_released`` signals;
* ``flat, no features``: the same with a bare random value and no handle,
  renewal or signals: what the lock object, the store's connection and the
  commands cost by themselves;
* the minimal lock of scenario 2 (a raw socket, no library).

each divided by the bare-socket pair measured in alternating chunks (see
``bench/scenarios/lock_cycle.py``). The flat variants are measuring
instruments, not locks to use: they skip every check the real one makes on
a reply other than the expected one.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Callable
from typing import Any

import redis

from bench.scenarios.lock_cycle import _BareSocket, _cpu_against_floor, _MinimalLock
from celery_redislock import RedisLock, scripts, signals
from celery_redislock._clock import clock
from celery_redislock.lease import LockHandle
from celery_redislock.renewer import renewer
from celery_redislock.store import LockStore
from celery_redislock.store_connections import _Kind
from celery_redislock.tokens import LockOwner, LockValue
from tests.servers import RedisServer

_SET = (
    b"*7\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n"
    b"$2\r\nNX\r\n$2\r\nPX\r\n$5\r\n30000\r\n$3\r\nGET\r\n"
)
_RELEASE = b"*5\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$1\r\n1\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n"


def _exchange(endpoint: Any, packed: bytes, expected: bytes) -> None:
    connection = endpoint._take()
    try:
        if connection._sock is None:
            connection.connect()
        sock = connection._sock
        os.write(sock.fileno(), packed)
        reply = sock.recv(65536)
    except BaseException:
        connection.disconnect()
        endpoint._keep(connection)
        raise
    endpoint._keep(connection)
    if reply != expected:
        raise RuntimeError(f"unexpected reply {reply!r}")


def _flat_cycle(client: redis.Redis, features: bool) -> Callable[[int], None]:
    store = LockStore.for_client(client)
    sha = client.script_load(scripts.RELEASE_SCRIPT).encode()
    keep_alive = renewer()

    def cycle(i: int) -> None:
        name = f"cycle:{i}"
        if features:
            value = LockValue.new_encoded(LockOwner.current(None, 0, None), name)
        else:
            value = secrets.token_hex(16)
        key, encoded = name.encode(), value.encode()
        endpoint = store._topology(_Kind.COMMANDS).endpoint_for(name)
        sent_at = clock()
        _exchange(endpoint, _SET % (len(key), key, len(encoded), encoded), b"$-1\r\n")
        if features:
            handle = LockHandle(
                store, name, value, 30.0, sent_at, task_name=name, task_id=None,
                sender=None, renew=False, fence=None,
            )  # fmt: skip
            keep_alive.register(handle, True)
            signals.lock_acquired.send(
                sender=None, key=name, task_name=name, task_id=None, waited=0.0, fence=None
            )
            keep_alive.unregister(handle)
        endpoint = store._topology(_Kind.RELEASES).endpoint_for(name)
        _exchange(endpoint, _RELEASE % (sha, len(key), key, len(encoded), encoded), b":1\r\n")
        if features:
            signals.lock_released.send(
                sender=None, key=name, task_name=name, task_id=None, held=0.0, outcome=None
            )

    return cycle


def main(seconds: float = 3.0, rounds: int = 3) -> None:
    server = RedisServer()
    try:
        client = server.client()
        bare, minimal = _BareSocket(server.port), _MinimalLock(server.port, client)

        def shipped(i: int) -> None:
            lock = RedisLock(client, f"cycle:{i}", ttl=30)
            lock.acquire(blocking=False)
            lock.release()

        contenders = {
            "RedisLock": shipped,
            "flat (its pieces, no layers)": _flat_cycle(client, features=True),
            "flat, no features (no owner, handle, renewal, signals)": _flat_cycle(client, False),
            "minimal lock (raw socket, no library)": minimal,
        }
        for cycle in contenders.values():
            for i in range(2000):  # connections, scripts, caches
                cycle(i)
        for round_no in range(rounds):
            for name, cycle in contenders.items():
                cpu, floor = _cpu_against_floor(cycle, bare, seconds)
                print(f"round {round_no + 1}: {name:56s} {cpu:6.1f} µs  {cpu / floor:.2f}x")
        bare.close()
        minimal.close()
    finally:
        server.close()


if __name__ == "__main__":
    main(*(float(arg) for arg in sys.argv[1:2]))
