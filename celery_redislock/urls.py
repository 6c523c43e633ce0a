"""Redis URLs in messages: never with their password.

kombu's ``sanitize_url`` is not used: it raises on exactly the URLs that end
up in error messages (a malformed port, a multi-host ``sentinel://`` URL).
"""

from __future__ import annotations

import re

__all__ = ["mask_url"]

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
    query_at = rest.find("?")
    head = rest if query_at < 0 else rest[:query_at]
    query = "" if query_at < 0 else _QUERY_SECRET.sub(r"\1**", rest[query_at:])
    userinfo, at, address = head.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        if drop_credentials:
            head = address
        elif colon:
            head = f"{user}:**@{address}"
    return f"{scheme}://{head}{query}"
