"""The packages keep the layout's sizes (docs/architecture.md, "Sizes"): no module over about 500 lines, no
class over about 300, measured by ``scripts/sizes.py``."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_no_module_or_class_past_the_layouts_sizes() -> None:
    spec = importlib.util.spec_from_file_location("sizes", ROOT / "scripts" / "sizes.py")
    assert spec is not None and spec.loader is not None
    sizes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sizes)
    modules, classes = sizes.sizes(ROOT)
    assert len(modules) > 150 and len(classes) > 100  # it read the packages
    assert [m for m in modules if m[0] > 510] == []
    assert [c for c in classes if c[0] > 310] == []
