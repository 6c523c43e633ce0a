"""Redis clients of the lock store: URL to client, the package's defaults, and client sources.

A URL (``redis://``, ``rediss://``, ``unix://``, ``sentinel://``,
``redis+cluster://``) becomes a redis-py client with bounded timeouts; a
client (the standalone lock's) becomes a :class:`ClientSource`: what the
transport needs of it to open its own connections, without a reference to it.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from difflib import get_close_matches
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import REDIS_ALLOWED_KEYS, RedisCluster
from redis.connection import (
    AbstractConnection,
    Connection,
    ConnectionPool,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.retry import Retry
from redis.sentinel import Sentinel

from celery_redislock.exceptions import LockBackendError
from celery_redislock.transport import connection_settings
from celery_redislock.urls import has_credentials, mask_url

__all__ = [
    "DEFAULT_OPTIONS",
    "DEFAULT_RETRIES",
    "DEFAULT_RETRY_BACKOFF_CAP",
    "URL_SCHEMES",
    "ClientSource",
    "bounded_options",
    "build_client",
    "check_options",
    "check_url",
    "client_source",
    "default_retry",
    "describe_client",
    "url_error_detail",
]

DEFAULT_OPTIONS: Mapping[str, Any] = {
    # Bounded, so a hung Redis can never hang a task forever.
    "socket_timeout": 5.0,
    "socket_connect_timeout": 5.0,
    "health_check_interval": 30,
}

#: The schemes a lock-store URL may have (what :func:`build_client` builds a client for).
URL_SCHEMES = ("redis", "rediss", "unix", "sentinel", "redis+cluster", "rediss+cluster")

#: The command retry policy when none is given: 2 quick retries.
DEFAULT_RETRY_BACKOFF_CAP = 0.2
DEFAULT_RETRIES = 2


def bounded_options(options: Mapping[str, Any], bound: float) -> dict[str, Any]:
    """``options`` for a caller that must never wait on the store longer than ``bound`` seconds.

    The producer's lock-store calls (``delay()`` of a ``lock_enqueue`` or
    debounced task) use them. Connecting and each reply get half of
    ``bound``, and nothing is retried (neither by the command nor by
    redis-py's connect), so one call gives up within ``bound`` when the store
    accepts connections and never answers (frozen), does not accept them
    (unreachable host), or both in turn. Sentinels asked for the master get
    the same timeouts; each one asked adds to it.
    """
    half = bound / 2
    bounded = {
        **options,
        "socket_timeout": half,
        "socket_connect_timeout": half,
        "retry": Retry(NoBackoff(), 0),
    }
    if options.get("sentinel_kwargs") is not None:
        bounded["sentinel_kwargs"] = {
            **options["sentinel_kwargs"],
            "socket_timeout": half,
            "socket_connect_timeout": half,
            "retry": Retry(NoBackoff(), 0),
        }
    return bounded


def default_retry() -> Retry:
    """The command retry policy when none is given: 2 quick retries."""
    return Retry(ExponentialBackoff(cap=DEFAULT_RETRY_BACKOFF_CAP, base=0.01), DEFAULT_RETRIES)


def _sentinel_master(url: str, options: Mapping[str, Any]) -> redis.Redis:
    """Build a client that follows the master of a Sentinel-monitored service.

    ``sentinel://[[user]:password@]host:port[,host:port...]/service[/db]``.
    The credentials are the data nodes' (as in ``redis://``); the sentinels'
    own connection settings go in ``redislock_redis_options["sentinel_kwargs"]``.
    Every (re)connect asks the sentinels for the current master, and a
    connection still open to a demoted master is dropped on its first
    ``READONLY`` reply, so the client follows a failover by itself.
    """
    parsed = urlsplit(url)
    sentinels, service, db = _sentinel_parts(url)
    options = dict(options)
    sentinel_kwargs = options.pop("sentinel_kwargs", None)
    if sentinel_kwargs is None:
        # The sentinels' clients would otherwise retry with redis-py's own
        # backoff inside every one of our attempts (measured: 23 s to give up
        # on two unreachable sentinels). Same timeouts as the data nodes, no
        # retry of their own: ours is the only retry loop.
        sentinel_kwargs = {
            name: options[name]
            for name in ("socket_timeout", "socket_connect_timeout")
            if name in options
        }
        sentinel_kwargs["retry"] = Retry(NoBackoff(), 0)
    if parsed.username:
        options["username"] = unquote(parsed.username)
    if parsed.password:
        options["password"] = unquote(parsed.password)
    sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs, **options)  # type: ignore[no-untyped-call]
    master: redis.Redis = sentinel.master_for(service, db=db)  # type: ignore[no-untyped-call]
    return master


def _sentinel_parts(url: str) -> tuple[list[tuple[str, int]], str, int]:
    """The sentinels' addresses, the service name and the database of a ``sentinel://`` URL.

    Raises:
        ValueError: the URL has no service, or an address is not host:port.
    """
    parsed = urlsplit(url)
    path = [part for part in parsed.path.split("/") if part]
    if not path or len(path) > 2 or (len(path) > 1 and not path[1].isdigit()):
        raise ValueError("expected sentinel://host:port[,host:port...]/service_name[/db]")
    service, db = path[0], int(path[1]) if len(path) > 1 else 0
    hosts = parsed.netloc.rpartition("@")[2]
    sentinels = []
    for address in hosts.split(","):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"sentinel address {address!r} is not host:port")
        sentinels.append((host, int(port)))
    return sentinels, service, db


def check_url(url: str) -> None:
    """Parse ``url`` as :func:`build_client` does, without connecting to anything.

    The scheme, the port, the database number, the query options and a
    Sentinel URL's addresses and service are checked: what would otherwise
    fail only at the first lock operation (or, for a database path that is
    not a number, be ignored by redis-py, which then uses database 0).

    Raises:
        ValueError: the URL cannot name a Redis server; the message may quote
            the URL (see :func:`url_error_detail`).
    """
    scheme, _, rest = url.partition("://")
    if scheme not in URL_SCHEMES:
        raise ValueError(f"the scheme {scheme!r} is not one of {', '.join(URL_SCHEMES)}")
    if scheme == "sentinel":
        _sentinel_parts(url)
        return
    base = scheme.split("+")[0]
    parse_url(f"{base}://{rest}")  # type: ignore[no-untyped-call]
    # redis-py hands a query option it does not parse to the connection as is.
    query = parse_qs(urlsplit(url).query)
    check_options(dict.fromkeys(query))
    for name in _SOCKET_SECONDS:
        try:
            zero = float(query.get(name, ["1"])[-1]) == 0
        except ValueError:  # not a number: parse_url refused it already
            zero = False
        if zero:
            raise ValueError(f"{name}=0 makes the socket non-blocking (every read fails)")
    if base == "unix":
        if not urlsplit(url).path:
            raise ValueError("a unix:// URL needs the socket's path (unix:///run/redis.sock)")
        return  # the database is a query option (?db=2), which parse_url checked
    database = urlsplit(f"{base}://{rest}").path.strip("/")
    if database and not database.isdigit():
        raise ValueError(f"the database must be a number (redis://host:port/2), got {database!r}")
    if database and int(database) != 0 and scheme.endswith("+cluster"):
        raise ValueError("Redis Cluster has only database 0")


@functools.cache
def _option_names() -> frozenset[str]:
    """Every keyword redis-py takes for a lock-store client, whatever the URL's scheme."""
    names = set(REDIS_ALLOWED_KEYS) | {"sentinel_kwargs"}
    for function in (
        redis.Redis.__init__,
        redis.Redis.from_url,
        Sentinel.__init__,
        AbstractConnection.__init__,
        Connection.__init__,
        SSLConnection.__init__,
        UnixDomainSocketConnection.__init__,
        ConnectionPool.__init__,
        RedisCluster.__init__,
    ):
        names.update(inspect.signature(function).parameters)
    return frozenset(names - {"self", "cls", "url", "args", "kwargs", "sentinels"})


#: Options whose value redis-py uses only once connected (a str failed every command).
_SECONDS = ("socket_timeout", "socket_connect_timeout", "health_check_interval")
#: Of those, the socket's own: 0 makes it non-blocking (every read fails with EAGAIN).
_SOCKET_SECONDS = ("socket_timeout", "socket_connect_timeout")
#: Flags redis-py reads by truth value: a str ("no") would turn them on.
_FLAGS = ("retry_on_timeout", "socket_keepalive")


def check_options(options: Mapping[str, Any]) -> None:
    """Refuse what redis-py would refuse only when it first connects, or ignore.

    An unknown name (a typo) was a ``TypeError`` at the first command (a
    cluster client drops it silently); a timeout that is not a number failed
    every command.

    Raises:
        ValueError: names the option and says what it must be.
    """
    known = _option_names()
    for name, value in options.items():
        if name not in known:
            guess = get_close_matches(name, known, n=1)
            raise ValueError(
                f"{name} is not a redis-py connection option"
                + (f"; did you mean {guess[0]}?" if guess else "")
            )
        if name in _SECONDS and value is not None:
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a number of seconds >= 0 or None, got {value!r}")
            if name in _SOCKET_SECONDS and value == 0:
                raise ValueError(
                    f"{name} must be more than 0 seconds, or None (0 makes the socket "
                    "non-blocking: every read fails at once)"
                )
        if name in _FLAGS and value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
        if name == "protocol" and value not in (None, 2, 3, "2", "3"):
            raise ValueError(f"protocol must be 2 or 3 (RESP2, RESP3), got {value!r}")
        whole = isinstance(value, int) and not isinstance(value, bool)
        if name == "max_connections" and value is not None and not (whole and value >= 1):
            raise ValueError(f"max_connections must be an int >= 1 or None, got {value!r}")


def url_error_detail(url: str, error: Exception) -> str:
    """What to say about ``error``, raised while parsing ``url``, without quoting a password."""
    if has_credentials(url):
        # redis-py's message may quote a piece of a password it misparsed.
        return (
            f"it is not a valid Redis URL ({type(error).__name__}); check the host, port "
            "and database number, and percent-encode / ? # and @ in the password"
        )
    return str(error)


def build_client(url: str, options: Mapping[str, Any]) -> redis.Redis | RedisCluster:
    """Build the redis-py client a lock store URL names.

    Raises:
        LockBackendError: the URL is not valid (the message never quotes a password).
    """
    try:
        if url.startswith("sentinel://"):
            return _sentinel_master(url, options)
        if url.startswith(("redis+cluster://", "rediss+cluster://")):
            scheme, rest = url.split("://", 1)
            base = scheme.split("+")[0]
            return RedisCluster.from_url(f"{base}://{rest}", **options)
        return redis.Redis.from_url(url, **options)
    except (ValueError, TypeError) as exc:
        detail = url_error_detail(url, exc)
        error = LockBackendError(f"cannot use redislock_url {mask_url(url)!r}: {detail}")
        # Not chained when credentials are present: the cause quotes the URL.
        raise error from (None if has_credentials(url) else exc)


@dataclass(frozen=True)
class ClientSource:
    """What the transport needs of a redis-py client, without a reference to it.

    For one server: the pool's connection class and settings (copied); for
    a cluster: redis-py's slot map. Holding neither the client nor its pool
    is what lets a dropped client be freed at once, with its connections.
    """

    connection_class: type | None
    connection_kwargs: Mapping[str, Any]
    nodes_manager: Any
    retry: Retry | None


def client_source(client: redis.Redis | RedisCluster) -> Callable[[], ClientSource]:
    """What the transport needs of ``client``, captured now (no reference kept)."""
    if isinstance(client, RedisCluster):
        source = ClientSource(None, {}, client.nodes_manager, getattr(client, "retry", None))
    else:
        pool = client.connection_pool
        kwargs = connection_settings(pool.connection_kwargs)
        source = ClientSource(pool.connection_class, kwargs, None, kwargs.get("retry"))
    return lambda: source


def describe_client(client: redis.Redis | RedisCluster) -> str:
    """The address of ``client``'s server, for messages (no credentials)."""
    if isinstance(client, RedisCluster):
        node = client.get_default_node()  # type: ignore[no-untyped-call]
        return f"cluster {node.host}:{node.port}" if node is not None else "a Redis Cluster"
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
