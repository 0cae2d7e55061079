"""The ``fedsdk`` command's verbosity levels and its progress lines for long steps.

The levels are checked on the real loggers after :func:`configure`; the step's lines through the real
logging machinery (a timer thread, real sleeps); ``-q`` and ``--json`` on a real ``fedsdk provision``."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedsdk.cli._logging import OWN, PROGRESS, THIRD_PARTY, configure
from fedsdk.cli._progress import step


@pytest.fixture
def restore_levels() -> Iterator[None]:
    names = ["", *OWN, PROGRESS, *THIRD_PARTY]
    before = {n: logging.getLogger(n).level for n in names}
    yield
    for n, level in before.items():
        logging.getLogger(n).setLevel(level)


def enabled(name: str, level: int) -> bool:
    return logging.getLogger(name).isEnabledFor(level)


@pytest.mark.usefixtures("restore_levels")
def test_each_verbosity_shows_what_it_says() -> None:
    configure(0, whole_process=True)
    assert enabled("fedsdk.progress.rounds", logging.INFO) and enabled("fedsdk.client.work", logging.WARNING)
    assert not enabled("fedsdk.client.work", logging.INFO)
    assert not enabled("fedsdk_coordinator.rounds", logging.INFO)
    assert not enabled("amqtt.broker", logging.INFO) and not enabled("transitions.core", logging.INFO)
    configure(1, whole_process=True)
    assert enabled("fedsdk.transport", logging.DEBUG) and enabled("fedsdk_coordinator.rounds", logging.DEBUG)
    assert enabled("fedsdk_bench.load", logging.DEBUG)
    for name in ("transitions.core", "paho.mqtt.client", "aiohttp.access", "asyncio"):
        assert not enabled(name, logging.INFO), name
        assert enabled(name, logging.WARNING), name
    # amqtt's warnings are protocol chatter below -vv; its errors stay
    assert not enabled("amqtt.broker", logging.WARNING) and enabled("amqtt.broker", logging.ERROR)
    configure(2, whole_process=True)
    for name in ("amqtt.broker", "transitions.core", "paho.mqtt.client", "aiohttp.access", "asyncio"):
        assert enabled(name, logging.DEBUG), name
    configure(2, quiet=True, whole_process=True)  # -q wins
    assert not enabled("fedsdk.progress", logging.INFO) and not enabled("amqtt", logging.INFO)
    assert enabled("fedsdk.client.work", logging.WARNING)


@pytest.mark.usefixtures("restore_levels")
def test_a_process_with_its_own_logging_keeps_its_root_and_library_levels() -> None:
    assert logging.getLogger().handlers  # pytest's own, as an application's would be
    logging.getLogger("amqtt").setLevel(logging.DEBUG)
    root = logging.getLogger().level
    configure(0)
    assert logging.getLogger("amqtt").level == logging.DEBUG and logging.getLogger().level == root
    assert enabled("fedsdk.progress", logging.INFO)
    configure(1)
    assert enabled("fedsdk.transport", logging.DEBUG)


@pytest.mark.usefixtures("restore_levels")
def test_a_step_says_when_it_starts_that_it_still_works_and_how_long_it_took(
    caplog: pytest.LogCaptureFixture,
) -> None:
    configure(0)
    with caplog.at_level(logging.INFO, logger=PROGRESS), step("key generation", tick_s=0.05):
        time.sleep(0.3)
    said = [r.getMessage() for r in caplog.records if r.name == PROGRESS]
    assert said[0] == "key generation ..."
    assert re.fullmatch(r"key generation: done in 0\.[3-9] s", said[-1]), said
    ticks = [m for m in said if "still working" in m]
    assert 3 <= len(ticks) == len(said) - 2, said


@pytest.mark.usefixtures("restore_levels")
def test_a_failed_step_says_so_and_its_error_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    configure(0)
    with caplog.at_level(logging.INFO, logger=PROGRESS), pytest.raises(KeyError), step("provisioning"):
        raise KeyError("x")
    said = [r.getMessage() for r in caplog.records if r.name == PROGRESS]
    assert said[0] == "provisioning ..." and said[-1].startswith("provisioning: stopped after ")


def provision(tmp_path: Path, *flags: str, json_out: bool = False) -> subprocess.CompletedProcess[str]:
    fleet = tmp_path / "fleet.json"
    fleet.write_text(
        json.dumps(
            {
                "federation": "f1",
                "devices": ["pi-01"],
                "coordinator": {"host": "127.0.0.1"},
                "he": {"backend": "packed", "options": {"key_bits": 1024}},
            }
        )
    )
    out = tmp_path / f"fleet{len(list(tmp_path.glob('fleet*')))}"
    cmd = [sys.executable, "-m", "fedsdk", *flags, "provision", "--fleet", str(fleet), "--out", str(out)]
    done = subprocess.run(
        [*cmd, *(["--json"] if json_out else [])], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_provisioning_shows_its_step_by_default_and_not_with_quiet_or_json(tmp_path: Path) -> None:
    shown = provision(tmp_path)
    step_lines = [ln for ln in shown.stderr.splitlines() if "provisioning 1 devices" in ln]
    assert len(step_lines) == 2 and "HE key pair: packed, key_bits 1024" in step_lines[0], shown.stderr
    assert re.match(r"\d\d:\d\d:\d\d provisioning .*: done in [\d.]+ s$", step_lines[1]), step_lines
    for quiet in (provision(tmp_path, "-q"), provision(tmp_path, json_out=True)):
        assert "provisioning 1 devices" not in quiet.stderr, quiet.stderr
        assert "KEEP ON THIS MACHINE ONLY" in quiet.stderr  # warnings stay
    assert json.loads(provision(tmp_path, json_out=True).stdout)["federation"] == "f1"
