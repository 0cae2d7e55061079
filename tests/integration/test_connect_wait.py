"""A device started before its broker waits for it (``connect(timeout)``, ``FedClient(connect_wait=)``,
``fedsdk join --connect-wait``), says so once, and connects when the broker comes up; a broker that never
comes up is named in the error with what to check."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from brokers import MosquittoProcess, _mosquitto_config, require_mosquitto
from fedsdk.errors import ConfigError, ConnectError
from fedsdk.transport import MqttTransport
from fedsdk_coordinator.mosquitto import find_mosquitto, free_port
from fedsdk_coordinator.pki import DevPki

pytestmark = pytest.mark.broker


async def test_a_device_started_first_connects_once_the_broker_is_up(
    tmp_path: Path, dev_pki: DevPki, caplog: pytest.LogCaptureFixture
) -> None:
    require_mosquitto()
    binary = find_mosquitto()
    assert binary is not None
    port = free_port()
    broker = MosquittoProcess(binary, tmp_path / "broker", port, dev_pki)
    broker.directory.mkdir(parents=True, exist_ok=True)
    broker.config_file.write_text(_mosquitto_config(port, dev_pki, None, ""))
    transport = MqttTransport("127.0.0.1", port, client_id="dev1", tls=dev_pki.tls_for("dev1"), timeout=2.0)
    caplog.set_level(logging.INFO, logger="fedsdk.progress")
    connecting = asyncio.create_task(transport.connect(30.0))
    try:
        await asyncio.sleep(3.0)  # longer than the transport's own timeout: only the wait given keeps it
        assert not connecting.done()
        await asyncio.get_running_loop().run_in_executor(None, broker.start)
        await asyncio.wait_for(connecting, 30.0)
        waiting = [r.getMessage() for r in caplog.records if r.name == "fedsdk.progress"]
        assert len(waiting) == 1 and f"waiting for the broker at 127.0.0.1:{port}" in waiting[0]
    finally:
        connecting.cancel()
        await transport.close()
        broker.stop()


async def test_a_broker_that_never_comes_up_is_named_with_what_to_check(dev_pki: DevPki) -> None:
    port = free_port()
    transport = MqttTransport("127.0.0.1", port, client_id="dev1", tls=dev_pki.tls_for("dev1"), timeout=30.0)
    with pytest.raises(ConnectError, match=rf"127.0.0.1:{port}.*tried for 2 s: is the broker running there"):
        await transport.connect(2.0)
    await transport.close()


@pytest.mark.parametrize("wait", [0.0, -1.0, float("nan")])
async def test_a_wait_that_is_not_positive_is_refused_by_name(dev_pki: DevPki, wait: float) -> None:
    transport = MqttTransport("127.0.0.1", free_port(), client_id="dev1", tls=dev_pki.tls_for("dev1"))
    with pytest.raises(ConfigError, match="connect wait must be > 0"):
        await transport.connect(wait)
    await transport.close()


def test_join_names_its_option_for_a_wait_that_is_not_positive(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fedsdk", "join", "mqtt://127.0.0.1:1", "--insecure", "--data", "x.npz",
         "--connect-wait", "0"],
        capture_output=True, text=True, cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "--connect-wait 0.0" in proc.stderr, proc.stderr
