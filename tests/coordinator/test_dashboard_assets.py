"""The dashboard's files as shipped in the package: nothing in them parses data as HTML or reaches beyond
the coordinator that serves them (devices and laptops may have no internet; device ids and reasons are
chosen by devices). The browser test (``tests/integration/test_dashboard_browser.py``) checks what they do."""

from __future__ import annotations

import json
import re
from importlib import resources

import pytest

from fedsdk_coordinator.engine.timing import PARTS, PROTECT
from fedsdk_coordinator.rest import ASSETS, STATE_BLOCK, page_with_state

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
    assert calls == ["path", "url"], calls  # its definition, then the call over SOURCES
    sources = re.findall(r'\[\s*"(\w+)",\s*\(\) => [`"]([^`"]*)[`"]\s*\]', script)
    assert [part for part, _ in sources] == ["health", "clients", "clusters", "rounds"], sources
    assert all(path.startswith("/api/") for _, path in sources), sources


def test_the_page_is_served_with_the_state_as_data_no_value_can_break_out() -> None:
    evil = "</script><script>window.__xss = 1</script><!--"
    state = {"federation": "f", "clients": [{"client_id": evil, "facts": {"refused": "a & b > c"}}]}
    page = page_with_state(text("index.html"), state)
    start = page.index('<script type="application/json" id="initial-state">')
    end = page.index("</script>", start)
    block = page[start:end].split(">", 1)[1]
    assert "<" not in block and ">" not in block and "&" not in block
    assert json.loads(block) == state
    assert page.replace(page[start:end], STATE_BLOCK[: -len("</script>")]) == text("index.html")


def test_a_page_without_its_data_block_is_refused() -> None:
    with pytest.raises(ValueError, match="initial-state"):
        page_with_state("<html></html>", {})


def test_the_time_bars_draw_the_parts_the_engine_records() -> None:
    script = text("dashboard.js")
    drawn = re.findall(r'^  \["(\w+)", "[^"]+", "', script, flags=re.M)
    assert drawn == list(PARTS), drawn
    assert "waiting / other" not in script
    protect = re.search(r"^const PROTECT = \[([^\]]*)\];", script, flags=re.M)
    assert protect is not None and re.findall(r'"(\w+)"', protect.group(1)) == list(PROTECT)
