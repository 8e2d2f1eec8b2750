"""Files that hold every replicated row are created 0600 (``app/private_files.py``)."""

from __future__ import annotations

import sqlite3
import stat
from pathlib import Path

import pytest

from app.private_files import create_private

pytestmark = pytest.mark.usefixtures("usual_umask")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_a_new_file_is_0600_and_sqlite_gives_its_wal_the_same_mode(tmp_path: Path) -> None:
    path = tmp_path / "db"
    create_private(path)
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("CREATE TABLE t (x)")
        files = [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
        assert [mode(f) for f in files] == [0o600] * 3
    finally:
        conn.close()


def test_what_is_there_is_left_as_it_is(tmp_path: Path) -> None:
    chosen = tmp_path / "chosen"
    chosen.write_text("data")
    chosen.chmod(0o640)
    create_private(chosen)
    assert (mode(chosen), chosen.read_text()) == (0o640, "data")
    # A link is neither followed nor replaced.
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    create_private(link)
    assert link.is_symlink()
    assert not (tmp_path / "elsewhere").exists()


def test_a_file_that_cannot_be_made_is_left_to_sqlite_to_report(tmp_path: Path) -> None:
    create_private(tmp_path / "missing-dir" / "db")
    with pytest.raises(sqlite3.OperationalError, match="unable to open"):
        sqlite3.connect(tmp_path / "missing-dir" / "db")
