"""The libFuzzer entry every atheris target here shares: inputs that fail are saved
under ``$TMPDIR/changestreamer-fuzz/<name>/`` unless ``-artifact_prefix=`` says
where (never in the repository)."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import atheris  # type: ignore[import-untyped]


def fuzz(name: str, test_one_input: Callable[[bytes], None]) -> None:
    argv = list(sys.argv)
    if not any(a.startswith("-artifact_prefix=") for a in argv):
        where = Path(tempfile.gettempdir()) / "changestreamer-fuzz" / name
        where.mkdir(parents=True, exist_ok=True)
        argv.append(f"-artifact_prefix={where}/")
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()
