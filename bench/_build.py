"""The benchmark subscriber's C frame loop (``bench/_rawscan.c``), compiled on demand.

``bench/`` is no package of the install, so the package build does not compile it:
the first benchmark run does, next to its source, with the machine's C compiler
(``$CC``, default ``cc``), and again whenever the source is newer. Without a
compiler, a failed compile or with ``CHANGESTREAMER_SPEEDUPS=0`` the benchmark uses
the Python loop in ``bench/pg_subscribers.py`` (same acks, slower).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

from app import speedups

SOURCE = Path(__file__).with_name("_rawscan.c")
MODULE = "bench._rawscan"


def target() -> Path:
    return SOURCE.with_name("_rawscan" + str(sysconfig.get_config_var("EXT_SUFFIX")))


def build() -> Path | None:
    """Compiles ``_rawscan.c`` unless up to date; the extension's path, or None (why on
    stderr)."""
    out = target()
    if out.exists() and out.stat().st_mtime >= SOURCE.stat().st_mtime:
        return out
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        print(f"bench: no C compiler ({cc}); the Python frame loop runs", file=sys.stderr)
        return None
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    command = [cc, "-O2", "-Wall", "-shared", "-fPIC"]
    command += [f"-I{sysconfig.get_paths()['include']}", "-o", str(tmp), str(SOURCE)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tmp.unlink(missing_ok=True)
        print(f"bench: compiling {SOURCE.name} failed; the Python frame loop runs", file=sys.stderr)
        print(result.stderr, file=sys.stderr, end="")
        return None
    os.replace(tmp, out)  # atomic: concurrent benchmark processes may build it too
    return out


def rawscan() -> ModuleType | None:
    """The C frame loop, built if need be; None when speedups are off or it cannot be."""
    if not speedups.ENABLED or build() is None:
        return None
    return speedups.load(MODULE)
