"""Reading ``/metrics`` as a scraper does (prometheus-client's parser), and the
transactions the metrics tests push through a memory source."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests import waiting

from .http import http_get


@dataclass
class Family:
    type: str
    help: str
    samples: list[Sample]


Scrape = dict[str, Family]


async def scrape(url: str) -> Scrape:
    """``/metrics`` by family (a counter's named without ``_total``, as the parser has it)."""
    reply = await http_get(url + "/metrics")
    assert reply.status == 200
    assert reply.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    return {
        f.name: Family(f.type, f.documentation, list(f.samples))
        for f in text_string_to_metric_families(reply.text)
    }


def value(families: Scrape, name: str, **labels: str) -> float:
    """The value of the sample ``name`` (a counter's with ``_total``, a histogram's
    ``_count``…) with ``labels``."""
    for family in families.values():
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    raise AssertionError(f"no sample {name}{labels}")


@dataclass
class Histo:
    buckets: list[tuple[float, float]]  # (le, cumulative count)
    sum: float
    count: float


def histogram(families: Scrape, name: str, **labels: str) -> Histo:
    """One histogram of a scrape, checked for what every histogram must be."""
    family = families[name]
    assert family.type == "histogram"
    buckets = sorted(
        (float(s.labels["le"]), s.value)
        for s in family.samples
        if s.name == name + "_bucket" and {k: v for k, v in s.labels.items() if k != "le"} == labels
    )
    counts = [n for _, n in buckets]
    assert buckets
    assert buckets[-1][0] == math.inf
    assert counts == sorted(counts), f"{name}: buckets not monotonic: {buckets}"
    count = value(families, name + "_count", **labels)
    assert counts[-1] == count
    return Histo(buckets, value(families, name + "_sum", **labels), count)


async def eventually(
    url: str, condition: Callable[[Scrape], bool], what: str, timeout_s: float = 10
) -> Scrape:
    """Scrapes until ``condition`` holds for a scrape (bounded); returns that scrape."""

    async def holding() -> tuple[Scrape] | None:
        families = await scrape(url)
        return (families,) if condition(families) else None

    found: tuple[Scrape] = await waiting.eventually(holding, what, timeout_s, poll_s=0.02)
    return found[0]


def txn(w: str, n: int, *, commit_ms: float | None = None, pad: int = 0) -> list[list[Any]]:
    rows: list[list[Any]] = [
        [
            "data",
            {
                "tag": "insert",
                "relation": {"schema": "public", "name": "t", "rowKey": {"columns": ["id"]}},
                "new": {"id": i, "pad": "x" * pad},
            },
        ]
        for i in range(n)
    ]
    commit: dict[str, Any] = {"tag": "commit"}
    if commit_ms is not None:
        commit["commitTimeMs"] = commit_ms
    return [
        ["begin", {"tag": "begin"}, {"commitWatermark": w}],
        *rows,
        ["commit", commit, {"watermark": w}],
    ]


# The service's families while it streams, before any lag report or backup, named
# as the parser names them (a counter's without ``_total``).
EXPECTED = {
    "changestreamer_running": "gauge",
    "changestreamer_subscribers": "gauge",
    "changestreamer_event_loop_lag_seconds": "gauge",
    "changestreamer_subscriber_backlog_bytes": "gauge",
    "changestreamer_subscriber_max_backlog_bytes": "gauge",
    "changestreamer_subscriber_backlog_messages": "gauge",
    "changestreamer_subscriber_pending_messages": "gauge",
    "changestreamer_storer_queued_bytes": "gauge",
    "changestreamer_flow_control_waits": "counter",
    "changestreamer_flow_control_wait_seconds": "counter",
    "changestreamer_flow_control_wait_duration_seconds": "histogram",
    "changestreamer_transactions": "counter",
    "changestreamer_changes": "counter",
    "changestreamer_commit_forward_latency_seconds": "histogram",
    "changestreamer_change_log_group_commit_rows": "histogram",
    "changestreamer_catchup_duration_seconds": "histogram",
    "changestreamer_change_log_rows": "gauge",
    "changestreamer_change_log_bytes": "gauge",
    "changestreamer_backup_wedged": "gauge",
    "changestreamer_snapshot_reservations_open": "gauge",
    "changestreamer_change_log_purged_rows": "counter",
}
