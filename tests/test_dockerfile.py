"""The Dockerfile, without a container engine: its shape, and its build replayed.

The build stage is replayed in a temporary directory that holds only what its COPY
lines copy (less what .dockerignore leaves out): its wheel command runs there with
this interpreter, the wheel must be platform-tagged and carry the four C helpers,
and installed into a fresh virtual environment it must run them (``app.speedups``)
and migrate a change DB (the migrations and their template are in it). A COPY line
that goes missing fails here, as it would fail the image.
"""

from __future__ import annotations

import http.server
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
import venv
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from app import speedups

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
# Every C helper app/speedups.py knows, as a path in the wheel.
HELPERS = [module.replace(".", "/") for module in speedups._MODULES.values()]


@dataclass
class Stage:
    base: str
    name: str | None
    steps: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)

    def args(self, instruction: str) -> list[str]:
        return [a for i, a in self.steps if i == instruction]


def parse(text: str) -> list[Stage]:
    """The stages of a Dockerfile: continuation lines joined, comments dropped."""
    stages: list[Stage] = []
    logical = re.sub(r"\\\n(\s*#[^\n]*\n)*", " ", text)
    for line in logical.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction, rest = instruction.upper(), " ".join(rest.split())
        if instruction == "FROM":
            base, _, name = rest.partition(" AS ")
            stages.append(Stage(base.strip(), name.strip() or None))
        else:
            stages[-1].steps.append((instruction, rest))
    return stages


def compiler() -> str | None:
    cc = os.environ.get("CC") or str(sysconfig.get_config_var("CC") or "cc")
    return shutil.which(shlex.split(cc)[0])


def dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [p.strip().removeprefix("**/") for p in lines if p.strip() and not p.startswith("#")]


def replay_copy(args: str, workdir: Path, ignored: list[str]) -> None:
    """``COPY src... dest`` (no flags) from the repo into ``workdir``, as Docker does."""
    *sources, dest = shlex.split(args)
    target = workdir / dest
    for source in sources:
        path = REPO / source
        assert path.exists(), f"COPY {source}: not in the repository"
        if path.is_dir():
            to = target if len(sources) == 1 and not dest.endswith("/") else target / path.name
            shutil.copytree(path, to, ignore=shutil.ignore_patterns(*ignored), dirs_exist_ok=True)
        else:
            to = target / path.name if dest.endswith("/") or len(sources) > 1 else target
            to.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, to)


