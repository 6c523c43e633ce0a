"""Redis URLs in messages: never with their password.

kombu's ``sanitize_url`` is not used: it raises on exactly the URLs that end
up in error messages (a malformed port, a multi-host ``sentinel://`` URL),
and it shows query parameters such as ``?password=`` as they are.
"""

from __future__ import annotations

import re

__all__ = ["has_credentials", "mask_url"]

#: Query parameters shown as they are; every other one (``password``,
#: ``ssl_password``, a percent-encoded ``pass%77ord``, or the tail of a
#: password holding a raw ``&``) is shown as ``**``.
_SAFE_QUERY_KEYS = frozenset(
    {
        "db",
        "protocol",
        "socket_timeout",
        "socket_connect_timeout",
        "socket_keepalive",
        "health_check_interval",
        "retry_on_timeout",
        "max_connections",
        "ssl_cert_reqs",
        "ssl_check_hostname",
        "decode_responses",
        "encoding",
        "timeout",
    }
)
#: Query parameters whose name is shown (with its value masked); any other
#: name may be the tail of a password holding a raw "&".
_KNOWN_QUERY_KEYS = _SAFE_QUERY_KEYS | {
    "password",
    "username",
    "client_name",
    "ssl_password",
    "ssl_keyfile",
    "ssl_certfile",
    "ssl_ca_certs",
}
_SAFE_QUERY_VALUE = re.compile(r"[\w.\-]*")
#: What may follow the userinfo's "@" up to the path: host names, IPv4 and
#: IPv6 addresses, ports, and a sentinel URL's comma-separated hosts.
_ADDRESS = re.compile(r"[\w.\-\[\]:,%]*")
#: A query before an "@" ("?password=Zx@pw"): that "@" is not the userinfo's.
_QUERY_BEFORE = re.compile(r"\?[^@]*=")


def _split_userinfo(rest: str) -> tuple[str | None, str]:
    """Split ``rest`` (after ``scheme://``) into userinfo (None if none) and the rest.

    The userinfo ends at the last "@" that is followed by an address: a
    generated password may hold a raw "/", "?", "#" or "@" (redis-py then
    misparses the URL), and a password in the query may hold an "@" too.
    Returns ``(None, "**")`` when no reading is safe to show.
    """
    at = len(rest)
    while (at := rest.rfind("@", 0, at)) >= 0:
        before, after = rest[:at], rest[at + 1 :]
        if _ADDRESS.fullmatch(re.split(r"[/?#]", after, maxsplit=1)[0]) and not (
            _QUERY_BEFORE.search(before)
        ):
            return before, after
    first_at, first_query = rest.find("@"), rest.find("?")
    if first_at < 0 or 0 <= first_query < first_at:
        return None, rest  # no userinfo; any "@" is inside the query
    return None, "**"


def _mask_query(query: str) -> str:
    shown = []
    for pair in re.split(r"[&;]", query):
        key, equals, value = pair.partition("=")
        safe = key in _SAFE_QUERY_KEYS and equals and _SAFE_QUERY_VALUE.fullmatch(value)
        shown.append(pair if safe else (f"{key}=**" if key in _KNOWN_QUERY_KEYS else "**"))
    return "&".join(shown)


def mask_url(url: str, drop_credentials: bool = False) -> str:
    """Return ``url`` with its password and other secrets replaced by ``**``.

    The password in the userinfo, every query parameter not known to be
    harmless (``db``, timeouts, ...) and any fragment are masked.

    Args:
        url: Any string; text that is not a URL is returned unchanged.
        drop_credentials: Remove user and password altogether.
    """
    scheme, separator, rest = url.partition("://")
    if not separator:
        return url
    userinfo, address = _split_userinfo(rest)
    address, question, query = address.partition("?")
    address, hash_mark, _ = address.partition("#")
    shown = address + ("#**" if hash_mark else "") + (f"?{_mask_query(query)}" if question else "")
    if userinfo is None or drop_credentials:
        return f"{scheme}://{shown}"
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}://{user}:**@{shown}" if colon else f"{scheme}://{userinfo}@{shown}"


def has_credentials(url: str) -> bool:
    """True if ``url`` carries a user or password (before its last ``@``)."""
    _, separator, rest = url.partition("://")
    return bool(separator) and "@" in rest
