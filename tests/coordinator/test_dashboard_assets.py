"""The dashboard's files as shipped in the package: nothing in them parses data as HTML or reaches beyond
the coordinator that serves them (devices and laptops may have no internet; device ids and reasons are
chosen by devices). The browser test (``tests/integration/test_dashboard_browser.py``) checks what they do."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from fedsdk_coordinator.rest import ASSETS

PACKAGE = resources.files("fedsdk_coordinator")
FILES = {name: PACKAGE.joinpath("dashboard", name) for name, _ in ASSETS.values()}


def text(name: str) -> str:
    return FILES[name].read_text(encoding="utf-8")


def test_every_served_file_is_in_the_package() -> None:
    assert set(FILES) == {"index.html", "dashboard.js", "dashboard.css"}
    assert all(f.is_file() for f in FILES.values())


@pytest.mark.parametrize(
    "sink", ["innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"]
)
def test_the_script_never_turns_data_into_markup(sink: str) -> None:
    assert sink not in text("dashboard.js")


def test_nothing_is_loaded_from_elsewhere() -> None:
    page = text("index.html")
    refs = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert refs and all(r.startswith("/") or r == "data:," for r in refs), refs
    assert "<script>" not in page and " style=" not in page  # no inline code: the CSP forbids it
    script, style = text("dashboard.js"), text("dashboard.css")
    urls = set(re.findall(r"https?://[^\s\"'`)]+", script + style))
    assert urls == {"http://www.w3.org/2000/svg"}, urls  # SVG's namespace name, never fetched
    assert "@import" not in style
    assert re.findall(r"\bfetch\(([^,)]*)", script) == ["path"]  # in getJSON only
    calls = re.findall(r"\bgetJSON\(([^)]*)\)", script)
    assert calls[0] == "path" and len(calls) == 5, calls  # its definition, then the four calls
    assert all(re.match(r"[`\"]/api/", c) for c in calls[1:]), calls
