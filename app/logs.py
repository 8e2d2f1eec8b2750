"""The log: one format for every line a process writes, its context, no secrets.

``configure_logging`` installs one handler on the root logger and routes uvicorn's
loggers to it (serve passes ``log_config=None`` to uvicorn, which then installs
nothing of its own). ``ZERO_LOG_FORMAT`` picks the format:

* ``text``: ``2026-12-01T11:42:09.392Z INFO changestreamer: message key=value …``
  (UTC, then the line's fields), a traceback on the lines after it;
* ``json``: one object per line, ``{"time", "level", "logger", "message", "pid",
  …fields, "exc"}``, shaped like zero-cache's JSON log (level names as zero writes
  them, fields flat beside the message) plus the time and logger a Python service
  has and a platform may not add.

Fields: a connection binds its subscriber's id, task, mode and protocol once
(``bind_log_fields``) and every line logged in its tasks carries them; a line
about a subscriber logged from elsewhere (the forwarder's timers, say) passes them
with ``extra=log_extra(fields)``. Nothing is done per change or per message. A
line shows at most ``FIELD_CHARS`` characters of each string in a field (a client
chooses its ids), then ``…(N chars)``.

Secrets: ``RedactSecrets`` scrubs every line's message, arguments and traceback
of URL passwords, ``password=`` conninfo values, ``Authorization`` header values
(websockets logs its handshake at debug level) and secret-looking query
parameters (``redact``, the one implementation; error messages that quote a URL use
it too). ``redacted_conninfo`` shows a Postgres upstream without them.

Control characters: ``escape_controls`` spells them out, in a text line's message
and fields, in a JSON line, and in what ``tail`` and ``status`` print.

Stdlib only at import (psycopg only inside ``redacted_conninfo``): ``cli`` imports it
before anything heavy.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections.abc import Mapping
from contextvars import ContextVar
from types import TracebackType
from typing import Final, Literal, TextIO

__all__ = [
    "FIELD_CHARS",
    "LogFormat",
    "LogHandler",
    "RedactSecrets",
    "bind_log_fields",
    "configure_logging",
    "escape_controls",
    "final_line",
    "log_extra",
    "log_level",
    "redact",
    "redacted_conninfo",
]

LogFormat = Literal["text", "json"]

# uvicorn's loggers: they propagate to ours (with log_config=None uvicorn adds no
# handler; these undo one a caller's earlier configuration may have added).
UVICORN_LOGGERS: Final = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")

_LEVELS: Final = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
# zero-cache's level names in its JSON lines (it has no "WARNING").
_JSON_LEVELS: Final = {"WARNING": "WARN"}
# The record attribute that carries a line's fields.
_FIELDS_ATTR: Final = "log_fields"
# JSON keys a field may not replace.
_CORE_KEYS: Final = frozenset({"time", "level", "logger", "message", "pid", "exc"})

# A field's characters in a line, at most (then "…(N chars)"): a client chooses its
# ids and each one is on every line its connection logs (issue 43: a 4 MB id made
# 25 MB of log in 5.6 s). The protocol refuses ids over 256 bytes; this bounds what
# reaches a line whatever reaches a field.
FIELD_CHARS: Final = 128

_fields: ContextVar[dict[str, object] | None] = ContextVar("log_fields", default=None)


def log_level(value: str) -> int:
    """``debug``, ``info``, ``warn``/``warning`` or ``error`` (any case) as a logging level."""
    try:
        return _LEVELS[value.strip().lower()]
    except KeyError:
        raise ValueError(
            f"unknown log level {value!r}: use one of debug, info, warn, error"
        ) from None


# -- secrets ------------------------------------------------------------------

# scheme://user:password@ — any scheme (postgres, ws, http, s3). The password runs
# to the first "@" on its line: it may hold "/" or a space when not percent-encoded
# (libpq then refuses the URL, and the error quotes it), and hiding too much beats
# showing a password.
_URL_PASSWORD: Final = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://[^\s:/@]*):[^@\n]{0,512}@")
# A password in libpq's key=value conninfo (sslpassword=, an environment's
# PGPASSWORD= too), its value as libpq reads it: quoted, '…' with \' and \\ inside
# (a quote left open hides the rest of its line), or bare up to whitespace, where a
# backslash escapes the next character (password=a\ b is "a b"). A "…" value is no
# libpq syntax but a repr's or a shell's: hidden whole too. A URL's ?password= is
# _SECRET_PARAM's (its value ends at "&").
_CONNINFO_PASSWORD: Final = re.compile(
    r"(?i)(?<![\w?&;])(\w*passw(?:or)?d\s*=\s*)"
    r"(?:'(?:[^'\\]|\\.)*'|'[^\n]*|\"(?:[^\"\\]|\\.)*\"|(?:\\.|[^\s\\])+\\?)"
)
# libpq's URI parse errors that quote one piece of the URI, which may be all or part
# of the password (``invalid percent-encoded token: "s3cr%zzet"``); errors that quote
# the whole URI are covered by the URL rule above.
# ``missing "=" after "Tail"`` quotes the word after a bare value that held a space:
# the password's tail.
_LIBPQ_TOKEN: Final = re.compile(
    r"((?:invalid percent-encoded token|invalid URI query parameter|"
    r'unexpected spaces found in|missing "=" after)\s*:?\s*)"[^"]*"'
)
# A credential header as websockets logs a handshake at debug level
# (``> Authorization: Basic OnMzY3I…``: the base64 of the replication password),
# or as a header dict's (or an ASGI scope's) repr shows it; the scheme is kept, the credentials not.
_AUTHORIZATION: Final = re.compile(
    r"(?i)(\b(?:proxy-)?authorization(?:['\"]?\s*[:=]|['\"]\s*,)\s*(?:b(?=['\"]))?['\"]?"
    r"(?:[A-Za-z][\w\-]*\s+)?)[^\s'\"]+"
)
# Query parameters whose name says secret: a custom source's ?apiKey=, a signed
# URL's X-Amz-Signature / X-Amz-Credential, ?token=, ?secret=.
_SECRET_PARAM: Final = re.compile(
    r"(?i)([?&;][\w.\-]*(?:key|token|secret|passw(?:or)?d|pwd|auth|signature|credential)"
    r"[\w.\-]*=)[^&#\s'\"]*"
)


def redact(text: str) -> str:
    """``text`` with every password and secret-looking parameter replaced by ``***``."""
    if "@" not in text and "=" not in text and '"' not in text and "uthorization" not in text:
        return text  # the common line: nothing that could hold a secret
    text = _AUTHORIZATION.sub(r"\1***", text)
    text = _LIBPQ_TOKEN.sub(r'\1"***"', text)
    text = _URL_PASSWORD.sub(r"\1:***@", text)
    text = _CONNINFO_PASSWORD.sub(r"\1***", text)
    return _SECRET_PARAM.sub(r"\1***", text)


def redacted_conninfo(conninfo: str) -> str:
    """A Postgres URL or key=value conninfo as ``user@host:port/dbname``: what it
    connects to, never the password or options. Text libpq cannot parse is shown
    redacted instead (it is usually what the error is about)."""
    import psycopg.conninfo  # only for Postgres upstreams; keeps this module light

    try:
        info = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.Error:
        return redact(conninfo)
    return (
        f"{info.get('user', '')}@{info.get('host', 'localhost')}:"
        f"{info.get('port', 5432)}/{info.get('dbname', '')}"
    )


_plain: Final = logging.Formatter()


class RedactSecrets(logging.Filter):
    """Redacts a record's message (arguments merged in) and traceback, in place, so
    every handler and formatter after it sees the clean text."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True  # bad arguments: the handler reports them, as logging does
        record.msg, record.args = redact(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = _plain.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


# -- fields -------------------------------------------------------------------


def bind_log_fields(fields: Mapping[str, object]) -> dict[str, object]:
    """Gives every line the current task logs, and the tasks it starts from now on,
    these fields (a connection's subscriber, task, mode, protocol): called once per
    connection. Returns the bound dict: a connection that learns more later (v7
    ``/subscribe`` learns its subscriber from a message) updates it in place, and
    the tasks it started before see that too."""
    bound = dict(fields)
    _fields.set(bound)
    return bound


def log_extra(fields: Mapping[str, object]) -> dict[str, object]:
    """``extra=`` for a line about a subscriber logged outside its connection's tasks."""
    return {_FIELDS_ATTR: fields}


class AddFields(logging.Filter):
    """Puts the bound fields on a record, unless the line brought its own
    (``log_extra``: they name what it is about, the bound ones only where it runs)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _FIELDS_ATTR not in record.__dict__:
            bound = _fields.get()
            if bound:
                record.__dict__[_FIELDS_ATTR] = bound
        return True


def _record_fields(record: logging.LogRecord) -> Mapping[str, object]:
    fields = record.__dict__.get(_FIELDS_ATTR)
    return fields if isinstance(fields, Mapping) else {}


def _cut(text: str) -> str:
    if len(text) <= FIELD_CHARS:
        return text
    return f"{text[:FIELD_CHARS]}…({len(text)} chars)"


def _bounded(value: object) -> object:
    """A field's value as a line shows it: every string in it (a client's id, or a
    list of them) cut to ``FIELD_CHARS`` characters, then ``…`` and its length;
    JSON's types kept, any other value as its cut ``str``."""
    if isinstance(value, str):
        return _cut(value)
    if value is None or isinstance(value, int | float):
        return value
    if isinstance(value, list):
        return [_bounded(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_bounded(v) for v in value)
    if isinstance(value, Mapping):
        return {_cut(str(k)): _bounded(v) for k, v in value.items()}
    return _cut(str(value))


# -- formats ------------------------------------------------------------------


def _utc_time(record: logging.LogRecord) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{stamp}.{int(record.msecs):03d}Z"


# Characters that end a line or drive a terminal, in a line a peer's text may reach
# (a subscriber id ``x%0AFORGED…`` would otherwise forge a whole line, a table name
# ``ESC [2J`` clear the screen of whoever runs ``tail``): C0 controls, the tab among
# them, DEL, C1 controls (NEL and CSI among them) and Unicode's line separators.
_CONTROL: Final = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# What JSON leaves raw with ensure_ascii=False (it escapes every C0 control in a
# string; outside strings they are layout) and a line reader or a terminal obeys.
_JSON_UNSAFE: Final = re.compile("[\x7f-\x9f\u2028\u2029]")
_NAMED_ESCAPES: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_control(match: re.Match[str]) -> str:
    c = match.group(0)
    named = _NAMED_ESCAPES.get(c)
    if named is not None:
        return named
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def _json_safe(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group(0)):04x}"


