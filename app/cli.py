"""The ``changestreamer`` command line: every subcommand's options, and the dispatch.

Parsing needs argparse and nothing of the service, so ``changestreamer --help`` and
``--version`` answer at once; a subcommand imports its machinery when it runs:
``serve``, ``migrate`` and ``restore`` from :mod:`app.commands`, ``tail`` and
``status`` from :mod:`app.client`, ``replicate`` from :mod:`app.commands.replicate`.

Exit status: 0 done; 2 bad settings or arguments, 1 an unusable database, upstream
or backup, each with one line on stderr (``app.logs.final_line``: a JSON line when the
log is JSON); 130 interrupted (Ctrl-C), quietly.
``replicate`` adds 3: its replica must be synced (or restored) again.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

# First: every module below picks its C helper or twin as it is imported, so a bad
# CHANGESTREAMER_SPEEDUPS stops here with one line, like any bad setting.
try:
    from app import speedups  # noqa: F401 - imported for its check
except ValueError as e:  # speedups.SpeedupsSettingError
    print(f"changestreamer: {e}", file=sys.stderr)
    raise SystemExit(2) from None

from app.commands import CommandError
from app.logs import final_line, log_level
from app.versions import MAX_PROTOCOL_VERSION, MIN_PROTOCOL_VERSION

__all__ = ["build_parser", "main", "version_text"]

INTERRUPTED = 128 + signal.SIGINT  # the shell's status for a command ended by Ctrl-C


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "discover", None) == "":
        parser.error("--discover needs a change DB: name one, or set ZERO_CHANGE_DB")
    try:
        return _run(args)
    except CommandError as e:
        final_line(str(e))
        return e.code
    except KeyboardInterrupt:  # whatever was running has been cancelled and closed
        return INTERRUPTED


def _run(args: argparse.Namespace) -> int:
    """Imports the command's runner and runs it."""
    if args.command == "serve":
        from app.commands.serve import run_serve

        return run_serve(args)
    if args.command == "migrate":
        from app.commands.migrate import run_migrate

        return run_migrate(args)
    if args.command == "restore":
        from app.commands.restore import run_restore

        return run_restore(args)
    # The client commands need no settings or change DB (they may run on another host).
    if args.command == "tail":
        from app.client.tail import run_tail

        return run_tail(args)
    if args.command == "status":
        from app.client.status import run_status

        return run_status(args)
    assert args.command == "replicate", args.command
    from app.commands.replicate import run_replicate

    return run_replicate(args)


def version_text() -> str:
    """``changestreamer <version>`` (the installed package's) and the protocols it speaks."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("changestreamer")
    except PackageNotFoundError:  # run from a source tree that was never installed
        installed = "(not installed)"
    return (
        f"changestreamer {installed}\n"
        f"zero replication protocol v{MIN_PROTOCOL_VERSION}–v{MAX_PROTOCOL_VERSION}"
    )


class _VersionAction(argparse.Action):
    """``--version``: the metadata is read only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="changestreamer",
        description="A change-streamer, wire-compatible with Rocicorp Zero's.",
    )
    parser.add_argument(
        "--version", action=_VersionAction, help="print the version and the protocols, and exit"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="migrate the change DB and run the service")
    serve.add_argument("--port", type=int, help="listen port (default ZERO_CHANGE_STREAMER_PORT)")
    serve.add_argument("--host", help="listen address (default ZERO_CHANGE_STREAMER_HOST)")
    commands.add_parser("migrate", help="bring the change DB to this version's schema and exit")
    _add_tail_arguments(
        commands.add_parser("tail", help="print a change-streamer's transactions as they stream")
    )
    _add_status_arguments(commands.add_parser("status", help="print a change-streamer's /statz"))
    _add_replicate_arguments(
        commands.add_parser(
            "replicate",
            help="keep a replica file current from a change-streamer (restored from its "
            "backup first if missing)",
        )
    )
    _add_restore_arguments(
        commands.add_parser(
            "restore", help="restore a replica file from its litestream backup and exit"
        )
    )
    return parser


# -- the subcommands' options ------------------------------------------------------


def _server_url(parser: argparse.ArgumentParser, default: str, what: str) -> None:
    parser.add_argument(
        "url",
        nargs="?",
        default=os.environ.get("ZERO_CHANGE_STREAMER_URI") or default,
        help=f"{what} (default ZERO_CHANGE_STREAMER_URI or {default})",
    )


