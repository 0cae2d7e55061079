"""The dashboard in a real browser during a real federation: headless Chromium (Selenium, Debian's
chromedriver) on the coordinator application, with mosquitto and three FedClients of the ``fedsdk`` strategy
(sketch round, clustering, every update encrypted; 1024-bit keys to keep it short).

The page is loaded once, before any device joins, with every request to the REST API failing: its first
DOM (at the load event, with no poll answered) shows the federation's name, state and devices from the
state the coordinator wrote into the page. The page as shipped, without that state, in a frame while
``/api/rounds`` fails: it draws the other answers as they arrive. The page is never reloaded (a marker set on
its ``window`` must survive): what it shows later came from its own polling. Asserted on the page: a
malformed frame published on a device's upstream topic appears among the rejected messages; a device
refusing with a reason that is HTML shows that reason as text (no element made from it, no script run);
rounds appear in the header and as points of each cluster's plot, with the devices' personal models beside
the federated figure; a device row shows its cluster and its budget; at the end the state is ``finished``,
every round is a point, each plot has a legend entry per series it draws, the time bars'
segments are the parts the coordinator recorded (their sum is the round's time, almost none of it
unattributed) with a legend entry each, devices show as gone, and the browser's console holds no error.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from brokers import require_mosquitto, start_mosquitto
from engines import digit_devices, http_coordinator
from fedsdk.crypto import generate_backend
from fedsdk.hekeys import save_he
from fedsdk.model.data import load_digits, partition_iid
from fedsdk.protocol import DATA_MISMATCH, Error, encode
from fedsdk.protocol import topics as T
from fedsdk.transport import MqttTransport
from fedsdk_coordinator import RoundConfig
from fedsdk_coordinator.app import ENGINE
from fedsdk_coordinator.rest import ASSETS
from webui import Page, block_urls, raw_publish, require_chromium, start_chromium

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(90)]

ROUNDS = 3
XSS = '<img src="x" onerror="window.__xss = 1">'


@pytest.fixture(scope="module", autouse=True)
def _need_browser_and_broker() -> None:
    require_mosquitto()
    require_chromium()


async def test_the_dashboard_follows_a_federation_live(tmp_path: Path) -> None:
    with generate_backend("packed", key_bits=1024) as full:
        public = save_he(tmp_path / "he-public", full, include_secret=False)
        device_keys = save_he(tmp_path / "he-device", full, include_secret=True)
    digits = load_digits(shape="flat")
    part = partition_iid(digits.y_train, 3, seed=0)
    fed = f"ui{secrets.token_hex(3)}"
    rounds = RoundConfig(
        federation=fed, rounds=ROUNDS, min_clients=2, start_clients=3, strategy="fedsdk", farewell_s=3.0
    )
    with start_mosquitto(tmp_path / "mosq") as broker:
        async with http_coordinator(tmp_path, broker, rounds, he_dir=public) as http:
            engine = http.app[ENGINE]
            driver = await asyncio.to_thread(start_chromium, tmp_path / "chromium-profile")
            page = Page(driver)
            try:
                # the first paint needs no answer from the API: the page comes with the state
                await block_urls(driver, "*/api/*")
                await asyncio.to_thread(driver.get, str(http.make_url("/")))
                assert await page.text("#federation-name") == fed
                assert await page.text("#state") == "waiting for devices"
                assert await page.text("#strategy") == "fedsdk"
                assert await page.text("#devices tbody") == "no device has said hello yet"
                assert (await page.text("#link") or "").startswith("as of "), await page.text("#link")
                await _bare_page_draws_each_answer(driver)
                await block_urls(driver)
                await page.until("a poll answered", lambda: _is(page.text("#link"), "updated", prefix=True))
                blocked = await asyncio.to_thread(driver.get_log, "browser")  # read, and so cleared
                assert all("ERR_BLOCKED_BY_CLIENT" in e["message"] for e in blocked if e["level"] == "SEVERE")
                await page.until(
                    "the federation waiting", lambda: _is(page.text("#state"), "waiting for devices")
                )
                await page.run("window.__loaded_once = true;")
                assert await page.count("#clusters circle.point") == 0

                # a frame that is no fedsdk message, and a refusal whose reason is HTML
                frame = b"not a fedsdk frame: forty-two bytes and more of plain text"
                await raw_publish(broker.host, broker.port, T.up(fed, "d9", T.HELLO), frame)
                await page.until(
                    "the rejected frame", lambda: page.count('#rejected tr[data-code="bad_magic"]')
                )
                assert await page.text('#rejected tr[data-code="bad_magic"] td.num') == "1"
                evil = MqttTransport.from_url(broker.url, client_id="evil", insecure=True)
                async with evil:
                    refusal = Error(client_id="evil", round_id=0, code=DATA_MISMATCH, reason=XSS)
                    await evil.publish(T.up(fed, "evil", T.ERROR), encode(refusal))
                await page.until("the refused device", lambda: page.count('#devices tr[data-device="evil"]'))
                assert XSS in (await page.text('#devices tr[data-device="evil"]') or "")
                assert await page.count("#devices img") == 0

                clients = digit_devices(
                    broker,
                    engine,
                    digits,
                    part,
                    he_dir=device_keys,
                    eval_data=(digits.x_test, digits.y_test),
                    personal_epochs=2,
                )
                async with contextlib.AsyncExitStack() as stack:
                    for c in clients:
                        await stack.enter_async_context(c)
                    run = asyncio.gather(*(c.run() for c in clients))
                    # while the federation runs: a round and a point of the plot appear, with no reload
                    await page.until("a point of the plot", lambda: page.count("#clusters circle.point"))
                    row = '#devices tr[data-device="d0"]'
                    await page.until(
                        "d0's budget", lambda: _is(page.text(f'{row} td[data-field="budget"]'), "1.00")
                    )
                    assert await page.text(f'{row} td[data-field="cluster"]') == "0"
                    summaries = await asyncio.wait_for(run, 60)
                assert all(s.state == "finished" for s in summaries), summaries
                await page.until("the end", lambda: _is(page.text("#state"), "finished"))
                points = await page.until(
                    "every round", lambda: _at_least(page.count("#clusters circle.point"), ROUNDS)
                )
                assert points == ROUNDS  # the devices' data is IID: one cluster
                assert await page.text("#round-now") == f"{ROUNDS} of {ROUNDS}"
                await page.until(
                    "d0 gone", lambda: _is(page.text(f"{row} td:nth-child(3)"), "left", prefix=True)
                )
                title = await page.text("#clusters .card svg.plot text.title") or ""
                assert "federated accuracy" in title and "personal models" in title, title
                assert await page.count("#clusters circle.personal-point") == ROUNDS
                assert await page.count("#clusters svg.bars rect") >= ROUNDS
                await _legends_name_every_line_and_part(page)
                for r in await (await http.get("/api/rounds")).json():
                    parts = {k: v for k, v in r["metrics"].items() if k.startswith("time_")}
                    assert sum(parts.values()) == pytest.approx(r["metrics"]["round_s"], rel=0.05), r
                    assert parts["time_unattributed_s"] < 0.1 * r["metrics"]["round_s"], parts
                assert (await page.text("#decision") or "").startswith("statusdecided")
                assert await page.run("return window.__loaded_once === true && window.__xss === undefined;")
                errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
                assert not errors, errors
            finally:
                await asyncio.to_thread(driver.quit)


async def _bare_page_draws_each_answer(driver: Any) -> None:
    """The page as shipped (no state written into it) in a frame, with ``/api/rounds`` failing: the header
    and the device table are drawn from the answers that came."""
    await block_urls(driver, "*/api/rounds*")
    shipped = resources.files("fedsdk_coordinator").joinpath("dashboard", ASSETS["/"][0])
    script = "const f = document.createElement('iframe'); f.id = 'bare'; f.srcdoc = arguments[0];"
    await asyncio.to_thread(driver.execute_script, script + " document.body.append(f);", shipped.read_text())
    frame = Page(driver, "document.getElementById('bare').contentDocument")
    await frame.until(
        "the header without /api/rounds", lambda: _is(frame.text("#state"), "waiting for devices")
    )
    await frame.until(
        "the devices", lambda: _is(frame.text("#devices tbody"), "no device has said hello yet")
    )
    assert await frame.text("#strategy") == "fedsdk"
    await frame.run("document.getElementById('bare').remove();")


async def _legends_name_every_line_and_part(page: Page) -> None:
    """Each cluster's plot: a legend entry per series it draws (lines and points); the time bars: each
    segment's part has a legend entry, under the parts' names."""
    plots = await page.run(
        "const series = (c, s) =>"
        "  [...new Set([...c.querySelectorAll(s)].map((n) => n.dataset.series))].sort();"
        "return [...document.querySelectorAll('#clusters .card')].map((c) => ["
        "  series(c, 'svg.plot [data-series]'), series(c, '.plot-legend [data-series]'),"
        "  c.querySelectorAll('svg.plot polyline').length]);"
    )
    assert plots, "no cluster card"
    for drawn, legend, lines in plots:
        assert drawn == legend == ["federated", "personal"], plots
        assert lines == 2, plots
    parts = set(await page.texts("#clusters svg.bars rect", "data-part"))
    keys = await page.texts("#clusters .bar-legend [data-part]", "data-part")
    legend = dict(zip(keys, await page.texts("#clusters .bar-legend [data-part]"), strict=True))
    assert parts == set(legend), (parts, legend)
    # a part under half a percent of every round is not drawn: which parts pass that depends on the
    # machine's speed, so only the names of those drawn are checked
    assert len(parts) >= 2, parts
    names = {"trips": "message trips", "slowest": "waiting for the slowest device", "train": "train"}
    assert all(legend[p] == name for p, name in names.items() if p in legend), legend
    assert "waiting / other" not in (await page.run("return document.body.innerText;"))


async def _is(text: Any, want: str, *, prefix: bool = False) -> bool:
    got = await text
    return got is not None and (got.startswith(want) if prefix else got == want)


async def _at_least(count: Any, n: int) -> int:
    got: int = await count
    return got if got >= n else 0
