"""Device bundles: the wheels and install files a device kit carries (``fedsdk provision --with-wheels``).

A bundle lets a kit copied to a device install and start with one command, offline::

    wheels/        the fedsdk wheel and, where the platform takes pip wheels, every dependency's wheel
    install.sh     the platform's install script (it finds the kit and the wheels beside itself)
    ...            the platform's service files (systemd unit, config, run wrapper; or a runit service)
    bundle.json    platform, fedsdk version and the wheel file names

Platforms (``PLATFORMS``):

* ``arm64``: Raspberry Pi OS 64-bit (Debian bookworm, Python 3.11). Every dependency including gmpy2 (the
  ``fast`` extra) as binary manylinux aarch64 cp311 wheels, fetched with ``pip download --only-binary`` for
  that platform; the files of ``examples/raspberry_pi``.
* ``host``: the same systemd install for a Debian-like machine of the operator's own architecture and
  Python (dependency wheels for the running interpreter).
* ``termux``: Android under Termux. numpy, onnxruntime, cryptography and psutil come from ``pkg``
  (manylinux wheels do not install there), so the bundle carries only the pure-Python dependencies (phe,
  paho-mqtt) beside the fedsdk wheel; the files of ``examples/android_termux``.

The fedsdk wheel is built with ``pip wheel --no-deps`` from the source tree fedsdk is imported from (a
copy of it, so the tree is not touched), or taken from ``wheels_from``: a directory of wheels used as they
are (no build, no download), which keeps provisioning offline.

The fleet directory keeps the bundle in ``device-bundle/``; each device kit gets a hard-linked copy (a plain
copy across file systems), and ``add-device`` gives a new kit the same bundle.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from fedsdk.errors import ConfigError

__all__ = ["BUNDLE_DIR", "PLATFORMS", "BundlePlatform", "add_bundle_to_kit", "build_bundle"]

BUNDLE_DIR = "device-bundle"
_BUNDLE_FILE = "bundle.json"

#: fedsdk's device dependencies (pyproject ``[project] dependencies``) and the ``fast`` extra.
_DEVICE_REQUIREMENTS = (
    "numpy>=1.24",
    "onnxruntime>=1.16",
    "phe>=1.5",
    "paho-mqtt>=2.0",
    "psutil>=5.9",
    "cryptography>=41",
)
_FAST_REQUIREMENTS = ("gmpy2>=2.1",)
_PURE_REQUIREMENTS = ("phe>=1.5", "paho-mqtt>=2.0")


@dataclass(frozen=True)
class BundlePlatform:
    """Where a bundle installs: which install files it carries and which wheels ``pip download`` fetches."""

    name: str
    files: str  # directory of the install files in this package's ``device_files``
    requirements: tuple[str, ...]
    download_args: tuple[str, ...]  # pip download options selecting the target's wheels
    resolve_deps: bool  # False: fetch only the named requirements (their dependencies come from elsewhere)


PLATFORMS: dict[str, BundlePlatform] = {
    "arm64": BundlePlatform(
        "arm64",
        "raspberry_pi",
        _DEVICE_REQUIREMENTS + _FAST_REQUIREMENTS,
        (
            "--platform=manylinux_2_36_aarch64",  # bookworm's glibc 2.36 runs every manylinux tag below it
            "--platform=manylinux_2_28_aarch64",
            "--platform=manylinux_2_27_aarch64",
            "--platform=manylinux2014_aarch64",
            "--python-version=3.11",
            "--implementation=cp",
            "--abi=cp311",
            "--abi=abi3",
            "--abi=none",
        ),
        True,
    ),
    "host": BundlePlatform("host", "raspberry_pi", _DEVICE_REQUIREMENTS + _FAST_REQUIREMENTS, (), True),
    "termux": BundlePlatform("termux", "android_termux", _PURE_REQUIREMENTS, (), False),
}


def _pip(args: list[str], what: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise ConfigError(f"{what} failed ({' '.join(cmd)}):\n{tail}")


def source_tree() -> Path:
    """The project directory fedsdk is imported from (it holds the pyproject.toml named fedsdk)."""
    import fedsdk

    for parent in Path(fedsdk.__file__).resolve().parents:
        pyproject = parent / "pyproject.toml"
        if pyproject.is_file() and 'name = "fedsdk"' in pyproject.read_text(encoding="utf-8"):
            return parent
    raise ConfigError(
        "fedsdk is not imported from a source tree, so its wheel cannot be built here; "
        "pass --wheels DIR with a fedsdk wheel (pip wheel --no-deps <fedsdk source>)"
    )


_SKIP_TOP = {".git", ".venv", "venv", "build", "dist", "tests", "docs", "results", "fedsdk-state"}
_SKIP_ANYWHERE = shutil.ignore_patterns("__pycache__", "*.egg-info", "*_cache", ".hypothesis", "*.pyc")


def _skip(root: Path) -> Callable[[str, list[str]], set[str]]:
    """What the wheel build does not need: the top level's VCS, venvs, tests and docs; caches anywhere."""

    def ignore(directory: str, names: list[str]) -> set[str]:
        skipped = set(_SKIP_ANYWHERE(directory, names))
        if Path(directory) == root:
            skipped |= {n for n in names if n in _SKIP_TOP or n.startswith(".")}
        return skipped

    return ignore


