"""Child process: reads the *backup's* replication state through the litestream VFS.

Run as ``python -I -m app.backup.vfs_worker EXTENSION`` with
``LITESTREAM_REPLICA_URL`` (and for S3 the AWS_* credentials) in its environment.
It needs a process of its own for two reasons: Python's ``sqlite3`` here cannot
load extensions (so it uses ``apsw``), and the extension — Go code — reads its
settings from the environment the process *started* with, so they cannot be set
from inside the service.

Protocol: for each line on stdin it writes one JSON line on stdout, either
``{"watermark": "…", "writeTimeMs": N, "txid": "…"}`` or ``{"error": "…"}``. The
connection stays open between probes; the VFS then only fetches what is new. A
line ``fresh`` opens a new connection first: a long-lived one was seen to stop
following a large backup (228 MB, under 200 transactions/s: stuck after ~40 s
while new connections saw the newer state), so the parent asks for one whenever
the last answer showed no progress. A failed read closes the connection, and the
next probe opens it again (a destination that is still empty cannot be opened
until litestream has uploaded a first snapshot).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO

QUERY = 'SELECT stateVersion, writeTimeMs, litestream_txid() FROM "_zero.replicationState"'
# A database name the VFS maps to the replica at LITESTREAM_REPLICA_URL.
DATABASE_URI = "file:zero-backup.db?vfs=litestream&mode=ro"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m app.backup.vfs_worker EXTENSION", file=sys.stderr)
        return 2
    import apsw

    # The extension logs to stdout; our replies need it to themselves. Keep a
    # private copy of stdout for them and point fd 1 at stderr.
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    loader = apsw.Connection(":memory:")
    loader.enable_load_extension(True)
    try:
        loader.load_extension(argv[1])
    except apsw.Error as e:
        _reply(replies, {"error": f"cannot load the litestream VFS extension {argv[1]}: {e}"})
        return 1
    db: Any = None
    for line in sys.stdin:
        if line.strip() == "fresh" and db is not None:
            db.close()
            db = None
        try:
            if db is None:
                db = apsw.Connection(
                    DATABASE_URI, flags=apsw.SQLITE_OPEN_READONLY | apsw.SQLITE_OPEN_URI
                )
            rows = list(db.execute(QUERY))
            if not rows:
                raise LookupError("the backup has no _zero.replicationState row")
            watermark, write_time_ms, txid = rows[0]
            _reply(replies, {"watermark": watermark, "writeTimeMs": write_time_ms, "txid": txid})
        except (apsw.Error, LookupError) as e:
            if db is not None:
                db.close()
                db = None
            _reply(replies, {"error": f"{type(e).__name__}: {e}"})
    return 0


def _reply(out: TextIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
