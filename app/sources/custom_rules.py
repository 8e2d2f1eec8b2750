"""The rules a custom change source must keep (spec/source.md §1.6, §1.7, §1.8, §2.4).

The message parser already refuses a watermark that is not a LexiVersion
(``major`` or ``major.minor``); :class:`StreamRules` checks what one message alone
cannot show, in stream order:

* a transaction's commit watermark (known at its ``begin``) is greater than the
  ``lastWatermark`` the stream was started with and than the previous commit of the
  stream — the change log's key is the commit watermark, so a repeated or older one
  would collide with a stored transaction or break the subscribers' resume order;
* ``commit`` carries its ``begin``'s commit watermark;
* status and commit watermarks together never go backwards (a status is a position
  "the log has reached here"; what follows it cannot be behind it);
* ``create-table`` / ``add-column`` carry no ``backfill`` field: custom sources
  cannot be asked for backfills on restart (they refuse backfill requests), so a
  column announced as "filled later" would stay hidden in the replica for good;
* every column default (``dflt``) of a ``create-table`` / ``add-column`` is a literal
  the replica accepts (:func:`app.replica.ddl.map_default`, the one rule: a number,
  ``true``/``false``, a quoted string with a ``::type`` cast, an empty array, or
  none). The replica splices an added column's default into SQLite DDL, and so
  does every zero-cache that replicates from this change log: anything else could
  carry SQL in (issue 25), so it is refused before it is stored;
* schema changes the replica could never apply (its writer would fail on them, or on
  every row after them, and the replica follower would restart into the same failure
  for good) are refused:

  - a table or index whose replica name (:func:`app.replica.ddl.lite_table_name`) is
    one the replica keeps for other tables: names ``LIKE`` ``'sqlite_%'``,
    ``'_zero.%'`` or ``'_litestream_%'`` (SQL ``LIKE``: ``_`` is any character, ASCII
    case ignored) are not data tables to the replica (``app.replica.catalog``), so
    such a table is created but its rows fail as "unknown table" — or SQLite refuses
    the name, or it is one of the replica's own tables. Covers ``create-table``,
    ``rename-table`` (its new name) and ``create-index`` (indexes share the tables'
    namespace);
  - a column named like the replica's own ``_0_version`` (SQLite column names ignore
    ASCII case): in ``create-table`` / ``add-column`` / ``update-column`` (either
    name) / ``drop-column``; and a ``create-table`` with two columns whose names
    differ only in ASCII case (SQLite: "duplicate column name");
  - a table of more columns than SQLite allows (``SQLITE_MAX_COLUMN``, 2000), counting
    the ``_0_version`` the replica adds: a ``create-table`` of more than 1999 columns,
    or an ``add-column`` past that to a table whose column count this stream knows
    (see :class:`StreamRules`).

Checked at ``begin`` where possible, so nothing of a transaction that breaks them is
forwarded. The Postgres source derives its watermarks from commit LSNs, which keep
these rules by construction; only the custom source checks them.

Framing errors (``data`` or ``commit`` outside a transaction, ``begin`` inside one)
are the service's to detect (``app/streamer/service.py``); these rules ignore them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Mapping
from typing import Any, Final

from app.protocol.messages import Begin, ChangeSourceMessage, Commit, Data, Rollback, Status
from app.replica.ddl import ZERO_VERSION_COLUMN, lite_table_name, map_default, shown_default
from app.replica.errors import UnsupportedColumnDefaultError

__all__ = ["MAX_KNOWN_TABLES", "MAX_SOURCE_COLUMNS", "SQLITE_MAX_COLUMNS", "StreamRules"]

# Schema changes that may name columns to backfill and carry column defaults
# (spec/source.md §1.6).
_BACKFILL_TAGS: Final = frozenset({"create-table", "add-column"})

# SQLite's SQLITE_MAX_COLUMN, the most columns a table may have ("too many columns on
# t"): the default, which the replica's SQLite here reports
# (``getlimit(SQLITE_LIMIT_COLUMN)``).
SQLITE_MAX_COLUMNS: Final = 2000
# The columns the replica adds to every table of its own (app.replica.ddl).
_REPLICA_COLUMNS: Final = (ZERO_VERSION_COLUMN,)
# The most columns a source's table may have in the replica.
MAX_SOURCE_COLUMNS: Final = SQLITE_MAX_COLUMNS - len(_REPLICA_COLUMNS)
# The replica's `_0_version` as SQLite compares column names (ASCII case ignored).
_RESERVED_COLUMNS: Final = frozenset(c.lower() for c in _REPLICA_COLUMNS)
_ASCII_LOWER: Final = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")

# Names that are not the source's to use: the replica's catalog leaves them out
# (``NOT LIKE`` each pattern, where "_" is any one character and ASCII case is
# ignored; app.replica.catalog). Each: the pattern as a regex matched at the start of
# the name, the LIKE pattern, and whose tables they are.
_LIKE: Final = re.ASCII | re.IGNORECASE | re.DOTALL
_RESERVED_NAMES: Final = (
    (re.compile(r"sqlite.", _LIKE), "sqlite_%", "SQLite's internal tables"),
    (re.compile(r".zero\.", _LIKE), "_zero.%", "the replica's own tables"),
    (re.compile(r".litestream.", _LIKE), "_litestream_%", "litestream's tables"),
)
# The schema changes that give a table or an index a name, and the body field holding it.
_NAMING_FIELDS: Final = {"create-table": "spec", "rename-table": "new", "create-index": "spec"}

# At most this many tables' column counts are remembered per stream (the oldest is
# forgotten first): a 16-byte digest of the name and a small int each, about 150
# bytes, so at most ~1.5 MB however long the names or many the tables.
MAX_KNOWN_TABLES: Final = 10_000


class StreamRules:
    """Checks one stream's messages in order; ``check`` returns the broken rule or None.

    The text completes "custom change source … sent …" (the stream's error line).
    ``after_watermark`` is the stream's ``lastWatermark`` (None for an initial sync).

    Column counts: the rules know a table's count only from this stream's own
    ``create-table`` of it (then ``add-column`` / ``drop-column`` / ``rename-table`` /
    ``drop-table`` keep it up to date). A table created before the stream started has
    an unknown count and its ``add-column`` is accepted: the replica is another
    process's file (the follower's), and the change log holds no column counts, so
    nothing here could tell without reading SQLite per message; and a count
    that is only ever counted up from what was seen is never too high, so a valid
    ``add-column`` is never refused. Anything uncertain forgets the count (rather
    than guess): a rollback of a transaction that changed the schema forgets them
    all, and past :data:`MAX_KNOWN_TABLES` the oldest is forgotten.
    """

    def __init__(self, after_watermark: str | None) -> None:
        self._after = after_watermark
        self._last_commit: str | None = None
        # The newest commit or status watermark: the stream's reported position.
        self._position: str | None = None
        self._position_kind = ""
        self._open: str | None = None  # the open transaction's commit watermark
        # Digest of a replica table name → its source columns (see the class docstring).
        self._columns: dict[bytes, int] = {}
        self._open_changed_counts = False  # the open transaction changed self._columns

    def check(self, message: ChangeSourceMessage) -> str | None:
        kind = type(message)
        if kind is Data:
            assert isinstance(message, Data)
            return (
                _backfill_problem(message)
                or _default_problem(message)
                or _reserved_name_problem(message)
                or _reserved_column_problem(message)
                or _same_column_problem(message)
                or self._column_count(message)
            )
        if kind is Begin:
            assert isinstance(message, Begin)
            return self._begin(message.commit_watermark)
        if kind is Commit:
            assert isinstance(message, Commit)
            return self._commit(message.watermark)
        if kind is Status:
            assert isinstance(message, Status)
            return self._status(message.watermark)
        if kind is Rollback:
            self._open = None  # its watermark was never committed: it may come again
            if self._open_changed_counts:
                self._columns.clear()  # the counts before it are not kept: unknown
        return None

    def _begin(self, watermark: str) -> str | None:
        if self._after is not None and watermark <= self._after:
            return (
                f"a begin with commitWatermark {watermark}, not after lastWatermark "
                f"{self._after} the stream was started with (it is stored already)"
            )
        if self._last_commit is not None and watermark <= self._last_commit:
            return (
                f"a begin with commitWatermark {watermark}, not after the previous commit "
                f"{self._last_commit} (commit watermarks must strictly increase)"
            )
        if self._position is not None and watermark < self._position:
            return (
                f"a begin with commitWatermark {watermark}, behind the {self._position_kind} "
                f"watermark {self._position} sent before it (watermarks never go backwards)"
            )
        self._open = watermark
        self._open_changed_counts = False
        return None

    def _commit(self, watermark: str) -> str | None:
        open_tx, self._open = self._open, None
        if open_tx is None:
            return None  # no begin: the service's framing check says so
        if watermark != open_tx:
            return f"a commit with watermark {watermark}, not its begin's commitWatermark {open_tx}"
        self._last_commit = watermark
        self._advance(watermark, "commit")
        return None

    def _status(self, watermark: str) -> str | None:
        if self._position is not None and watermark < self._position:
            return (
                f"a status with watermark {watermark}, behind the {self._position_kind} "
                f"watermark {self._position} sent before it (watermarks never go backwards)"
            )
        self._advance(watermark, "status")
        return None

    def _advance(self, watermark: str, kind: str) -> None:
        self._position = watermark
        self._position_kind = kind

    def _column_count(self, message: Data) -> str | None:
        """Keeps the known column counts; refuses a table wider than SQLite allows."""
        tag, body = message.tag, message.body
        if tag == "create-table":
            spec = body["spec"]
            count = len(spec["columns"])
            if count > MAX_SOURCE_COLUMNS:
                return _too_many_columns(message, f"with {count}", count)
            self._remember(_table_key(spec), count)
        elif tag == "add-column":
            key = _table_key(body["table"])
            known = self._columns.get(key)
            if known is None:
                return None  # created before this stream, or forgotten: accepted
            if known + 1 > MAX_SOURCE_COLUMNS:
                return _too_many_columns(message, f"that would give it {known + 1}", known + 1)
            self._remember(key, known + 1)
        elif tag == "drop-column":
            key = _table_key(body["table"])
            known = self._columns.get(key)
            if known is None:
                return None
            self._remember(key, max(known - 1, 0))
        elif tag == "rename-table":
            known = self._columns.pop(_table_key(body["old"]), None)
            new = _table_key(body["new"])
            if known is None:
                self._columns.pop(new, None)
            else:
                self._remember(new, known)
        elif tag == "drop-table":
            self._columns.pop(_table_key(body["id"]), None)
        else:
            return None
        self._open_changed_counts = True
        return None

    def _remember(self, key: bytes, count: int) -> None:
        if key not in self._columns and len(self._columns) >= MAX_KNOWN_TABLES:
            del self._columns[next(iter(self._columns))]  # the oldest: unknown from now on
        self._columns[key] = count


def _backfill_problem(message: Data) -> str | None:
    if message.tag not in _BACKFILL_TAGS or "backfill" not in message.body:
        return None
    return (
        f"{_schema_change(message)} with a 'backfill' field "
        "(custom change sources cannot backfill: leave it out and send the rows)"
    )


def _default_problem(message: Data) -> str | None:
    """A column default that is not a literal the replica accepts, named with its column."""
    if message.tag not in _BACKFILL_TAGS:
        return None
    body = message.body  # its shape is checked already (app.protocol.changes)
    if message.tag == "create-table":
        table, columns = body["spec"], body["spec"]["columns"].items()
    else:
        table, columns = body["table"], [(body["column"]["name"], body["column"]["spec"])]
    for column, spec in columns:
        dflt = spec.get("dflt")
        try:
            map_default(lite_table_name(table["schema"], table["name"]), column, dflt)
        except UnsupportedColumnDefaultError:
            return (
                f"{_schema_change(message)} whose column {column} has the default "
                f"{shown_default(dflt)}, not a literal (a column default must be a number, "
                "true, false, a quoted string with a ::type cast such as 'x'::text, an empty "
                "array, or null)"
            )
    return None


def _reserved_name_problem(message: Data) -> str | None:
    """A table or index the replica would give a name it keeps for other tables."""
    field = _NAMING_FIELDS.get(message.tag)
    if field is None:
        return None
    name = message.body[field]
    lite = lite_table_name(name["schema"], name["name"])
    for pattern, like, owner in _RESERVED_NAMES:
        if pattern.match(lite):
            prefix = like[:-1]
            names = (
                f"names starting with '{prefix}'"
                if lite.startswith(prefix)
                else f"names LIKE '{like}' (where '_' is any character and case is ignored)"
            )
            return (
                f"{_schema_change(message)}: the replica would name it {_shown(lite)}, and "
                f"{names} are reserved for {owner}"
            )
    return None


def _reserved_column_problem(message: Data) -> str | None:
    """A column named like one the replica adds to every table (``_0_version``)."""
    for column in _column_names(message):
        if column.translate(_ASCII_LOWER) in _RESERVED_COLUMNS:
            return (
                f"{_schema_change(message)} naming the column {_shown(column)}: that is the "
                f"replica's own column {ZERO_VERSION_COLUMN} (the row version, in every table; "
                "SQLite ignores case in column names), not the source's"
            )
    return None


def _same_column_problem(message: Data) -> str | None:
    """A ``create-table`` whose columns include two SQLite would take for one."""
    if message.tag != "create-table":
        return None
    seen: dict[str, str] = {}
    for column in message.body["spec"]["columns"]:
        folded = column.translate(_ASCII_LOWER)
        other = seen.setdefault(folded, column)
        if other != column:
            return (
                f"{_schema_change(message)} with the columns {_shown(other)} and "
                f"{_shown(column)}: SQLite column names ignore case, so they would be one "
                "(duplicate column name)"
            )
    return None


def _column_names(message: Data) -> Iterator[str]:
    """The column names a schema change creates, changes or drops."""
    body = message.body
    if message.tag == "create-table":
        yield from body["spec"]["columns"]
    elif message.tag == "add-column":
        yield body["column"]["name"]
    elif message.tag == "update-column":
        yield body["old"]["name"]
        yield body["new"]["name"]
    elif message.tag == "drop-column":
        yield body["column"]


def _too_many_columns(message: Data, which: str, count: int) -> str:
    """``count``: the source's columns the table would have."""
    return (
        f"{_schema_change(message)} {which} columns: with the replica's own "
        f"{ZERO_VERSION_COLUMN} the table would have {count + len(_REPLICA_COLUMNS)}, and "
        f"SQLite allows at most {SQLITE_MAX_COLUMNS} (so at most {MAX_SOURCE_COLUMNS} from "
        "the source)"
    )


