"""The fedsdk wheel builds from a copy of the source tree with no deprecation from the build backend (a
deprecated metadata form becomes a build error on a date setuptools announces), and carries its licence.
The build is isolated, as on a fresh machine: pip fetches the newest setuptools pyproject.toml allows."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from fedsdk_coordinator.provision.bundle import _skip, source_tree

pytestmark = pytest.mark.slow


def test_wheel_builds_without_deprecation_and_carries_the_license(tmp_path: Path) -> None:
    tree = source_tree()
    src = tmp_path / "src"
    shutil.copytree(tree, src, symlinks=True, ignore=_skip(tree))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out)]
    cmd.append(str(src))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "deprecat" not in log.lower(), log[-3000:]
    (wheel,) = out.glob("fedsdk-*.whl")
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = whl.read(meta).decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
