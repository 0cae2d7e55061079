"""Helpers for the tests of the coordinator's web side: headless Chromium driven by Selenium, and a raw MQTT
client that publishes what no fedsdk device would.

* :func:`start_chromium` starts Debian's Chromium (``/usr/bin/chromium``) through Debian's chromedriver
  (``/usr/bin/chromedriver``, given to Selenium so it never tries to download one), headless, with a fresh
  profile and nothing that calls home; :func:`require_chromium` skips a test without them (fails under
  ``CI``, where ``scripts/test.sh`` installs them).
* :func:`raw_publish` publishes bytes on a topic with paho, outside any fedsdk framing.
* :func:`block_urls` makes the browser fail every request to URLs matching patterns (DevTools' network
  blocking), as an unreachable endpoint would.
* :class:`Page` reads the page (or a frame's document) from the test's event loop.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest

__all__ = [
    "CHROMEDRIVER",
    "CHROMIUM",
    "FLAGS",
    "Page",
    "block_urls",
    "raw_publish",
    "require_chromium",
    "start_chromium",
]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
)


def require_chromium() -> None:
    """Skip the test when Chromium, its driver or Selenium is missing; under ``CI``, fail instead."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package")
    if not missing:
        return
    message = f"{', '.join(missing)} missing (apt-get install chromium chromium-driver; pip install selenium)"
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"CI is set and {message}", pytrace=False)
    pytest.skip(message)


def start_chromium(profile: Path, *, width: int = 1400, height: int = 1000) -> Any:
    """A Selenium WebDriver on a fresh headless Chromium whose profile lives in ``profile``; the browser's
    console is kept (``driver.get_log("browser")``). The caller quits it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.add_argument(f"--window-size={width},{height}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


async def raw_publish(host: str, port: int, topic: str, payload: bytes) -> None:
    """Publish ``payload`` on ``topic`` (QoS 1, acknowledged) from a plain paho client."""
    raw = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="raw-publisher", protocol=paho.MQTTv311)
    raw.connect(host, port)
    raw.loop_start()
    try:
        await asyncio.to_thread(raw.publish(topic, payload, qos=1).wait_for_publish, 5)
    finally:
        raw.disconnect()
        raw.loop_stop()


async def block_urls(driver: Any, *patterns: str) -> None:
    """Fail every request whose URL matches one of ``patterns`` (``*`` wildcards); none: block nothing."""
    await asyncio.to_thread(driver.execute_cdp_cmd, "Network.enable", {})
    await asyncio.to_thread(driver.execute_cdp_cmd, "Network.setBlockedURLs", {"urls": list(patterns)})


class Page:
    """The browser's one page, or with ``root`` (a JavaScript expression for a document, e.g. a frame's
    ``contentDocument``) that document; every WebDriver call runs in a thread, so the coordinator keeps
    serving."""

    def __init__(self, driver: Any, root: str = "document") -> None:
        self.driver = driver
        self.root = root

    async def run(self, script: str) -> Any:
        return await asyncio.to_thread(self.driver.execute_script, script)

    async def text(self, selector: str) -> str | None:
        got: str | None = await self.run(
            f"const n = {self.root}.querySelector({selector!r}); return n === null ? null : n.textContent;"
        )
        return got

    async def texts(self, selector: str, attribute: str | None = None) -> list[str]:
        """The text (or ``attribute``) of every element ``selector`` matches, in document order."""
        what = "n.textContent" if attribute is None else f"n.getAttribute({attribute!r})"
        got: list[str] = await self.run(
            f"return [...{self.root}.querySelectorAll({selector!r})].map((n) => {what});"
        )
        return got

    async def count(self, selector: str) -> int:
        n: int = await self.run(f"return {self.root}.querySelectorAll({selector!r}).length;")
        return n

    async def until(self, what: str, check: Callable[[], Any], timeout: float = 20.0) -> Any:
        """Poll ``check`` (a coroutine function) until it returns something truthy."""
        deadline = time.monotonic() + timeout
        while True:
            got = await check()
            if got:
                return got
            if time.monotonic() > deadline:
                body = await self.run(f"return {self.root}.body.innerText;")
                raise AssertionError(f"the page never showed {what}; it shows:\n{body}")
            await asyncio.sleep(0.1)