def _table_key(table: Mapping[str, Any]) -> bytes:
    """A fixed-size key for the replica table an identifier names (its name may be long)."""
    name = lite_table_name(table["schema"], table["name"])
    return hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=16).digest()


# The body field that names the table (or index) each schema change is about.
_SUBJECT_FIELDS: Final = {
    "create-table": "spec",
    "create-index": "spec",
    "rename-table": "old",
    "drop-table": "id",
    "drop-index": "id",
}


def _schema_change(message: Data) -> str:
    """``a create-table of public.t`` / ``an add-column of public.t`` /
    ``a rename-table of public.t to public.u``."""
    body = message.body
    subject: Any = body.get(_SUBJECT_FIELDS.get(message.tag, "table"))
    article = "an" if message.tag[:1] in ("a", "e", "i", "o", "u") else "a"
    out = f"{article} {message.tag} of {_qualified(subject)}"
    if message.tag == "rename-table":
        out += f" to {_qualified(body.get('new'))}"
    return out


def _qualified(name: Any) -> str:
    """``schema.name`` of an identifier, for one line."""
    if not isinstance(name, Mapping):
        return "a table"
    return _shown(f"{name.get('schema')}.{name.get('name')}")


def _shown(name: str) -> str:
    """A name for a one-line message: as is if short and printable, else its repr, cut."""
    return shown_default(name)  # the same cut as a default's