def escape_controls(text: str, *, in_json: bool = False) -> str:
    """``text`` safe to write on one line of a log or a terminal: every control
    character (``_CONTROL``) spelled out in the 2 to 6 characters of Python's
    escape, ``\\n``, ``\\t``, ``\\x1b``, ``\\x9b``, ``\\u2028``, which reads back
    unambiguously and which no terminal obeys.

    ``in_json``: ``text`` is JSON; the characters JSON leaves raw become ``\\u009b``
    escapes, so that it stays valid JSON of the same value."""
    if in_json:
        return _JSON_UNSAFE.sub(_json_safe, text)
    return _CONTROL.sub(_escape_control, text)


def _text_value(value: object) -> str:
    text = str(_bounded(value))
    if not text or _CONTROL.search(text) or any(c.isspace() or c in "\"='" for c in text):
        # json.dumps escapes quotes and C0 controls; the rest as a JSON line does.
        return escape_controls(json.dumps(text, ensure_ascii=False), in_json=True)
    return text


class TextFormatter(logging.Formatter):
    """``<UTC time> LEVEL logger: message key=value …``, then the traceback.

    The message and fields are one line whatever they hold (``escape_controls``);
    only the traceback, which is ours, spans several."""

    def format(self, record: logging.LogRecord) -> str:
        message = escape_controls(record.getMessage())
        line = f"{_utc_time(record)} {record.levelname} {record.name}: {message}"
        fields = _record_fields(record)
        if fields:
            line += "".join(f" {k}={_text_value(v)}" for k, v in fields.items() if v is not None)
        extra = self._traceback(record)
        return f"{line}\n{extra}" if extra else line

    def _traceback(self, record: logging.LogRecord) -> str:
        parts = []
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            parts.append(record.exc_text)
        if record.stack_info:
            parts.append(self.formatStack(record.stack_info))
        return "\n".join(parts)