def build_wheel(dockerfile: str, tmp: Path) -> Path:
    """Replays the build stage of ``dockerfile`` in ``tmp``; the wheel it makes."""
    build = parse(dockerfile)[0]
    workdir = tmp / "context" / PurePosixPath(build.args("WORKDIR")[-1]).relative_to("/")
    workdir.mkdir(parents=True)
    ignored = dockerignore()
    for args in build.args("COPY"):
        replay_copy(args, workdir, ignored)
    wheel_runs = [a for a in build.args("RUN") if "pip wheel" in a]
    assert len(wheel_runs) == 1, build.args("RUN")
    # The command as written, with this interpreter as its `python`.
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        wheel_runs[0], shell=True, cwd=workdir, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    wheels = list((workdir / "dist").glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def check_wheel(wheel: Path) -> None:
    """Tagged for this platform, carrying the five C helpers, the migrations and the
    dashboard's static files."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    assert re.search(r"-cp3\d+-cp3\d+-linux_\w+\.whl$", wheel.name), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert sorted(n for n in names if n.endswith(".so")) == sorted(h + suffix for h in HELPERS)
    assert "migrations/script.py.mako" in names
    assert "migrations/versions/0001_reference_schema_v6.py" in names
    # /dashboard's page and its vendored chart library (package data).
    for name in ("dashboard.html", "dashboard.js", "uPlot.iife.min.js", "uPlot.LICENSE"):
        assert f"app/server/static/{name}" in names
    assert not any(n.startswith(("bench/", "tests/")) for n in names)


def test_the_image_has_a_build_stage_and_a_slim_runtime_without_a_compiler() -> None:
    build, runtime = parse(DOCKERFILE.read_text())
    assert build.name == "build"
    assert any("gcc" in run for run in build.args("RUN"))
    assert runtime.base.endswith("-slim")
    assert not any(re.search(r"\b(gcc|cc|clang|build-essential)\b", r) for r in runtime.args("RUN"))
    # It installs the wheel the build stage made at the versions tested, and nothing
    # else from the source tree.
    assert runtime.args("COPY") == [
        "--from=build /src/dist/ /tmp/dist/",
        "--from=build /src/constraints.txt /tmp/constraints.txt",
    ]
    assert any(
        "pip install" in r and "-c /tmp/constraints.txt" in r and "/tmp/dist/*.whl" in r
        for r in runtime.args("RUN")
    )
    assert runtime.args("CMD") == ['["changestreamer", "serve"]']


def test_the_image_runs_as_a_non_root_user() -> None:
    runtime = parse(DOCKERFILE.read_text())[-1]
    users = runtime.args("USER")
    assert users, "no USER: the service would run as root"
    assert users[-1].split(":")[0] not in ("root", "0")
    # The USER comes after every RUN (they need root), and the user is created there.
    last_user = max(i for i, (ins, _) in enumerate(runtime.steps) if ins == "USER")
    assert all(ins != "RUN" for ins, _ in runtime.steps[last_user:])
    assert any("useradd" in r and users[-1] in r for r in runtime.args("RUN"))
    assert "4849" in runtime.args("EXPOSE")


class _Probed(http.server.BaseHTTPRequestHandler):
    """``/`` answers ``root_status``, ``/ready`` 503 (a service not ready yet)."""

    root_status = 200

    def do_GET(self) -> None:
        self.send_response(self.root_status if self.path == "/" else 503)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _health_check(env: dict[str, str]) -> int:
    """Runs the image's HEALTHCHECK command (its ``python -c``) here; its exit status."""
    (check,) = parse(DOCKERFILE.read_text())[-1].args("HEALTHCHECK")
    command = shlex.split(check.split("CMD ", 1)[1])
    assert command[:2] == ["python", "-c"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ZERO_")}
    done = subprocess.run(
        [sys.executable, "-c", command[2]], env={**clean, **env}, capture_output=True, timeout=30
    )
    return done.returncode


@pytest.mark.parametrize("root_status", [200, 500])
def test_the_health_check_probes_liveness_at_the_configured_port(root_status: int) -> None:
    """Docker's health check asks ``/`` (a service still syncing or waiting for its
    backup is alive, only not ready) at serve's port, however it is configured."""
    handler = type("Probed", (_Probed,), {"root_status": root_status})
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            port = server.server_address[1]
            by_port = _health_check({"ZERO_CHANGE_STREAMER_PORT": str(port)})
            by_zero_port = _health_check({"ZERO_PORT": str(port - 1)})
        finally:
            server.shutdown()
    healthy = root_status == 200
    assert (by_port == 0, by_zero_port == 0) == (healthy, healthy)


@pytest.mark.skipif(compiler() is None, reason="no C compiler: the wheel would carry no C helpers")
def test_the_build_stage_makes_a_platform_wheel_that_runs_the_c_helpers(tmp_path: Path) -> None:
    wheel = build_wheel(DOCKERFILE.read_text(), tmp_path)
    check_wheel(wheel)

    # A fresh environment: the wheel without dependencies, which come from this
    # environment's site-packages through a .pth line (a path there, not a site dir:
    # the editable install's own .pth is not read).
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
    result = subprocess.run([*pip, str(wheel)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_", "PYTHON"))}
    clean_env.pop("CHANGESTREAMER_SPEEDUPS", None)
    probe = "import app, app.speedups as s; print(app.__file__); print(s.summary())"
    run = subprocess.run(
        [python, "-c", probe],
        cwd=tmp_path,
        env=clean_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    where, summary = run.stdout.splitlines()
    assert Path(where).is_relative_to(env_dir), where  # the installed copy, not the repo's
    assert summary == "C (jsscan, wsfast, rowrun, fanout, pgrows, copyload)"
    # Its console script migrates a change DB: the migrations are in the wheel.
    data = tmp_path / "data"
    data.mkdir()
    migrate = subprocess.run(
        [env_dir / "bin" / "changestreamer", "migrate"],
        cwd=data,
        env=clean_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert migrate.returncode == 0, migrate.stderr
    assert (data / "zero_0-cdc.db").exists()


@pytest.mark.skipif(compiler() is None, reason="no C compiler: the wheel would carry no C helpers")
def test_a_missing_copy_line_fails_the_replay(tmp_path: Path) -> None:
    # Without setup.py the build still succeeds, as a pure wheel without the helpers;
    # without migrations/ the wheel cannot migrate. Either fails the check above.
    text = DOCKERFILE.read_text()
    for i, (line, instead) in enumerate(
        [
            ("COPY pyproject.toml setup.py README.md ./", "COPY pyproject.toml README.md ./"),
            ("COPY migrations ./migrations\n", ""),
        ]
    ):
        assert line in text
        wheel = build_wheel(text.replace(line, instead), tmp_path / str(i))
        with pytest.raises(AssertionError):
            check_wheel(wheel)
