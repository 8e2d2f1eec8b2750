"""URLs of a change-streamer, derived from a base URI the way zero derives them.

zero resolves the fixed path ``/replication/v<N>/<action>`` against the
configured ``ZERO_CHANGE_STREAMER_URI`` as an absolute path, so any path prefix
or query string of the base is discarded (wire.md §0). ``http``/``https`` bases
are accepted and mean ``ws``/``wss``.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

__all__ = ["BaseURL", "parse_base_url", "without_userinfo"]

_WS_SCHEMES = {"ws": "ws", "wss": "wss", "http": "ws", "https": "wss"}
_HTTP_SCHEMES = {"ws": "http", "wss": "https"}


class BaseURL:
    """A change-streamer's origin: websocket scheme plus ``host[:port]``."""

    def __init__(self, scheme: str, netloc: str) -> None:
        self.scheme = scheme  # "ws" or "wss"
        self.netloc = netloc

    def websocket(self, path: str, query: Mapping[str, str] | None = None) -> str:
        """``ws(s)://netloc<path>[?query]``; ``path`` must start with ``/``."""
        url = f"{self.scheme}://{self.netloc}{path}"
        return f"{url}?{urlencode(query)}" if query else url

    def http(self, path: str, query: Mapping[str, str] | None = None) -> str:
        """The same origin over HTTP (``ws``→``http``, ``wss``→``https``)."""
        url = f"{_HTTP_SCHEMES[self.scheme]}://{self.netloc}{path}"
        return f"{url}?{urlencode(query)}" if query else url

    def with_password(self, password: str) -> BaseURL:
        """The same origin with ``password`` as its user info's password (what the
        replication endpoints check as Basic auth; the user name is kept or empty)."""
        userinfo, at, hostport = self.netloc.rpartition("@")
        user = userinfo.partition(":")[0] if at else ""
        return BaseURL(self.scheme, f"{user}:{quote(password, safe='')}@{hostport}")

    def __str__(self) -> str:
        # Never the password: this is what logs and errors show.
        userinfo, at, hostport = self.netloc.rpartition("@")
        if at and ":" in userinfo:
            return f"{self.scheme}://{userinfo.partition(':')[0]}:***@{hostport}"
        return f"{self.scheme}://{self.netloc}"

    def __repr__(self) -> str:
        return f"BaseURL({str(self)!r})"


def without_userinfo(url: str) -> str:
    """``url`` without its user info (``user:password@``) and query: what an error
    names, so that no credential reaches a terminal or a log."""
    parts = urlsplit(url)
    hostport = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, hostport, parts.path, "", ""))


def parse_base_url(value: str) -> BaseURL:
    """Parses ``ws://``, ``wss://``, ``http://`` or ``https://`` URIs; path/query ignored."""
    parts = urlsplit(value.strip())
    scheme = _WS_SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        raise ValueError(
            f"change-streamer URI {value!r} must start with ws://, wss://, http:// or https://"
        )
    if not parts.netloc:
        raise ValueError(f"change-streamer URI {value!r} has no host")
    return BaseURL(scheme, parts.netloc)
