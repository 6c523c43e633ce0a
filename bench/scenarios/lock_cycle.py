"""Scenario 2: lock cycles (acquire + release) on one connection: rate and client CPU.

Beside every contender's cycles per second, the client CPU of one cycle
(``time.process_time``, every thread of this process: the renewer's too) and
the floor it is compared with: a pair of bare-socket round trips (``sendall``
of a PING, ``recv`` of its reply, no client library) measured in the same
round. And what cycles over distinct keys leave behind in Redis (issue 13):
resident keys after N distinct keys, and bytes of ``used_memory`` per key.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio

from bench.harness import (
    ServerCost,
    command_origins,
    peers_available,
    round_trips,
    server_cost,
)
from bench.report import Report
from celery_redislock import AsyncRedisLock, RedisLock
from celery_redislock.aiostore import AsyncLockStore
from celery_redislock.store import LockStore
from examples.server import embedded_binary, server_version
from tests.servers import RedisServer


def _cycle(prefix: str, make_lock: Callable[[str], Any]) -> Callable[[int], None]:
    """One uncontended cycle (acquire, release) of the lock ``make_lock`` builds on ``prefix:i``."""

    def cycle(i: int) -> None:
        lock = make_lock(f"{prefix}:{i}")
        lock.acquire(blocking=False)
        lock.release()

    return cycle


def lock_cycle(report: Report, rounds: int, seconds: float, distinct: int = 20_000) -> None:
    server = RedisServer()
    client = server.client()
    available = peers_available()

    ours = _cycle("cycle", lambda key: RedisLock(client, key, ttl=30))
    redis_py = _cycle("cycle", lambda key: client.lock(key, timeout=30))
    ours_reentrant = _cycle("cycle", lambda key: RedisLock(client, key, ttl=30, reentrant=True))

    def ours_reentrant_nested(i: int) -> None:
        # Depth 2: the nested acquire is one round trip (it confirms and
        # extends); the nested release is local.
        lock = RedisLock(client, f"cycle:{i}", ttl=30, reentrant=True)
        lock.acquire(blocking=False)
        lock.acquire(blocking=False)
        lock.release()
        lock.release()

    # The asyncio locks run on one event loop driven from this thread; the
    # redis-py asyncio Lock row pays the same run_until_complete overhead.
    loop = asyncio.new_event_loop()
    async_client = redis.asyncio.Redis(port=server.port)

    async def async_ours(i: int) -> None:
        lock = AsyncRedisLock(async_client, f"cycle:{i}", ttl=30)
        await lock.acquire(blocking=False)
        await lock.release()

    async def async_redis_py(i: int) -> None:
        lock = async_client.lock(f"cycle:{i}", timeout=30)
        await lock.acquire(blocking=False)
        await lock.release()

    cycles: dict[str, Callable[[int], None]] = {
        "redis-py Lock": redis_py,
        "celery-redislock RedisLock": ours,
        "celery-redislock RedisLock(reentrant=True)": ours_reentrant,
        "celery-redislock RedisLock(reentrant=True), depth 2": ours_reentrant_nested,
        "redis-py asyncio Lock": lambda i: loop.run_until_complete(async_redis_py(i)),
        "celery-redislock AsyncRedisLock": lambda i: loop.run_until_complete(async_ours(i)),
    }
    minimal = _MinimalLock(server.port, client)
    cycles["minimal lock: fresh value, SET NX PX, compare-and-delete (no library)"] = minimal
    if available["redis_lock"]:
        import redis_lock

        cycles["python-redis-lock"] = _cycle(
            "cycle", lambda key: redis_lock.Lock(client, key, expire=30)
        )
    if available["pottery"]:
        from pottery import Redlock

        cycles["pottery Redlock (1 master)"] = _cycle(
            "cycle", lambda key: Redlock(key=key, masters={client}, auto_release_time=30)
        )
    scenario = "2. lock cycle (acquire+release, one process)"
    bare = _BareSocket(server.port)
    try:
        for name, cycle in cycles.items():
            origins = command_origins(server, lambda c=cycle: [c(i) for i in range(50)])
            report.add(
                scenario, name, "round trips per cycle", "commands", round_trips(origins) / 50
            )
        _server_costs(
            report, scenario, server, cycles, client, rounds, 200 if seconds < 1 else 20_000
        )
        _server_costs_on_valkey(report, server, rounds, 200 if seconds < 1 else 20_000)
        for round_no in range(rounds):
            rates: dict[str, float] = {}
            cpu: dict[str, float] = {}
            floors: list[float] = []
            for name, cycle in cycles.items():
                for i in range(200):  # warm up connections and script caches
                    cycle(i)
                rates[name] = _rate(cycle, seconds)
                # CPU in chunks alternating with the floor's: the two see the
                # same machine (a shared VM's syscall cost drifts by 3x).
                cpu[name], floor = _cpu_against_floor(cycle, bare, seconds)
                floors.append(floor)
                report.add(
                    scenario, name, "client CPU per cycle", "µs", cpu[name], cpu[name] / floor
                )
            floor = sorted(floors)[len(floors) // 2]
            report.add(
                scenario,
                "bare socket, 2 round trips (the floor)",
                "client CPU per cycle",
                "µs",
                floor,
            )
            # The ceiling of cycles/s: no client library at all, the same two
            # round trips. No lock that makes two can go faster than this.
            rates["bare socket, 2 round trips (the ceiling)"] = _rate(bare, seconds)
            for name in rates:
                report.add(
                    scenario,
                    name,
                    "cycles/s",
                    "cycles/s",
                    rates[name],
                    rates[name] / rates["redis-py Lock"],
                )
            print(
                f"  round {round_no + 1}/{rounds}: floor {floor:.1f} µs; "
                + ", ".join(f"{k} {v:.0f}/s {cpu.get(k, floor):.1f} µs" for k, v in rates.items()),
                flush=True,
            )
            _left_behind(report, scenario, server, client, distinct)
    finally:
        bare.close()
        minimal.close()
        loop.run_until_complete(AsyncLockStore.for_client(async_client).aclose())
        loop.run_until_complete(async_client.aclose())
        loop.close()
        server.close()


def _server_costs(
    report: Report,
    scenario: str,
    server: RedisServer,
    cycles: dict[str, Callable[[int], None]],
    client: redis.Redis,
    rounds: int,
    n: int,
) -> None:
    """What one uncontended cycle costs the Redis server: µs executing, commands run, CPU.

    ``n`` cycles over 100 names, each contender in every round, the ratio
    to redis-py's ``Lock`` of the same round (a task's: to a task taking
    redis-py's ``Lock``); see
    :func:`bench.harness.server_cost` for what each figure counts (the
    commands a script runs are in its ``EVALSHA``'s time once). Plus the
    floor: ``SET NX PX`` and ``DEL`` with no ownership check.
    """

    def floor(i: int) -> None:
        client.set(f"cycle:{i % 100}", "v", nx=True, px=30000)
        client.delete(f"cycle:{i % 100}")

    contenders = {
        "SET NX PX + DEL, no ownership check (the floor)": floor,
        **cycles,
        **_task_runs(server),
    }
    origins = {
        name: command_origins(server, lambda c=cycle: [c(i % 100) for i in range(20)])
        for name, cycle in contenders.items()
    }
    names = list(contenders)
    for cycle in contenders.values():
        for i in range(100):  # scripts loaded, connections open
            cycle(i)
    chunk = max(n // _CHUNKS, 1)
    for round_no in range(rounds):
        costs = {name: ServerCost(0.0, 0.0, 0.0) for name in names}
        # Contenders take turns in chunks (the server's speed drifts within
        # a round: one contender's whole run against another's measured a
        # 0.85-1.6x spread between identical command sets), each round in
        # another order: none always runs first, or last.
        order = names[round_no % len(names) :] + names[: round_no % len(names)]
        for _ in range(_CHUNKS):
            for name in order:
                cycle = contenders[name]
                costs[name] += server_cost(
                    server, lambda c=cycle: [c(i % 100) for i in range(chunk)], origins[name]
                )
        n = chunk * _CHUNKS
        for name in names:
            cost = costs[name]
            # A task's cycles are paced by Celery's tracer between commands,
            # which alone makes each command cost the server more (measured:
            # redis-py's Lock with 150 µs of client work between commands,
            # 1.1x its unpaced time): a task is compared with a task.
            base = costs[_TASK_BASE if name in _TASKS else "redis-py Lock"]
            report.add(
                scenario,
                name,
                "server execution per cycle",
                "µs",
                cost.execution_us / n,
                cost.execution_us / base.execution_us,
            )
            report.add(
                scenario,
                name,
                "server main-thread CPU per cycle",
                "µs",
                cost.cpu_us / n,
                cost.cpu_us / base.cpu_us,
            )
            report.add(
                scenario,
                name,
                "server commands per cycle (scripts' included)",
                "commands",
                cost.commands / n,
            )
    client.flushall()


def _server_costs_on_valkey(report: Report, server: RedisServer, rounds: int, n: int) -> None:
    """The server cost table again on Valkey 9 (the embedded one), if the run is not on it.

    Where the server has ``DELIFEQ``, a plain release runs no script.
    """
    binary = embedded_binary()
    if binary is None or server_version(server.binary)[0] == "Valkey":
        return
    name, version = server_version(binary)
    valkey = RedisServer(binary=binary)
    client = valkey.client()
    try:
        cycles = {
            "redis-py Lock": _cycle("cycle", lambda key: client.lock(key, timeout=30)),
            "celery-redislock RedisLock": _cycle(
                "cycle", lambda key: RedisLock(client, key, ttl=30)
            ),
        }
        scenario = f"2. lock cycle, server cost on {name} {version}"
        _server_costs(report, scenario, valkey, cycles, client, rounds, n)
    finally:
        LockStore.for_client(client).close()
        valkey.close()


#: Turns each contender takes per round of the server cost.
_CHUNKS = 10

#: The task-path contenders; the second is the first's baseline.
_TASK_RUN = "SingletonTask run (Celery's tracer, no broker)"
_TASK_BASE = "task taking redis-py's Lock in its body (same tracer)"
_TASKS = (_TASK_RUN, _TASK_BASE)


def _task_runs(server: RedisServer) -> dict[str, Callable[[int], None]]:
    """One run of a no-op task per call, as a worker's tracer runs it: locked two ways.

    What the task path asks of the lock store, beside the standalone locks
    of the same round; no broker (the worker's side only). A
    ``SingletonTask``, and a plain task whose body takes redis-py's
    ``Lock`` on a key of its argument: the same client pacing around the
    same commands.
    """
    import uuid

    from celery import Celery
    from celery.app.trace import build_tracer

    from celery_redislock import SingletonTask

    app = Celery("bench-cycle", broker="memory://", backend=None)
    app.conf.update(redislock_url=f"{server.url}/0", task_ignore_result=True)
    client = server.client()

    @app.task(name="bench.cycle.locked", base=SingletonTask)
    def locked(n: int) -> None:
        return None

    @app.task(name="bench.cycle.redis_py_lock")
    def redis_py_locked(n: int) -> None:
        with client.lock(f"bench.cycle.redis_py_lock:{n}", timeout=30):
            pass

    def runs(task: Any) -> Callable[[int], None]:
        trace = build_tracer(task.name, task, app=app, eager=False, propagate=True)

        def run(i: int) -> None:
            task_id = str(uuid.uuid4())
            request = {
                "id": task_id,
                "hostname": "bench@localhost",  # a worker's node name, as its requests have
                "delivery_info": {"routing_key": "celery"},
            }
            trace(task_id, (i,), {}, request)

        return run

    return {_TASK_RUN: runs(locked), _TASK_BASE: runs(redis_py_locked)}


def _left_behind(
    report: Report, scenario: str, server: RedisServer, client: redis.Redis, distinct: int
) -> None:
    """Keys and bytes left in Redis after ``distinct`` cycles, each on a key of its own."""
    # The pre-issue-13 behaviour, for comparison: a counter kept 1 h per key.
    kept_counters = LockStore(client=client, fence_ttl=3600)

    kept = _cycle("distinct", lambda key: RedisLock(client, key, ttl=30, store=kept_counters))
    ours = _cycle("distinct", lambda key: RedisLock(client, key, ttl=30))
    redis_py = _cycle("distinct", lambda key: client.lock(key, timeout=30))

    cycles = {
        "redis-py Lock": redis_py,
        "celery-redislock RedisLock": ours,
        "celery-redislock RedisLock, redislock_fence_ttl=3600 (the old default)": kept,
    }
    line = []
    for name, cycle in cycles.items():
        cycle(-1)  # scripts loaded and connections open before the baseline
        client.flushall()
        before = int(client.info("memory")["used_memory"])
        for i in range(distinct):
            cycle(i)
        keys = int(client.dbsize())
        per_key = (int(client.info("memory")["used_memory"]) - before) / distinct
        note = f"after {distinct} distinct keys"
        report.add(scenario, name, "resident keys after N distinct keys", "keys", keys, note=note)
        report.add(scenario, name, "used_memory left per distinct key", "bytes", per_key, note=note)
        line.append(f"{name} {keys} keys {per_key:.1f} B/key")
    client.flushall()
    print(f"  left behind after {distinct} distinct keys: " + ", ".join(line), flush=True)


def _rate(cycle: Callable[[int], None], seconds: float) -> float:
    count = 0
    deadline = time.perf_counter() + seconds
    started = time.perf_counter()
    while time.perf_counter() < deadline:
        cycle(count % 1000)
        count += 1
    return count / (time.perf_counter() - started)


class _BareSocket:
    """Two PING round trips on a bare socket, no client library: the floor of a cycle."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def __call__(self, _: int) -> None:
        for _round_trip in range(2):
            self.sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            self.sock.recv(64)

    def close(self) -> None:
        self.sock.close()


class _MinimalLock:
    """The least a correct lock cycle can cost a Python client: no library, no features.

    A fresh random value, ``SET NX PX`` and redis-py's compare-and-delete
    script, each reply checked, on a socket with a timeout (a lock client
    must not hang on a frozen server: ``poll`` before each ``recv``). What
    it costs above the bare pair is the floor of any lock; what a lock
    costs above it is its own code.
    """

    def __init__(self, port: int, client: redis.Redis) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5.0)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.release_sha = client.script_load(client.lock("x").LUA_RELEASE_SCRIPT).encode()

    def __call__(self, i: int) -> None:
        key, value = b"cycle:%d" % i, secrets.token_hex(16).encode()
        head = b"$%d\r\n%s\r\n" % (len(key), key)
        self.sock.sendall(
            b"*6\r\n$3\r\nSET\r\n%s$32\r\n%s\r\n$2\r\nNX\r\n$2\r\nPX\r\n$5\r\n30000\r\n"
            % (head, value)
        )
        if self.sock.recv(64) != b"+OK\r\n":
            raise RuntimeError("the minimal lock's key was taken")
        self.sock.sendall(
            b"*5\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$1\r\n1\r\n%s$32\r\n%s\r\n"
            % (self.release_sha, head, value)
        )
        if self.sock.recv(64) != b":1\r\n":
            raise RuntimeError("the minimal lock's release found another value")

    def close(self) -> None:
        self.sock.close()


def _cpu_against_floor(
    cycle: Callable[[int], None], bare: _BareSocket, seconds: float, chunk: int = 100
) -> tuple[float, float]:
    """Client CPU (µs) of one ``cycle`` and of one floor pair, in alternating chunks."""
    spent = {"cycle": 0.0, "floor": 0.0}
    count = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for name, action in (("cycle", cycle), ("floor", bare)):
            started = time.process_time()
            for i in range(chunk):
                action(i)
            spent[name] += time.process_time() - started
        count += chunk
    return spent["cycle"] / count * 1e6, spent["floor"] / count * 1e6
