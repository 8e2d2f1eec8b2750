"""constraints.txt pins what CI, the Docker image and scripts/bootstrap install: every
dependency pyproject.toml names (runtime and dev) must be pinned there, to a version
its own range accepts, or a fresh machine could install an untested one."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent


def pins() -> dict[str, str]:
    pinned: dict[str, str] = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep:
            pinned[canonicalize_name(name)] = version.strip()
    return pinned


def test_every_dependency_is_pinned_within_its_range() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    required = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    pinned = pins()
    missing, outside = [], []
    for text in required:
        requirement = Requirement(text)
        version = pinned.get(canonicalize_name(requirement.name))
        if version is None:
            missing.append(requirement.name)
        elif not requirement.specifier.contains(version, prereleases=True):
            outside.append(f"{requirement.name}=={version} (wants {requirement.specifier})")
    assert missing == []
    assert outside == []


def test_the_project_itself_is_not_pinned() -> None:
    assert "changestreamer" not in pins()