def _add_tail_arguments(parser: argparse.ArgumentParser) -> None:
    _server_url(parser, "ws://localhost:4849", "change-streamer URI, ws:// or http(s)://")
    _discover_arguments(parser)
    parser.add_argument(
        "--from",
        dest="watermark",
        metavar="WATERMARK",
        help="start after this commit watermark (default: the replica version, i.e. the "
        "whole change log)",
    )
    parser.add_argument(
        "--replica-version", help="the server's replica version (default: ask the server)"
    )
    parser.add_argument(
        "--json",
        dest="json_output",
        action="store_true",
        help="print each message as one line of canonical JSON",
    )
    parser.add_argument(
        "--limit", type=_positive_int, metavar="N", help="exit after N transactions"
    )
    parser.add_argument("--id", dest="subscriber_id", help="subscriber id (default tail-<pid>)")
    parser.add_argument(
        "--give-up-after",
        type=_seconds,
        metavar="SECONDS",
        help="exit when reconnecting keeps failing this long (default: retry forever)",
    )
    _replication_password_file(parser)


def _discover_arguments(parser: argparse.ArgumentParser) -> None:
    """``--discover``: the change-streamer found through the change DB, as zero's
    view-syncers in discover mode find it (``replicationState.ownerAddress``), and
    found again after every handoff."""
    parser.add_argument(
        "--discover",
        nargs="?",
        const=os.environ.get("ZERO_CHANGE_DB") or "",
        metavar="CHANGE_DB",
        help="find the change-streamer through this change DB (a postgres:// URL or a "
        "SQLite file; default ZERO_CHANGE_DB) instead of the URI, and follow the change "
        "log to whichever node owns it",
    )
    parser.add_argument(
        "--app-id",
        default=os.environ.get("ZERO_APP_ID") or "zero",
        help="with --discover: the app (default ZERO_APP_ID or zero)",
    )
    parser.add_argument(
        "--shard-num",
        type=int,
        # A string: argparse converts it (and says so when it is not a number) only
        # when this command runs.
        default=os.environ.get("ZERO_SHARD_NUM") or "0",
        help="with --discover: the shard (default ZERO_SHARD_NUM or 0)",
    )


def _replication_password_file(parser: argparse.ArgumentParser) -> None:
    # As for status: never the password itself on the command line.
    parser.add_argument(
        "--password-file",
        type=Path,
        help="a file holding the replication password, for a server with "
        "CHANGESTREAMER_REPLICATION_PASSWORD (default: that variable)",
    )


def _add_status_arguments(parser: argparse.ArgumentParser) -> None:
    _server_url(parser, "http://localhost:4849", "server URI, http(s):// or ws(s)://")
    _discover_arguments(parser)
    # The password never on the command line, where every local user's ps sees it:
    # ZERO_ADMIN_PASSWORD, a file, or a prompt on a terminal (app/client/status.py).
    parser.add_argument(
        "--password-file",
        type=Path,
        help="a file holding the admin password (default: ZERO_ADMIN_PASSWORD, "
        "else a prompt on a terminal if the server asks for one)",
    )
    parser.add_argument("--password", help=argparse.SUPPRESS)  # deprecated: warns


def _add_replicate_arguments(parser: argparse.ArgumentParser) -> None:
    _server_url(parser, "ws://127.0.0.1:4849", "change-streamer URI")
    _discover_arguments(parser)
    parser.add_argument(
        "--replica",
        required=True,
        type=Path,
        help="the replica file to keep current; when it does not exist it is restored "
        "from the change-streamer's backup (under a snapshot reservation) first",
    )
    parser.add_argument(
        "--backup-url",
        help="restore a missing replica from this backup (file:// or s3://) instead of "
        "the one the change-streamer names",
    )
    parser.add_argument(
        "--id", dest="subscriber_id", help="subscriber id (default replicate-<pid>)"
    )
    _replication_password_file(parser)
    parser.add_argument(
        "--task-id",
        help="the task whose snapshot reservation this subscription ends (after a restore)",
    )
    parser.add_argument(
        "--protocol-version",
        type=int,
        choices=(6, 7),
        default=6,
        help="6: /replication/v6/changes, one message a frame; 7: /subscribe, batch frames",
    )
    # zero-cache's variables, as serve reads them; a flag wins (this command takes no
    # settings file: it may run on another host).
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default=os.environ.get("ZERO_LOG_LEVEL") or "info",
        help="debug, info, warn or error (default ZERO_LOG_LEVEL or info)",
    )
    parser.add_argument(
        "--log-format",
        type=_log_format,
        default=os.environ.get("ZERO_LOG_FORMAT") or "text",
        help="text or json (default ZERO_LOG_FORMAT or text)",
    )


def _add_restore_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backup-url", help="the backup (file:// or s3://; default ZERO_LITESTREAM_BACKUP_URL)"
    )
    parser.add_argument(
        "--replica", type=Path, help="the replica file to write (default ZERO_REPLICA_FILE)"
    )
    parser.add_argument("--replica-version", help="refuse a backup of another replica version")
    parser.add_argument(
        "--force", action="store_true", help="replace the replica file if it exists"
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _log_level(value: str) -> str:
    try:
        log_level(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _log_format(value: str) -> str:
    if value not in ("text", "json"):
        raise argparse.ArgumentTypeError(f"unknown log format {value!r}: use text or json")
    return value


if __name__ == "__main__":
    sys.exit(main())
