"""Grouped commits: several upstream transactions, one SQLite commit (savepoints inside)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.protocol.messages import Begin, Commit, Data
from app.replica.errors import ReplicaError
from app.replica.replicator import Replicator
from app.replica.schema import read_replica_state
from app.replica.writer import ReplicaWriter

from .conftest import apply_tx, create_index, create_table, insert, rows


@pytest.fixture
def with_foo(writer: ReplicaWriter) -> ReplicaWriter:
    apply_tx(writer, "02", create_table(), create_index())
    return writer


def grouped(w: ReplicaWriter, watermark: str, *changes: dict[str, object]) -> None:
    w.begin(watermark, {"tag": "begin"})
    for change in changes:
        w.apply(change)
    w.commit(watermark, {"tag": "commit"}, flush=False)


def test_a_group_reaches_the_file_at_flush(with_foo: ReplicaWriter, replica: Path) -> None:
    grouped(with_foo, "03", insert({"id": 1, "name": "a"}))
    grouped(with_foo, "04", insert({"id": 2, "name": "b"}))
    assert with_foo.state_version == "04"
    assert with_foo.durable_version == "02"
    assert rows(replica, "SELECT id FROM foo") == []  # another connection sees nothing yet
    with_foo.flush()
    assert with_foo.durable_version == "04"
    assert rows(replica, "SELECT id, _0_version FROM foo ORDER BY id") == [(1, "03"), (2, "04")]
    assert read_replica_state(replica).state_version == "04"


def test_a_failure_in_a_group_rolls_back_only_that_transaction(
    with_foo: ReplicaWriter, replica: Path
) -> None:
    grouped(with_foo, "03", insert({"id": 1, "name": "a"}))
    with_foo.begin("04", {"tag": "begin"})
    with_foo.apply(insert({"id": 2, "name": "b"}))
    with pytest.raises(ReplicaError, match="unknown table"):
        with_foo.apply(insert({"id": 3}, table="nope"))
    assert with_foo.state_version == "03"
    grouped(with_foo, "05", insert({"id": 5, "name": "e"}))
    with_foo.flush()
    assert rows(replica, "SELECT id, _0_version FROM foo ORDER BY id") == [(1, "03"), (5, "05")]
    assert read_replica_state(replica).state_version == "05"


def test_closing_writes_a_pending_group(with_foo: ReplicaWriter, replica: Path) -> None:
    grouped(with_foo, "03", insert({"id": 1, "name": "a"}))
    with_foo.close()
    assert read_replica_state(replica).state_version == "03"


def test_flush_inside_a_transaction_is_refused(with_foo: ReplicaWriter) -> None:
    with_foo.begin("03", {"tag": "begin"})
    with pytest.raises(ReplicaError, match="flush while transaction 03 is open"):
        with_foo.flush()


def tx(watermark: str, *changes: dict[str, object]) -> list[Begin | Data | Commit]:
    return [
        Begin({"tag": "begin"}, watermark, False),
        *(Data(c, str(c["tag"])) for c in changes),
        Commit({"tag": "commit"}, watermark),
    ]


async def test_a_batch_ending_mid_transaction_leaves_its_commits_durable(replica: Path) -> None:
    async with Replicator(replica, mode="backup") as r:
        await r.apply_batch([*tx("02", create_table(), create_index())])
        first = [*tx("03", insert({"id": 1, "name": "a"})), *tx("04", insert({"id": 2}))[:2]]
        results = await r.apply_batch(first)
        assert [c.watermark for c in results] == ["03"]
        # 03 is on disk although 04 is still open in the writer.
        assert read_replica_state(replica).state_version == "03"
        assert r.writer.in_transaction
        results = await r.apply_batch([Commit({"tag": "commit"}, "04")])
        assert [c.watermark for c in results] == ["04"]
    assert rows(replica, "SELECT id FROM foo ORDER BY id") == [(1,), (2,)]
    assert read_replica_state(replica).state_version == "04"


def state_writes(w: ReplicaWriter) -> list[str]:
    """The statements that move the replica's state version, as the writer runs them."""
    seen: list[str] = []
    w._conn.set_trace_callback(
        lambda sql: seen.append(sql) if '"_zero.replicationState"' in sql else None
    )
    return seen


def test_a_group_writes_its_state_version_once(with_foo: ReplicaWriter, replica: Path) -> None:
    seen = state_writes(with_foo)
    for i in range(3, 8):
        grouped(with_foo, f"0{i}", insert({"id": i, "name": "x"}))
    assert seen == []  # nothing yet: the group is not written
    with_foo.flush()
    assert len(seen) == 1
    assert read_replica_state(replica).state_version == "07"
    apply_tx(with_foo, "08", insert({"id": 8}))  # an ungrouped commit writes its own
    assert len(seen) == 2
    assert read_replica_state(replica).state_version == "08"


def test_a_group_whose_last_transaction_failed_keeps_the_one_before(
    with_foo: ReplicaWriter, replica: Path
) -> None:
    grouped(with_foo, "03", insert({"id": 1, "name": "a"}))
    grouped(with_foo, "04", insert({"id": 2, "name": "b"}))
    with_foo.begin("05", {"tag": "begin"})
    with pytest.raises(ReplicaError, match="unknown table"):
        with_foo.apply(insert({"id": 3}, table="nope"))
    with_foo.flush()
    assert read_replica_state(replica).state_version == "04"
    assert with_foo.durable_version == "04"
    assert rows(replica, "SELECT id, _0_version FROM foo ORDER BY id") == [(1, "03"), (2, "04")]


def test_a_group_ended_by_a_flushing_commit_stores_that_commit(
    with_foo: ReplicaWriter, replica: Path
) -> None:
    grouped(with_foo, "03", insert({"id": 1, "name": "a"}))
    apply_tx(with_foo, "04", insert({"id": 2, "name": "b"}))  # flush=True ends the group
    assert with_foo.durable_version == "04"
    assert read_replica_state(replica).state_version == "04"
