"""``changestreamer tail``: follow a change-streamer's transactions on stdout.

Subscribes (mode ``serving``, reconnecting after drops; see
:mod:`app.client.resume`) and prints each message (:mod:`app.client.render`: lines
of text, or a table on a terminal). The options are parsed by ``app/cli.py``.

* ``--from WATERMARK`` is the subscription watermark: output starts with the
  first transaction *after* it. It must be a stored commit watermark or the
  replica version (the server rejects anything else as WatermarkTooOld). The
  default is the replica version, i.e. everything still in the change log,
  then live transactions.
* Without ``--replica-version`` the replica version is learned first with a
  probe subscription using replica version ``00``: the server rejects it with
  ``current replica version is X (requested 00)`` and tail resubscribes with X.
* ``--limit N`` stops after N committed transactions.
* ``--discover [CHANGE_DB]`` (the view-syncers' ``ZERO_CHANGE_DB``, with
  ``--app-id`` and ``--shard-num``) finds the change-streamer through the change DB
  instead of a URL, and again at every reconnection: the tail follows the change log
  from node to node across handoffs, as a view-syncer in discover mode does.
* A refused upgrade (HTTP 401: the replication password from
  ``CHANGESTREAMER_REPLICATION_PASSWORD`` or ``--password-file`` is missing or
  wrong; 403) is not retried: one line on stderr, exit status 2, as for any other
  bad setting.

The tail is a real subscriber: it acks each message after printing it, so a
stalled pipe holds back the server's flow control and change-log purges like
a stalled view-syncer would. It uses mode ``serving`` (mode ``backup`` would
make the server reset the replica when the watermark is too old), so it also
ends the server's start-up delay.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import TextIO

from app.client.client import ChangeStreamerClient
from app.client.credentials import PasswordFileError, replication_password
from app.client.errors import ClientError, UnauthorizedError
from app.client.render import message_printer
from app.client.resume import ReconnectPolicy, ResumingSubscription
from app.client.subscription import SubscriptionContext
from app.logs import escape_controls
from app.protocol.messages import Commit
from app.storage.errors import ChangeDbConfigError
from app.storage.shard import Shard

__all__ = ["run_tail", "tail"]


async def tail(
    url: str | None,
    *,
    discover_db: str | None = None,
    shard: Shard | None = None,
    replica_version: str | None = None,
    watermark: str | None = None,
    json_output: bool = False,
    out: TextIO,
    limit: int | None = None,
    err: TextIO | None = None,
    subscriber_id: str | None = None,
    give_up_after_s: float | None = None,
    password: str | None = None,
) -> int:
    """Prints transactions until ``limit`` commits (or forever); returns the exit code.

    Errors are one line on ``err`` (default stderr) and exit code 1; a bad URL or a
    refused password (:class:`UnauthorizedError`) is 2.
    ``give_up_after_s`` bounds how long reconnecting may fail before giving up.
    With ``discover_db`` (and ``shard``) the server is looked up in that change DB,
    at every connection, instead of ``url``.
    """
    errors = err if err is not None else sys.stderr

    def client_for(base: str) -> ChangeStreamerClient:
        return ChangeStreamerClient(base, password=password)

    try:
        client = None if discover_db is not None else client_for(url or "")
    except ValueError as e:
        _say(errors, str(e))
        return 2
    name = subscriber_id or f"tail-{os.getpid()}"
    printer = message_printer(out, json_output=json_output)
    commits = 0
    try:
        if client is None:
            assert discover_db is not None
            # Here, not at the top: it brings the change DB's engine (SQLAlchemy).
            from app.client.discovery import discover, discovering

            where = shard or Shard()
            connect = discovering(discover_db, where, client_for)
            if replica_version is None:
                owner = client_for(await discover(discover_db, where))
                replica_version = await owner.probe_replica_version(f"{name}-probe")
        else:
            connect = client.subscribe
            if replica_version is None:
                replica_version = await client.probe_replica_version(f"{name}-probe")
        ctx = SubscriptionContext(name, replica_version, watermark or replica_version)
        policy = ReconnectPolicy(max_elapsed_s=give_up_after_s)
        async with ResumingSubscription(connect, ctx, policy) as subscription:
            if limit is not None and limit <= 0:
                return 0
            async for message in subscription:
                printer.write(message)
                if isinstance(message, Commit):
                    commits += 1
                    if limit is not None and commits >= limit:
                        break
    except UnauthorizedError as e:
        _say(errors, str(e))
        return 2
    except ClientError as e:
        _say(errors, str(e))
        return 1
    return 0


def _say(errors: TextIO, text: str) -> None:
    """One line on stderr; the server's words (an error's text, a close reason) with
    their control characters spelled out."""
    errors.write(f"changestreamer tail: {escape_controls(text)}\n")


def run_tail(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Runs ``tail`` for its parsed options (``app/cli.py``); the exit code."""
    try:
        password = replication_password(args.password_file)
        shard = Shard(args.app_id, args.shard_num)
    except (PasswordFileError, ChangeDbConfigError) as e:
        _say(err if err is not None else sys.stderr, str(e))
        return 2
    return asyncio.run(
        tail(
            args.url,
            discover_db=args.discover,
            shard=shard,
            replica_version=args.replica_version,
            watermark=args.watermark,
            json_output=args.json_output,
            out=out if out is not None else sys.stdout,
            limit=args.limit,
            err=err,
            subscriber_id=args.subscriber_id,
            give_up_after_s=args.give_up_after,
            password=password,
        )
    )
