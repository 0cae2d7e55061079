"""What an operator sees at the console, from real processes: ``fedsdk demo``, and ``fedsdk coordinator`` with
three ``fedsdk join`` devices on a real mosquitto (the fewest a sum may hold by default), under the protected
strategy (every update encrypted and masked).

At default verbosity the coordinator and every device print one line per round, and nothing comes from the
libraries (amqtt, transitions); at ``-vv`` the embedded amqtt broker's lines do appear, so the check of their
absence can fail."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from brokers import require_mosquitto, start_mosquitto
from fedsdk.crypto import generate_backend
from fedsdk.hekeys import save_he
from fedsdk.model.data import load_digits, partition_iid, save_npz
from fedsdk_coordinator.cli._coord import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

FEDSDK = [sys.executable, "-m", "fedsdk"]
ENV = dict(os.environ, PYTHONUNBUFFERED="1")
LIBRARIES = re.compile(r"(DEBUG|INFO) (amqtt|transitions)\b")  # a library's record below WARNING
CLOCK = r"^\d\d:\d\d:\d\d "  # a progress line at default verbosity: the time, then the message
ROUNDS = 2


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FEDSDK, *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def lines(text: str, pattern: str) -> list[str]:
    return [ln for ln in text.splitlines() if re.search(pattern, ln)]


def demo(tmp_path: Path, *verbosity: str) -> subprocess.CompletedProcess[str]:
    tmp_path.mkdir(exist_ok=True)
    out = run(
        *verbosity, "demo", "--clients", "3", "--rounds", str(ROUNDS), "--epochs", "1", "--key-bits", "1024",
        "--model", "mlp16", "--workdir", str(tmp_path / "work"), "--json", str(tmp_path / "summary.json"),
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return out


def test_the_demo_prints_one_line_per_round_and_nothing_from_the_libraries(tmp_path: Path) -> None:
    out = demo(tmp_path)
    per_round = lines(
        out.stdout, r"^round \d+/2 cluster \d+: done, accuracy 0\.\d+, 3 updates, encrypted 100"
    )
    assert [ln.split()[1] for ln in per_round] == ["1/2", "2/2"], out.stdout
    # the engine's own line for the same rounds is not printed beside the demo's
    assert not lines(out.stdout + out.stderr, r"updates, federated accuracy"), out.stderr
    assert not LIBRARIES.search(out.stdout + out.stderr), (out.stdout + out.stderr)[-3000:]
    keygen = lines(out.stderr, CLOCK + r"HE key generation \(packed, 1024 bits\)")
    assert len(keygen) == 2 and keygen[-1].split(": done in ")[1].endswith(" s"), out.stderr
    # the devices' logs (the demo runs them with -v): the one line per round, and no library detail either
    log = (tmp_path / "work" / "logs" / "dev-00.log").read_text()
    assert len(lines(log, r"fedsdk.progress: round \d+/2 cluster \d+: model applied")) == ROUNDS, log
    assert not LIBRARIES.search(log), log[-3000:]


def test_the_demo_at_v_shows_fedsdk_detail_and_at_vv_the_embedded_brokers_lines(tmp_path: Path) -> None:
    out = demo(tmp_path / "v", "-v")
    assert re.search(r"INFO fedsdk_coordinator\.rounds: ", out.stderr), out.stderr[-3000:]
    assert not LIBRARIES.search(out.stdout + out.stderr), out.stderr[-3000:]
    out = demo(tmp_path / "vv", "-vv")
    assert re.search(r"DEBUG amqtt\.", out.stderr), out.stderr[-3000:]
    assert re.search(r" transitions\.", out.stderr), out.stderr[-3000:]


def _fleet_files(tmp: Path) -> tuple[dict[str, Path], Path, Path]:
    """Three devices' data and held-out data, and the HE key folders: public (coordinator), shared."""
    digits = load_digits(shape="flat")
    part = partition_iid(digits.y_train, 3, seed=0)
    files = {}
    for i, idx in enumerate(part.indices):
        files[f"d{i}"] = tmp / f"d{i}.npz"
        save_npz(files[f"d{i}"], digits.x_train[idx], digits.y_train[idx])
    save_npz(tmp / "eval.npz", digits.x_test, digits.y_test)
    with generate_backend("packed", key_bits=1024) as he:
        public = save_he(tmp / "he-coordinator", he, include_secret=False)
        shared = save_he(tmp / "he-device", he, include_secret=True)
    return files, public, shared


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*FEDSDK, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )


def join(url: str, fed: str, cid: str, data: Path, eval_data: Path, he: Path) -> subprocess.Popen[str]:
    return start(
        "join", url, "--insecure", "--client-id", cid, "--federation", fed, "--data", str(data),
        "--eval-data", str(eval_data), "--he", str(he), "--timeout", "120",
        "--json", str(data.with_suffix(".summary.json")),
    )  # fmt: skip


# devices with held-out data personalise by default (5 epochs): both lines show the personal figure
COORDINATOR_LINE = (
    CLOCK + r"round \d/2 cluster \d+: 3 updates, federated accuracy 0\.\d+ .*, personal accuracy [\d.]+.*"
    r"100% encrypted"
)
DEVICE_LINE = (
    CLOCK + r"round \d/2 cluster \d+: model applied, held-out accuracy 0\.\d+, "
    r"personal [\d.]+ \(uses the (personal|cluster) model\), update 100% encrypted \(\d+ bytes\), [\d.]+ s"
)


@pytest.mark.broker
def test_coordinator_and_devices_print_one_line_per_round(tmp_path: Path) -> None:
    require_mosquitto()
    files, public, shared = _fleet_files(tmp_path)
    fed = f"cli{secrets.token_hex(3)}"
    with start_mosquitto(tmp_path / "mosq") as broker:
        coord = start(
            "coordinator", "--broker", broker.url, "--insecure", "--federation", fed,
            "--rounds", str(ROUNDS), "--min-clients", "3", "--start-clients", "3", "--model", "mlp16",
            "--epochs", "1", "--strategy", "fedsdk", "--he", str(public), "--exit-when-done",
            "--state-dir", str(tmp_path / "state"), "--http", f"127.0.0.1:{free_port()}",
        )  # fmt: skip
        devices = {
            cid: join(broker.url, fed, cid, data, tmp_path / "eval.npz", shared)
            for cid, data in files.items()
        }
        try:
            outs = {cid: p.communicate(timeout=150) for cid, p in devices.items()}
            c_out, c_err = coord.communicate(timeout=60)
        finally:
            for p in (coord, *devices.values()):
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert coord.returncode == 0, (c_out + c_err)[-3000:]
    per_round = lines(c_err, COORDINATOR_LINE)
    assert [ln.split()[2] for ln in per_round] == ["1/2", "2/2"], c_err[-3000:]
    for cid, (out, err) in outs.items():
        assert devices[cid].returncode == 0, (out + err)[-3000:]
        per_round = lines(err, DEVICE_LINE)
        assert [ln.split()[2] for ln in per_round] == ["1/2", "2/2"], err[-3000:]
        summary = json.loads(files[cid].with_suffix(".summary.json").read_text())
        assert set(summary["personal_accuracy"]) == set(summary["uses_personal"]) == {"1", "2"}
        assert all(summary["personal_accuracy"][r] >= summary["accuracy"][r] for r in ("1", "2"))
    for text in (c_out, c_err, *(o + e for o, e in outs.values())):
        assert not LIBRARIES.search(text), text[-3000:]
        # progress lines, warnings and the commands' own output only: no fedsdk detail by default
        assert not re.search(r" (DEBUG|INFO) fedsdk", text), text[-3000:]
