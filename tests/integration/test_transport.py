"""The transport's own socket reads and writes: replies in pieces, late replies, odd bytes."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ConnectionError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
    TimeoutError,
)

from celery_redislock.store import LockStore, _Kind
from celery_redislock.transport import (
    NO_RETRY,
    Endpoint,
    Subscription,
    read_replies,
    send_and_read,
)
from tests.conftest import LOCK_DB
from tests.servers import RedisServer, server_busy

REPLIES = (
    b"+OK\r\n"
    b":-42\r\n"
    b"$5\r\nhe\r\nl\r\n"  # a bulk string may hold CR LF
    b"$-1\r\n"
    b"*-1\r\n"
    b"*0\r\n"
    b"*3\r\n:1\r\n*2\r\n$1\r\na\r\n-ERR inner\r\n$0\r\n\r\n"
    b"-NOSCRIPT No matching script. Please use EVAL.\r\n"
)


@pytest.fixture
def socket_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair()
    ours.settimeout(2.0)
    yield ours, theirs
    ours.close()
    theirs.close()


def _check(replies: list[object]) -> None:
    assert replies[:6] == [b"OK", -42, b"he\r\nl", None, None, []]
    one, inner, empty = replies[6]  # type: ignore[misc]
    assert one == 1 and empty == b""
    assert inner[0] == b"a" and isinstance(inner[1], ResponseError)
    assert str(inner[1]) == "inner"
    assert isinstance(replies[7], NoScriptError)


@pytest.mark.parametrize("chunk", [1, 3, 7, len(REPLIES)])
def test_replies_split_anywhere_are_read_whole(
    socket_pair: tuple[socket.socket, socket.socket], chunk: int
) -> None:
    ours, theirs = socket_pair

    def send() -> None:
        for start in range(0, len(REPLIES), chunk):
            theirs.sendall(REPLIES[start : start + chunk])

    sender = threading.Thread(target=send)
    sender.start()
    replies = read_replies(ours, 8)
    sender.join()
    _check(replies)


@pytest.mark.parametrize(
    ("first", "rest", "expected"),
    [
        (b"*2\r\n", b":1\r\n:2\r\n", [1, 2]),
        (b"$5\r\n", b"hello\r\n", b"hello"),
        (b"$0\r\n", b"\r\n", b""),
        # A first read of one byte (a proxy forwarding byte by byte): no
        # CR LF in it yet, which the fast path took for one at its end.
        (b":", b"1\r\n", 1),
        (b"+", b"OK\r\n", b"OK"),
        (b"$", b"-1\r\n", None),
    ],
)
def test_one_reply_whose_first_read_ends_at_a_line_end_is_read_whole(
    socket_pair: tuple[socket.socket, socket.socket], first: bytes, rest: bytes, expected: object
) -> None:
    ours, theirs = socket_pair
    reads = _Reads(ours)
    theirs.sendall(first)

    def send_rest() -> None:  # only once the first read returned ``first`` alone
        if reads.first.wait(5.0):
            theirs.sendall(rest)

    sender = threading.Thread(target=send_rest)
    sender.start()
    try:
        assert read_replies(reads, 1) == [expected]
    finally:
        reads.first.set()
        sender.join()


class _Reads:
    """A real socket that says when its first read has returned."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.first = sock, threading.Event()

    def recv(self, size: int) -> bytes:
        data = self.sock.recv(size)
        self.first.set()
        return data