def _can_build_here() -> bool:
    """Whether this environment has what pyproject.toml's build-system requires: setuptools >= 77 (an SPDX
    ``project.license``; it carries ``bdist_wheel`` too)."""
    try:
        import setuptools
    except ImportError:
        return False
    parts = [int(p) for p in setuptools.__version__.split(".")[:2] if p.isdigit()]
    return [*parts, 0, 0][:2] >= [77, 0]


def build_fedsdk_wheel(out: Path) -> Path:
    """``pip wheel --no-deps`` of a copy of the source tree into ``out``; returns the wheel's path."""
    with tempfile.TemporaryDirectory(prefix="fedsdk-wheel-") as tmp:
        src = Path(tmp) / "src"
        tree = source_tree()
        shutil.copytree(tree, src, symlinks=True, ignore=_skip(tree))
        # without build isolation when this environment can build the wheel itself (no index needed, so
        # provisioning stays offline); else pip fetches the build requirements into an isolated one
        isolation = ["--no-build-isolation"] if _can_build_here() else []
        _pip(["wheel", "--no-deps", *isolation, "-q", "-w", str(out), str(src)], "pip wheel")
    found = sorted(out.glob("fedsdk-*.whl"))
    if not found:
        raise ConfigError(f"pip wheel wrote no fedsdk wheel into {out}")
    return found[-1]


def _download(platform: BundlePlatform, out: Path) -> None:
    args = ["download", "-q", "--only-binary=:all:", "-d", str(out), *platform.download_args]
    if not platform.resolve_deps:
        args.append("--no-deps")
    _pip([*args, *platform.requirements], f"pip download for platform {platform.name}")


def _copy_files(platform: BundlePlatform, out: Path) -> list[str]:
    """Copy the platform's install files (package data, kept as in ``examples/``) into ``out``."""
    root = resources.files("fedsdk_coordinator.provision").joinpath("device_files").joinpath(platform.files)
    copied: list[str] = []

    def walk(node: Any, rel: Path) -> None:
        for child in node.iterdir():
            target = out / rel / child.name
            if child.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                walk(child, rel / child.name)
            elif child.name != "README.md":
                target.write_bytes(child.read_bytes())
                executable = child.name == "run" or child.name.endswith((".sh", "-run"))
                target.chmod(0o755 if executable else 0o644)
                copied.append(str(rel / child.name))

    walk(root, Path())
    if not copied:
        raise ConfigError(f"no install files for platform {platform.name} in the fedsdk_coordinator package")
    return sorted(copied)


def build_bundle(
    fleet_dir: Path, platform_name: str, *, wheels_from: str | os.PathLike[str] | None = None
) -> Path:
    """Write ``<fleet_dir>/device-bundle/`` for ``platform_name``; returns its path."""
    if platform_name not in PLATFORMS:
        raise ConfigError(f"platform must be one of {', '.join(PLATFORMS)}, got {platform_name!r}")
    platform = PLATFORMS[platform_name]
    bundle = fleet_dir / BUNDLE_DIR
    if bundle.exists():
        shutil.rmtree(bundle)
    wheels = bundle / "wheels"
    wheels.mkdir(parents=True)
    if wheels_from is not None:
        src = Path(wheels_from)
        given = sorted(src.glob("*.whl")) if src.is_dir() else []
        if not any(w.name.startswith("fedsdk-") for w in given):
            raise ConfigError(f"--wheels {src}: no fedsdk-*.whl there (pip wheel --no-deps <fedsdk source>)")
        for w in given:
            shutil.copy2(w, wheels / w.name)
    else:
        build_fedsdk_wheel(wheels)
        _download(platform, wheels)
    files = _copy_files(platform, bundle)
    names = sorted(w.name for w in wheels.glob("*.whl"))
    fedsdk_wheel = next(n for n in names if n.startswith("fedsdk-"))
    info = {
        "platform": platform.name,
        "fedsdk_wheel": fedsdk_wheel,
        "fedsdk_version": fedsdk_wheel.split("-")[1],
        "wheels": names,
        "files": files,
    }
    (bundle / _BUNDLE_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return bundle


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def add_bundle_to_kit(fleet_dir: Path, kit: Path) -> bool:
    """Give ``kit`` the fleet's device bundle, if the fleet has one; True when it did."""
    bundle = fleet_dir / BUNDLE_DIR
    if not (bundle / _BUNDLE_FILE).is_file():
        return False
    for src in sorted(bundle.rglob("*")):
        dst = kit / src.relative_to(bundle)
        if src.is_dir():
            dst.mkdir(mode=0o700, exist_ok=True)
        else:
            dst.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            _link_or_copy(src, dst)
    return True
