"""Screenshots of the coordinator's dashboard during and after a real federation, for the docs.

Runs, on this machine: the coordinator application with its embedded broker (plain TCP on loopback), four
in-process devices of the ``fedsdk`` strategy (2048-bit packed Paillier, every update encrypted) training
the ``cnn`` preset for 10 local epochs a round (rounds of a fraction of a second, so that the page is seen
mid-run) on the digits split by label into two groups (so clustering finds two clusters), each evaluating on
the held-out digits of its own classes; a malformed frame and a malformed message are published on a
device's upstream topic so that the rejected-message table has rows. Headless Chromium (Debian's, through
Selenium) opens the dashboard once and is never reloaded; the page is captured when it shows half the rounds
done while the federation trains, and again when the federation has finished.

    PYTHONPATH=sdk:coordinator:tests python scripts/dashboard_screenshots.py [--out docs/images] [--rounds 8]

Needs ``/usr/bin/chromium`` and ``/usr/bin/chromedriver`` (apt-get install chromium chromium-driver) and the
``selenium`` package (the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import secrets
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from fedsdk.client import FedClient
from fedsdk.crypto import generate_backend
from fedsdk.hekeys import load_he, save_he
from fedsdk.model.data import load_digits, partition_label_skew
from fedsdk.protocol import topics as T
from fedsdk.transport import MqttTransport
from fedsdk_coordinator import CoordinatorConfig, RoundConfig, create_app
from fedsdk_coordinator.app import ENGINE, model_for
from fedsdk_coordinator.broker import EmbeddedBrokerConfig
from webui import raw_publish, start_chromium


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def until(condition: Callable[[], bool], timeout: float) -> None:
    """Wait until ``condition()`` holds, up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if condition() or time.monotonic() > deadline:
            return
        await asyncio.sleep(0.1)


async def page_round(driver: Any) -> int | None:
    """The rounds the page shows as completed by every cluster while it says ``training``; None once it
    says the federation is over."""
    state, rounds = await asyncio.to_thread(
        driver.execute_script,
        "return [document.getElementById('state').textContent,"
        " document.getElementById('round-now').textContent];",
    )
    if state in ("finished", "failed"):
        return None
    if state != "training":
        return 0
    done = rounds.split("(")[1].split()[0] if "(" in rounds else rounds.split()[0]
    return int(done) if done.isdigit() else 0


async def capture(driver: Any, path: Path) -> None:
    """The whole page, beyond the window's height, as a PNG (Chrome DevTools' screenshot)."""
    size = (await asyncio.to_thread(driver.execute_cdp_cmd, "Page.getLayoutMetrics", {}))["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
    shot = await asyncio.to_thread(
        driver.execute_cdp_cmd,
        "Page.captureScreenshot",
        {"format": "png", "captureBeyondViewport": True, "clip": clip},
    )
    await asyncio.to_thread(path.write_bytes, base64.b64decode(shot["data"]))
    print(f"wrote {path}")


async def main(out: Path, rounds: int, devices: int, key_bits: int, model: str, epochs: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="fedsdk-dashboard-"))
    with generate_backend("packed", key_bits=key_bits) as full:
        public = save_he(work / "he-public", full, include_secret=False)
        device_keys = save_he(work / "he-device", full, include_secret=True)
    digits = load_digits(shape=model_for(model).layout or "flat")
    part = partition_label_skew(digits.y_train, devices, n_groups=2, seed=0)
    fed = f"demo{secrets.token_hex(2)}"
    broker_port, http_port = free_port(), free_port()
    config = CoordinatorConfig(
        rounds=RoundConfig(
            federation=fed, rounds=rounds, min_clients=2, start_clients=devices, strategy="fedsdk",
            epochs=epochs, farewell_s=5.0,
        ),
        state_dir=work / "state",
        model=model,
        embedded=EmbeddedBrokerConfig(port=broker_port, insecure=True),
        insecure=True,
        he_dir=public,
    )  # fmt: skip
    app = create_app(config)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", http_port).start()
    url = f"mqtt://127.0.0.1:{broker_port}"
    driver = await asyncio.to_thread(start_chromium, work / "chromium-profile")
    try:
        await asyncio.to_thread(driver.get, f"http://127.0.0.1:{http_port}/")
        # on a device's upstream topic: a frame that is not a fedsdk frame, and a well-framed message that is
        # not a fedsdk message
        topic = T.up(fed, "dev-99", T.HELLO)
        await raw_publish("127.0.0.1", broker_port, topic, b"GET / HTTP/1.1 and more bytes than a header")
        rogue = MqttTransport.from_url(url, client_id="rogue", insecure=True)
        async with rogue:
            await rogue.publish(topic, b"GET / HTTP/1.1")
        clients = []
        for i, idx in enumerate(part.indices):
            own = np.isin(digits.y_test, np.unique(digits.y_train[idx]))
            clients.append(
                FedClient(
                    url, client_id=f"dev-{i:02d}", federation=fed, insecure=True, probe_bytes=0,
                    data=(digits.x_train[idx], digits.y_train[idx]), he=load_he(device_keys),
                    eval_data=(digits.x_test[own], digits.y_test[own]), personal_epochs=5,
                )
            )  # fmt: skip
        engine = app[ENGINE]
        async with contextlib.AsyncExitStack() as stack:
            for c in clients:
                await stack.enter_async_context(c)
            run = asyncio.gather(*(c.run() for c in clients))
            # mid-run: as soon as the page itself shows half the rounds done while the federation trains
            await until(lambda: engine.completed_round >= max(1, rounds // 2), 600)
            shown = await page_round(driver)
            while shown is not None and shown < max(1, rounds // 2):
                await asyncio.sleep(0.05)
                shown = await page_round(driver)
            if shown is None:
                raise SystemExit("the run ended before the page showed it mid-run: use more --rounds")
            await capture(driver, out / "dashboard-mid.png")
            await run
        await until(lambda: not engine.online, 10)  # the devices said goodbye
        await asyncio.sleep(2.0)
        await capture(driver, out / "dashboard-end.png")
    finally:
        await asyncio.to_thread(driver.quit)
        await runner.cleanup()


if __name__ == "__main__":  # the coordinator's HE workers start through forkserver, which imports this
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "images")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--key-bits", type=int, default=2048)
    parser.add_argument("--model", default="cnn", help="a preset: mlp, mlpN, cnn")
    parser.add_argument("--epochs", type=int, default=10, help="local epochs a round (a round of seconds)")
    a = parser.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    asyncio.run(main(a.out, a.rounds, a.devices, a.key_bits, a.model, a.epochs))