def test_bytes_after_the_replies_are_a_connection_error(
    socket_pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = socket_pair
    theirs.sendall(b":1\r\n:2\r\n")
    with pytest.raises(ConnectionError, match="unexpected bytes"):
        read_replies(ours, 1)


def test_a_closed_connection_and_a_silent_one(
    socket_pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = socket_pair
    ours.settimeout(0.2)
    theirs.sendall(b"*2\r\n:1\r\n")  # half a reply, then nothing
    with pytest.raises(TimeoutError):
        read_replies(ours, 1)
    theirs.close()
    with pytest.raises(ConnectionError, match="closed"):
        read_replies(ours, 1)


def test_an_unknown_reply_type_is_refused(
    socket_pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = socket_pair
    theirs.sendall(b"%1\r\n")
    with pytest.raises(redis.exceptions.InvalidResponse, match="'%'"):
        read_replies(ours, 1)


def _endpoint(store: LockStore) -> Endpoint:
    return store._topology(_Kind.COMMANDS).endpoint_for("k")


def test_a_reply_larger_than_one_read_and_many_replies(server: RedisServer) -> None:
    store = LockStore(server.url_for(LOCK_DB))
    endpoint = _endpoint(store)
    big = b"x" * 300_000
    assert endpoint.call("SET", "big", big) == b"OK"
    assert endpoint.call("GET", "big") == big
    replies = endpoint.pipeline([("GET", "big"), ("INCR", "big"), ("GET", "nothing")] * 20)
    assert replies[0::3] == [big] * 20
    assert all(isinstance(reply, ResponseError) for reply in replies[1::3])
    assert replies[2::3] == [None] * 20
    with pytest.raises(ResponseError, match="not an integer"):
        endpoint.call("INCR", "big")
    assert endpoint.call("PING") == b"PONG"  # the connection is still in step


def test_a_reply_that_comes_after_the_timeout_is_never_read_by_the_next_command(
    server: RedisServer,
) -> None:
    """The command ran although its caller gave up: its late reply must not answer another."""
    store = LockStore(server.url_for(LOCK_DB), {"socket_timeout": 0.2, "retry": NO_RETRY})
    endpoint = _endpoint(store)
    assert endpoint.call("SET", "a", "first") == b"OK"
    with server_busy(server, 0.6), pytest.raises(TimeoutError):
        endpoint.call("GET", "a")  # its reply "first" arrives after the timeout
    assert endpoint.call("SET", "b", "second") == b"OK"
    assert endpoint.call("GET", "b") == b"second"
    assert endpoint.call("GET", "a") == b"first"


def test_a_frozen_server_times_out_reading_and_writing() -> None:
    """The plain socket's first write bypasses ``sendall``: its timeout still holds."""
    server = RedisServer()
    try:
        store = LockStore(server.url_for(LOCK_DB), {"socket_timeout": 0.3, "retry": NO_RETRY})
        endpoint = _endpoint(store)
        assert endpoint.call("SET", "a", "1") == b"OK"
        (connection,) = endpoint._idle
        assert connection._sock.gettimeout() == 0.3
        server.pause()
        try:
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="reading"):
                endpoint.call("GET", "a")
            assert 0.25 <= time.monotonic() - started < 2.0
            assert connection._sock is None  # dropped, not kept with a reply owed
            server.resume()
            assert endpoint.call("PING") == b"PONG"  # connected again (the handshake reads)
            server.pause()
            # More than the socket buffers hold: written in part, then sendall times out.
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="writing"):
                endpoint.call("SET", "big", b"x" * 64_000_000)
            assert time.monotonic() - started < 2.0
        finally:
            server.resume()
        assert endpoint.call("SET", "b", "2") == b"OK"
        assert endpoint.call("GET", "a") == b"1"
        assert endpoint.call("EXISTS", "big") == 0
    finally:
        server.close()


def test_signals_during_a_wait_do_not_stretch_the_timeout() -> None:
    """A signal handler that returns makes CPython retry the read: the deadline must hold.

    (A kernel receive timeout restarts with every retry: with a no-op timer
    signal every 0.3 s and a 1 s timeout, a frozen server made it wait forever.)
    """
    server = RedisServer()
    started = time.monotonic()
    signals: list[float] = []

    def tick(_signum: int, _frame: object) -> None:
        signals.append(time.monotonic())
        if time.monotonic() - started > 8:
            raise RuntimeError(f"still waiting after {len(signals)} signals")

    previous = signal.signal(signal.SIGALRM, tick)
    try:
        store = LockStore(server.url_for(LOCK_DB), {"socket_timeout": 1.0, "retry": NO_RETRY})
        endpoint = _endpoint(store)
        assert endpoint.call("PING") == b"PONG"
        server.pause()
        signal.setitimer(signal.ITIMER_REAL, 0.3, 0.3)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            endpoint.call("GET", "a")
        assert time.monotonic() - started < 3.0
        assert len(signals) >= 2  # the wait was interrupted, and still ended in time
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        server.resume()
        server.close()


class _Pool:
    """What a connection's ``connection_pool`` says: a Sentinel master's pool or not."""

    def __init__(self, is_master: bool) -> None:
        self.is_master = is_master


class _Connection:
    """A connection whose socket the test answers for (its other end is ``theirs``)."""

    def __init__(self, sock: socket.socket, is_master: bool = False) -> None:
        self._sock = sock
        self.connection_pool = _Pool(is_master)


@pytest.mark.parametrize(
    ("reply", "raised"),
    [
        (b"-LOADING Redis is loading the dataset in memory\r\n", BusyLoadingError),
        (b"-NOAUTH Authentication required.\r\n", AuthenticationError),
        (b"-WRONGPASS invalid username-password pair\r\n", AuthenticationError),
    ],
)
def test_error_replies_redis_py_treats_as_connection_errors_are_raised(
    socket_pair: tuple[socket.socket, socket.socket], reply: bytes, raised: type[Exception]
) -> None:
    """Raised, not returned as a value: the caller's retry policy sees a connection error."""
    ours, theirs = socket_pair
    theirs.sendall(reply)
    with pytest.raises(raised):
        send_and_read(_Connection(ours), b"*1\r\n$4\r\nPING\r\n", 1)
    assert issubclass(raised, ConnectionError)


def test_readonly_from_a_sentinel_master_is_a_failover(
    socket_pair: tuple[socket.socket, socket.socket],
) -> None:
    """As redis-py's SentinelManagedConnection: reconnect to the new master, not fail."""
    ours, theirs = socket_pair
    readonly = b"-READONLY You can't write against a read only replica.\r\n"
    theirs.sendall(readonly)
    (reply,) = send_and_read(_Connection(ours), b"*1\r\n$4\r\nPING\r\n", 1)
    assert isinstance(reply, ReadOnlyError)  # a plain server: a refusal, in place
    theirs.sendall(readonly)
    with pytest.raises(ConnectionError, match="previous master"):
        send_and_read(_Connection(ours, is_master=True), b"*1\r\n$4\r\nPING\r\n", 1)


def test_a_message_arriving_with_the_subscribe_confirmation_is_kept(server: RedisServer) -> None:
    """A release announced while a waiter subscribes: never a stray-bytes error, never lost."""
    store = LockStore(server.url_for(LOCK_DB), {"retry": NO_RETRY})
    endpoint = _endpoint(store)
    publisher = server.client(LOCK_DB)
    stop = threading.Event()

    def publish() -> None:
        while not stop.is_set():
            pipe = publisher.pipeline(transaction=False)
            for _ in range(50):
                pipe.publish("busy", "x")
            pipe.execute()

    thread = threading.Thread(target=publish)
    thread.start()
    try:
        for _ in range(200):
            with Subscription(endpoint, "busy") as subscription:
                assert subscription.wait(2.0)
    finally:
        stop.set()
        thread.join()
        publisher.close()


def test_a_replica_wait_longer_than_the_socket_timeout_is_a_timeout(server: RedisServer) -> None:
    """``WAIT`` is read by redis-py's reader on a connection the transport has used."""
    from celery_redislock import LockBackendError

    store = LockStore(server.url_for(LOCK_DB), {"socket_timeout": 0.5, "retry": NO_RETRY})
    assert store.acquire("warm", "v", 10_000).acquired  # the connection went through ours
    with pytest.raises(LockBackendError) as raised:
        store.acquire("k", "v1", 10_000, min_replicas=1, replicas_timeout=2.0)
    assert isinstance(raised.value.__cause__, TimeoutError), raised.value.__cause__


def test_a_retried_exchange_runs_under_the_retry_policy_and_chains_no_earlier_attempt(
    server: RedisServer,
) -> None:
    """The exchange runs once directly; only a failure builds the retry policy's loop.

    Every failed attempt counts (two retries: three attempts), each one
    disconnects the connection, and the error that ends it is the last
    attempt's alone (review helper-38 F1: it carried the first in its
    context, one more "during handling" block per attempt in every log).
    """
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    store = LockStore(server.url_for(LOCK_DB))
    endpoint = _endpoint(store)
    endpoint.retry = Retry(NoBackoff(), 2)
    attempts: list[int] = []

    def failing(connection: object) -> None:
        attempts.append(len(attempts) + 1)
        raise ConnectionError(f"attempt {len(attempts)}")

    with pytest.raises(ConnectionError) as raised:
        endpoint.run(failing)
    assert attempts == [1, 2, 3]
    assert str(raised.value) == "attempt 3"
    assert raised.value.__context__ is None

    def fails_once(connection: object) -> str:
        attempts.append(0)
        if len(attempts) == 4:
            raise TimeoutError("first")
        return "answered"

    assert endpoint.run(fails_once) == "answered"
    assert len(attempts) == 5
    store.close()
