"""``changestreamer status``: fetch ``/statz?format=json`` and print it (wire.md §4.1).

The URL's origin is used over HTTP (``ws``→``http``, ``wss``→``https``; path
and query dropped). Credentials are HTTP Basic with user ``admin`` — the
server ignores the user name — and the admin password; without a password no
``Authorization`` header is sent (accepted only by a server in development
mode). Output, one section per stats group::

    === changeLog ===
      rows: 42
    === replication ===
      lastWatermark: 0c3f2b
      subscribers: [{"id":"serving-replicator-87",...}]

On a terminal each group is a table instead (:mod:`app.client.terminal`); through a
pipe or into a file the output is the text above. Either way, and in the error
lines, what the server sent is printed with its control characters spelled out
(:func:`app.logs.escape_controls`).

Exit codes: 0 printed; 1 refused (401), another HTTP error or no connection,
each reported as one line on stderr; 2 a malformed URL. The options are parsed by
``app/cli.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import getpass
import io
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TextIO

from app.client.credentials import PasswordFileError, read_password_file
from app.client.urls import parse_base_url
from app.logs import escape_controls
from app.protocol.canonical_json import dumps, loads

__all__ = ["format_statz", "run_status", "show_status", "status"]

ADMIN_USER = "admin"
_TIMEOUT_S = 10.0


class _HTTPFailure(Exception):
    def __init__(self, code: int | None, text: str) -> None:
        self.code = code
        super().__init__(text)


def _fetch(url: str, password: str | None) -> bytes:
    """GET ``url``. Proxies are not used."""
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if password is not None:
        token = base64.b64encode(f"{ADMIN_USER}:{password}".encode()).decode("ascii")
        request.add_header("Authorization", f"Basic {token}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=_TIMEOUT_S) as response:
            body: bytes = response.read()
            return body
    except urllib.error.HTTPError as e:
        with e:
            raise _HTTPFailure(e.code, f"HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        raise _HTTPFailure(None, f"cannot reach {url}: {reason}") from None


def _value(value: Any) -> str:
    if isinstance(value, str):
        return value
    return dumps(value)


def format_statz(stats: Any) -> str:
    """The readable form of a ``/statz?format=json`` document (see the module docstring)."""
    if not isinstance(stats, dict):
        return escape_controls(json.dumps(stats, indent=2, ensure_ascii=False), in_json=True) + "\n"
    lines: list[str] = []
    for group, values in stats.items():
        lines.append(f"=== {group} ===")
        if isinstance(values, dict):
            lines.extend(f"  {key}: {_value(value)}" for key, value in values.items())
        else:
            lines.append(f"  {_value(values)}")
    return "".join(escape_controls(line) + "\n" for line in lines)


async def status(url: str, *, password: str | None, out: TextIO, err: TextIO | None = None) -> int:
    """:func:`show_status` in a thread, for callers on an event loop."""
    return await asyncio.to_thread(show_status, url, password=password, out=out, err=err)


def show_status(url: str, *, password: str | None, out: TextIO, err: TextIO | None = None) -> int:
    """Prints the server's ``/statz`` groups; returns the exit code (see module docstring).

    Blocking, on purpose: the command runs it in the main thread, where a Ctrl-C
    interrupts even a server that never answers (a worker thread would have to be
    waited for).
    """
    errors = err if err is not None else sys.stderr
    try:
        statz_url = parse_base_url(url).http("/statz", {"format": "json"})
    except ValueError as e:
        _say(errors, str(e))
        return 2
    try:
        body = _fetch(statz_url, password)
    except _HTTPFailure as e:
        if e.code == 401:
            hint = (
                "the admin password was rejected"
                if password is not None
                else "an admin password is required (ZERO_ADMIN_PASSWORD or --password-file)"
            )
            _say(errors, f"unauthorized (HTTP 401): {hint}")
        else:
            _say(errors, str(e))
        return 1
    try:
        stats = loads(body.decode())
    except ValueError:
        _say(errors, "/statz did not return JSON")
        return 1
    if out.isatty():
        from app.client.terminal import print_statz  # rich: loaded for terminals only

        print_statz(stats, out)
    else:
        out.write(format_statz(stats))
    out.flush()
    return 0


def run_status(
    args: argparse.Namespace,
    out: TextIO | None = None,
    err: TextIO | None = None,
    *,
    environ: Mapping[str, str] = os.environ,
    prompt: Callable[[], str | None] | None = None,
) -> int:
    """Runs ``status`` for its parsed options (``app/cli.py``); the exit code.

    The password comes from ``--password-file``, else ``ZERO_ADMIN_PASSWORD``; with
    neither, a server that answers 401 is asked again with a password typed at a
    prompt (on a terminal only). ``--password`` still works, with a warning: the
    command line is visible to every local user."""
    errors = err if err is not None else sys.stderr
    output = out if out is not None else sys.stdout
    url: str = args.url
    if getattr(args, "discover", None):
        found = _discovered(args)
        if isinstance(found, _Failed):
            _say(errors, found.message)
            return found.code
        url = found
    password: str | None
    if args.password is not None:
        _say(
            errors,
            "--password shows the password to every local user "
            "(ps); use ZERO_ADMIN_PASSWORD or --password-file",
        )
        password = args.password
    elif args.password_file is not None:
        try:
            password = read_password_file(args.password_file)
        except PasswordFileError as e:
            _say(errors, str(e))
            return 2
    else:
        password = environ.get("ZERO_ADMIN_PASSWORD") or None
    if password is not None:
        return show_status(url, password=password, out=output, err=errors)
    ask = prompt if prompt is not None else _terminal_prompt
    quiet = io.StringIO()  # the 401 line only if no password can be asked for
    code = show_status(url, password=None, out=output, err=quiet)
    if code == 1 and "HTTP 401" in quiet.getvalue():
        typed = ask()
        if typed:
            return show_status(url, password=typed, out=output, err=errors)
    errors.write(quiet.getvalue())
    return code


def _say(errors: TextIO, text: str) -> None:
    """One line on stderr; the server's words (an HTTP reason, say) with their
    control characters spelled out."""
    errors.write(f"changestreamer status: {escape_controls(text)}\n")


class _Failed(NamedTuple):
    message: str
    code: int


def _discovered(args: argparse.Namespace) -> str | _Failed:
    """The change log's owner, found through ``--discover``'s change DB."""
    # Here, not at the top: it brings the change DB's engine (SQLAlchemy).
    from app.client.discovery import discover
    from app.client.errors import DiscoveryError
    from app.storage.errors import ChangeDbConfigError
    from app.storage.shard import Shard

    try:
        shard = Shard(args.app_id, args.shard_num)
    except ChangeDbConfigError as e:
        return _Failed(str(e), 2)
    try:
        return asyncio.run(discover(args.discover, shard))
    except DiscoveryError as e:
        return _Failed(f"--discover: {e}", 1)


def _terminal_prompt() -> str | None:
    """The admin password typed at the terminal; None without one."""
    if not sys.stdin.isatty():
        return None
    try:
        return getpass.getpass("admin password: ")
    except (EOFError, KeyboardInterrupt):
        return None
