"""pyproject.toml lists the packages the wheel installs explicitly (``packages.find``
cannot install ``migrations/`` and ``benchmarks/`` under ``buffered_store``): a new
subpackage folder missing from that list would silently be left out of the wheel."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def setuptools_config() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        config: dict[str, Any] = tomllib.load(f)["tool"]["setuptools"]
    return config


def package_folders() -> dict[str, Path]:
    """Import name -> folder of every package the wheel should hold."""
    roots = {"buffered_store": "buffered_store", "flusher": "flusher"}
    roots.update(setuptools_config()["package-dir"])
    found: dict[str, Path] = {}
    for name, folder in roots.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            relative = init.parent.relative_to(ROOT / folder)
            found[".".join((name, *relative.parts))] = init.parent
    return found


def test_every_package_folder_is_listed_for_the_wheel() -> None:
    assert sorted(setuptools_config()["packages"]) == sorted(package_folders())


def test_migrations_and_benchmarks_install_under_our_namespace() -> None:
    config = setuptools_config()
    assert config["package-dir"] == {
        "buffered_store.migrations": "migrations",
        "buffered_store.benchmarks": "benchmarks",
    }
    top_level = {name.split(".")[0] for name in config["packages"]}
    assert top_level == {"buffered_store", "flusher"}
