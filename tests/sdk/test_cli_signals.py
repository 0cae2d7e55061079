"""``fedsdk coordinator``, ``keyserver`` and ``demo`` stopped by SIGINT or SIGTERM: a clean shutdown and exit
code 130 (README, "Exit codes"), as ``fedsdk join`` does.

Each command is started the way a script starts it in the background, ``bash -c 'fedsdk ... & wait'``: a
shell without job control starts a background command with SIGINT ignored, and Python keeps it ignored
unless the command installs its own handler, so ``kill -INT`` did nothing. SIGTERM killed the process
without any cleanup (exit 143), and multiprocessing's resource tracker then reported the HE process
pool's semaphores as leaked. The checks: exit 130 within a bound, and on stderr no "leaked semaphore"
(stderr is read to its end, which comes only when every process holding it, the resource tracker
included, has exited).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from brokers import MosquittoProcess
from fedsdk.crypto import generate_backend
from fedsdk.hekeys import save_he
from fedsdk_coordinator.cli._coord import free_port

pytestmark = pytest.mark.timeout(120)

BACKGROUND = '"$@" & echo "pid $!"; wait $!'  # bash -c has no job control, as in any script


def _keys(tmp: Path) -> dict[str, Path]:
    with generate_backend("packed", key_bits=1024) as he:
        return {
            "public": save_he(tmp / "he-public", he, include_secret=False),
            "secret": save_he(tmp / "he-secret", he, include_secret=True),
        }


def _stop_in_background(
    cmd: list[str], ready: str, sig: signal.Signals, tmp: Path, group: list[int] | None = None
) -> tuple[int, str, str]:
    """Start ``cmd`` in the background of a non-interactive bash, wait for ``ready`` on its stdout, send
    ``sig`` to it (not to bash); returns bash's exit status (= the command's), stdout and all of stderr.
    ``group`` receives the process group id of bash and everything it started."""
    out_file = tmp / f"stdout-{sig.name}.txt"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(out_file, "wb") as out:
        shell = subprocess.Popen(
            ["bash", "-c", BACKGROUND, "bash", *cmd],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,  # a process group of its own, killed whole if the test fails
        )
    if group is not None:
        group.append(shell.pid)
    pid = None
    done = False
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            text = out_file.read_text(errors="replace")
            if pid is None and text.startswith("pid "):
                pid = int(text.split()[1])
            if ready in text:
                break
            assert shell.poll() is None, (
                shell.returncode,
                text,
                shell.stderr.read().decode() if shell.stderr else "",
            )
            time.sleep(0.1)
        else:
            pytest.fail(f"{ready!r} not printed in 60 s:\n{out_file.read_text(errors='replace')}")
        assert pid is not None
        os.kill(pid, sig)
        try:
            _, err = shell.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 30 s after {sig.name}:\n{out_file.read_text(errors='replace')}")
        done = True
        return shell.returncode, out_file.read_text(errors="replace"), err.decode(errors="replace")
    finally:
        if not done:  # the command did not stop: end its whole process group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(shell.pid, signal.SIGKILL)
            shell.communicate()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_the_coordinator_stops_cleanly_with_exit_130(sig: signal.Signals, tmp_path: Path) -> None:
    keys = _keys(tmp_path)
    cmd = [
        sys.executable, "-m", "fedsdk", "coordinator", "--strategy", "fedsdk", "--he", str(keys["public"]),
        "--state-dir", str(tmp_path / "state"), "--listen", f"127.0.0.1:{free_port()}",
        "--http", f"127.0.0.1:{free_port()}",
    ]  # fmt: skip
    code, out, err = _stop_in_background(cmd, "coordinator up", sig, tmp_path)
    assert code == 130, (code, out[-2000:], err[-3000:])
    assert "leaked semaphore" not in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert f"{sig.name} received, shutting down" in err, err[-3000:]


@pytest.mark.broker
def test_the_keyserver_stops_on_sigint_in_the_background(mosquitto: MosquittoProcess, tmp_path: Path) -> None:
    keys = _keys(tmp_path)
    cmd = [
        sys.executable,
        "-m",
        "fedsdk",
        "keyserver",
        mosquitto.url,
        "--he",
        str(keys["secret"]),
        "--insecure",
    ]
    code, out, err = _stop_in_background(cmd, "key server up", signal.SIGINT, tmp_path)
    assert code == 130, (code, out[-2000:], err[-3000:])
    assert "Traceback" not in err, err[-3000:]


def _group_gone(pgid: int, timeout: float = 10.0) -> bool:
    """Whether every process of group ``pgid`` has exited (and been reaped) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_the_demo_stops_its_devices_on_sigterm(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "fedsdk", "demo", "--clients", "2", "--rounds", "200",
        "--strategy", "plaintext", "--secagg", "off",
        "--insecure", "--workdir", str(tmp_path / "demo"), "--json", str(tmp_path / "demo.json"),
    ]  # fmt: skip
    group: list[int] = []
    code, out, err = _stop_in_background(cmd, "round 1/200", signal.SIGTERM, tmp_path, group)
    assert code == 130, (code, out[-2000:], err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert _group_gone(group[0]), "a device process outlived the demo"
