"""The largest modules and classes of the three packages, in lines (``python scripts/sizes.py``).

Exit status 1 when a module is over ``--module`` lines or a class over ``--class`` lines (the layout's
limits: 500 and 300, with the few lines of slack the docs call "about")."""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys

ROOTS = ("sdk", "coordinator", "benchmarks")


def sizes(root: pathlib.Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    modules, classes = [], []
    for top in ROOTS:
        for path in sorted((root / top).rglob("*.py")):
            src = path.read_text(encoding="utf-8")
            name = str(path.relative_to(root))
            modules.append((src.count("\n"), name))
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                    classes.append((node.end_lineno - node.lineno + 1, f"{name}:{node.name}"))
    return sorted(modules, reverse=True), sorted(classes, reverse=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--module", type=int, default=510, help="most lines of a module")
    p.add_argument("--class", dest="klass", type=int, default=310, help="most lines of a class")
    p.add_argument("--top", type=int, default=5)
    args = p.parse_args()
    modules, classes = sizes(pathlib.Path(__file__).resolve().parent.parent)
    for title, rows in (("modules", modules), ("classes", classes)):
        print(f"largest {title}:")
        for n, name in rows[: args.top]:
            print(f"  {n:5d}  {name}")
    over = [r for r in modules if r[0] > args.module] + [r for r in classes if r[0] > args.klass]
    for n, name in over:
        print(f"over the limit: {name} ({n} lines)", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