class JsonFormatter(logging.Formatter):
    """One JSON object per line (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._pid = os.getpid()

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": _utc_time(record),
            "level": _JSON_LEVELS.get(record.levelname, record.levelname),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": self._pid,
        }
        for key, value in _record_fields(record).items():
            if value is not None and key not in _CORE_KEYS:
                line[key] = _bounded(value)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        exc = record.exc_text or ""
        if record.stack_info:
            exc = f"{exc}\n{self.formatStack(record.stack_info)}".lstrip("\n")
        if exc:
            line["exc"] = exc
        # default=str: a field of another type is shown, never a failed line. json
        # escapes newlines and C0 controls; C1 and U+2028/9 (line breaks to some
        # readers) are escaped too, so one record is one line to every reader.
        text = json.dumps(line, ensure_ascii=False, separators=(",", ":"), default=str)
        return escape_controls(text, in_json=True)


# -- set-up -------------------------------------------------------------------


class LogHandler(logging.StreamHandler[TextIO]):
    """The one handler: a format, the fields, the redaction."""

    def __init__(self, fmt: LogFormat, stream: TextIO | None = None) -> None:
        super().__init__(stream if stream is not None else sys.stderr)
        # Without a stream of its own it writes to whatever sys.stderr is at each
        # line: while progress bars are drawn (app/progress.py), rich puts a proxy
        # there that prints the line above the bars instead of through them.
        self._follow_stderr = stream is None
        self.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
        self.addFilter(AddFields())
        self.addFilter(RedactSecrets())

    def emit(self, record: logging.LogRecord) -> None:
        if self._follow_stderr:
            self.stream = sys.stderr
        super().emit(record)


def configure_logging(level: str, fmt: LogFormat) -> None:
    """Every line of this process in one format, at ``level``, on stderr."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, LogHandler)]:
        root.removeHandler(old)  # called again (serve after an auto-reset): one handler
    root.addHandler(LogHandler(fmt))
    root.setLevel(log_level(level))
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        for old_handler in list(logger.handlers):
            logger.removeHandler(old_handler)
        logger.propagate = True
    logging.captureWarnings(True)  # warnings.warn lines, in the format too
    sys.excepthook = _log_uncaught


def _log_uncaught(
    kind: type[BaseException], error: BaseException, tb: TracebackType | None
) -> None:
    """An exception that ends the process, as a log line (zero-cache logs its
    uncaught exceptions too) rather than a bare traceback in a JSON log."""
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, error, tb)
        return
    logging.getLogger("changestreamer").critical("uncaught exception", exc_info=(kind, error, tb))


def final_line(text: str, *, command: str = "changestreamer") -> None:
    """The one line a command ends with when it fails: ``changestreamer: <text>`` on
    stderr; or, once the log is JSON, a JSON line at level ERROR from the logger
    ``command`` (dotted), so a log pipeline reads it like every other line. Redacted
    either way.
    """
    root = logging.getLogger()
    json_log = any(
        isinstance(h, LogHandler) and isinstance(h.formatter, JsonFormatter) for h in root.handlers
    )
    if json_log:
        logging.getLogger(command.replace(" ", ".")).error("%s", text)
    else:
        print(f"{command}: {redact(text)}", file=sys.stderr, flush=True)
