"""Redis URLs in messages: never with their password.

kombu's ``sanitize_url`` is not used: it raises on exactly the URLs that end
up in error messages (a malformed port, a multi-host ``sentinel://`` URL).
"""

from __future__ import annotations

import re

__all__ = ["has_credentials", "mask_url"]

_QUERY_SECRET = re.compile(r"((?:^|[?&;])(?:password|pass|pw)=)[^&;#]*", re.IGNORECASE)


def mask_url(url: str, drop_credentials: bool = False) -> str:
    """Return ``url`` with its password replaced by ``**``.

    Args:
        url: Any string; text that is not a URL is returned unchanged.
        drop_credentials: Remove user and password altogether.
    """
    scheme, separator, rest = url.partition("://")
    if not separator:
        return url
    # The userinfo ends at the last "@": a generated password may hold a raw
    # "/", "?", "#" or "@" (redis-py then misparses the URL, and its error
    # message quotes a piece of the password: see has_credentials).
    userinfo, at, address = rest.rpartition("@")
    query_at = address.find("?")
    if query_at >= 0:
        address = address[:query_at] + _QUERY_SECRET.sub(r"\1**", address[query_at:])
    if not at:
        return f"{scheme}://{address}"
    if drop_credentials:
        return f"{scheme}://{address}"
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}://{user}:**@{address}" if colon else f"{scheme}://{userinfo}@{address}"


def has_credentials(url: str) -> bool:
    """True if ``url`` carries a user or password (before its last ``@``)."""
    _, separator, rest = url.partition("://")
    return bool(separator) and "@" in rest
