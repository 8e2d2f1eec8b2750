"""The C helpers, as optional extensions of the package build (docs/architecture.md,
decision 35). Everything else about the package is in pyproject.toml.

Each helper has a pure-Python twin with the same answers, so a helper that fails to
build (no C compiler, a compiler error) leaves a warning and the install goes on.
A wheel is tagged for the platform only when it really carries an extension.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel

# name -> source; app/speedups.py imports them (and says which are active).
HELPERS = {
    "app.protocol._jsscan": "app/protocol/_jsscan.c",
    "app.protocol._wsfast": "app/protocol/_wsfast.c",
    "app.streamer._rowrun": "app/streamer/_rowrun.c",
    "app.streamer._fanout": "app/streamer/_fanout.c",
    "app.sources.postgres._pgrows": "app/sources/postgres/_pgrows.c",
    "app.sources.postgres._copyload": "app/sources/postgres/_copyload.c",
}


class _TagByContents(bdist_wheel):
    """py3-none-any when no extension was built; the platform's tag otherwise."""

    def run(self) -> None:
        if not self.skip_build:
            self.run_command("build")
        build_ext = self.get_finalized_command("build_ext")
        if not any(Path(p).exists() for p in build_ext.get_outputs()):
            # Nothing built: a pure wheel, laid out as one (install puts a distribution
            # with extensions in platlib).
            self.distribution.ext_modules = []
            self.root_is_pure = True
        super().run()


setup(
    ext_modules=[
        Extension(name, [source], extra_compile_args=["-O2"], optional=True)
        for name, source in HELPERS.items()
    ],
    cmdclass={"bdist_wheel": _TagByContents},
)
