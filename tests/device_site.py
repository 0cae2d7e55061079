"""The device's import path without its site-packages: the device's six requirements (numpy, onnxruntime,
phe, paho-mqtt, psutil, cryptography) and everything they require in turn (their ``Requires-Dist``, extras
left out), linked into one folder from this interpreter's installed distributions, without a download.

``tests/integration/test_device_only.py`` runs devices under ``python -I -S`` with this folder and ``sdk/``
as their whole import path. Run as a script (``python tests/device_site.py DIR``) by another interpreter,
it builds that interpreter's folder under ``DIR`` and prints its path: the test runs devices on each Python
``scripts/test_pythons.sh`` tests. Needs ``packaging`` (pytest's own dependency) and nothing of fedsdk.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

DEVICE_DEPENDENCIES = ("numpy", "onnxruntime", "phe", "paho-mqtt", "psutil", "cryptography")


def requirement_closure(names: Iterable[str]) -> list[metadata.Distribution]:
    """The installed distributions ``names`` need at run time: themselves and, recursively, their
    requirements whose markers hold without an extra."""
    todo, seen, out = list(names), set(), []
    while todo:
        dist = metadata.distribution(todo.pop())
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        out.append(dist)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return out


def build_site(root: Path) -> Path:
    """A folder ``root/device-site`` of links to the files of the device's distributions."""
    site = root / "device-site"
    site.mkdir()
    for dist in requirement_closure(DEVICE_DEPENDENCIES):
        for f in dist.files or []:
            top = f.parts[0]
            if top == ".." or (site / top).exists():
                continue
            (site / top).symlink_to(Path(str(dist.locate_file(top))).resolve())
    return site


if __name__ == "__main__":
    print(build_site(Path(sys.argv[1])))
