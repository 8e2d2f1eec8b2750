"""The runners of ``serve``, ``migrate``, ``restore`` and ``replicate``: the commands
that read the settings and put the service's parts together (``migrate`` and
``serve`` open the change DB; ``replicate`` follows a service into a replica file).

``app/cli.py`` parses the command line with nothing but argparse and imports one of
these modules only when its command runs, so ``changestreamer --help`` loads none of
the service. The client commands' runners, which use nothing but their client,
live beside it (``app/client/tail.py``, ``app/client/status.py``).

A runner stops with :class:`CommandError`: ``app/cli.py`` prints its one line as
``changestreamer: <message>`` on stderr and exits with its code.
"""

from __future__ import annotations

__all__ = ["CommandError"]


class CommandError(Exception):
    """The command cannot go on; the message is one line, ``code`` the exit status
    (2: the settings, 1: the change DB, the upstream or the backup)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code
