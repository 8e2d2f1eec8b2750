"""The interface every upstream change source implements.

A source is started once per upstream connection with the watermark the change
log is durable at; it yields validated change-source messages (begin, data,
commit, rollback, status, control) and takes upstream acks. The service owns the
stream: it reads it, acks through it, and closes it when the connection is done
(or broken), then starts a new one from the durable watermark.

Rules a source must follow (spec/source.md §1.2, §2.4, §3):

* transactions arrive whole and in commit order; commit watermarks strictly
  increase and are greater than ``after_watermark``;
* a stream may end or fail at any point, also mid-transaction; the service then
  drops the partial transaction and starts a new stream, so the source must be
  able to send it again;
* ``ack`` never blocks; a source may coalesce pending acks (only the newest one
  matters, acks are monotonic).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from app.protocol.messages import ChangeSourceMessage

# One entry per table with pending backfills (spec/core.md §5.2):
# {"table": {"schema", "name", "metadata"}, "columns": {column: backfill_id}}
BackfillRequest = dict[str, Any]


@dataclass(frozen=True, slots=True)
class SourceMetric:
    """A metric a source adds to ``/metrics`` (read on scrape): its samples are
    (labels, value) pairs."""

    name: str
    type: Literal["gauge", "counter"]
    help: str
    samples: Sequence[tuple[Mapping[str, str], float]]


class ChangeSourceError(Exception):
    """A source-side failure worth a retry (network, upstream restart, bad frame)."""


class ChangeStream(abc.ABC):
    """One upstream connection: an async iterator of messages plus an ack sink."""

    @abc.abstractmethod
    def __aiter__(self) -> AsyncIterator[ChangeSourceMessage]:
        """The messages, until the connection ends (StopAsyncIteration) or fails (raises)."""

    @abc.abstractmethod
    def ack(self, status: list[Any]) -> None:
        """Queues an upstream ack: ``["status", <commit or status body>, {"watermark": W}]``."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Ends the connection; pending iteration stops. Safe to call more than once."""


class ChangeSource(abc.ABC):
    """Starts upstream connections."""

    upstream_type = "unknown"

    @abc.abstractmethod
    async def start_stream(
        self, after_watermark: str, backfill_requests: list[BackfillRequest]
    ) -> ChangeStream:
        """Connects and returns the stream of transactions committed after ``after_watermark``."""

    async def stop(self) -> None:  # noqa: B027 - most sources hold nothing between streams
        """Releases whatever the source holds between streams."""

    async def stats(self) -> dict[str, Any]:
        """What ``/statz``'s ``upstream`` group shows of this source."""
        return {"type": self.upstream_type}

    async def metrics(self) -> list[SourceMetric]:
        """What ``/metrics`` shows of this source; read on scrape, so it must be
        bounded and cheap (cache what costs a query)."""
        return []

    def start_lag_reporter(self) -> dict[str, Any] | None:
        """Starts lag reports if the source has them; returns the first ``{"nextSendTimeMs"}``."""
        return None
