"""The device package on its own: ``fedsdk join`` runs a protected federation in an environment that holds
only the device's dependencies, and imports nothing of the coordinator's, the benchmarks' or provisioning.

The environment is made from this interpreter's installed distributions without a download: the device's
six requirements (numpy, onnxruntime, phe, paho-mqtt, psutil, cryptography) and everything they require in
turn (their ``Requires-Dist``, extras left out) are linked into one directory, which with ``sdk/`` (the
``fedsdk`` package alone) is the whole import path of ``python -I -S``: no site-packages, no
``coordinator/`` or ``benchmarks/``, no gmpy2 (the pool then uses its process worker). That is what
``pip install numpy onnxruntime phe paho-mqtt psutil cryptography`` and a copy of ``sdk/`` give a Pi.

With ``FEDSDK_DEVICE_PYTHON`` naming another interpreter (an environment with the device's dependencies,
e.g. Python 3.10 or 3.13 with numpy 2), the devices run on it, from its own installed distributions
(``tests/device_site.py``), while the coordinator runs here: ``scripts/test_pythons.sh`` does so for each
Python it tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from brokers import MosquittoProcess
from device_site import build_site
from fedsdk.crypto import generate_backend
from fedsdk.hekeys import save_he
from fedsdk.model.data import load_digits, partition_iid, save_npz
from fedsdk_coordinator import CoordinatorConfig, RoundConfig, create_app
from fedsdk_coordinator.app import ENGINE

pytestmark = [pytest.mark.broker, pytest.mark.slow]

SDK = Path(__file__).resolve().parents[2] / "sdk"
# The devices' interpreter: this one, or another Python's environment with the device's dependencies
# (FEDSDK_DEVICE_PYTHON; scripts/test_pythons.sh runs this test so for each Python it tests).
DEVICE_PYTHON = os.environ.get("FEDSDK_DEVICE_PYTHON") or sys.executable
# Top-level modules a device must not import: the other two packages of the distribution, and what only
# they (or the optional extras) need.
NOT_ON_A_DEVICE = (
    "fedsdk_coordinator", "fedsdk_bench", "aiohttp", "sklearn", "scipy", "onnx", "torch", "amqtt",
    "tenseal", "matplotlib", "gmpy2", "prometheus_client",
)  # fmt: skip

DEVICE_CLI = {
    "fedsdk.cli._common",
    "fedsdk.cli._logging",
    "fedsdk.cli._progress",
    "fedsdk.cli.join",
    "fedsdk.cli.profile",
    "fedsdk.cli.bench",
}
DEVICE = """
import atexit, json, sys
site, sdk, out = sys.argv[1:4]
sys.path += [site, sdk]
atexit.register(lambda: json.dump(sorted(sys.modules), open(out, "w")))
from fedsdk.cli import main
sys.exit(main(sys.argv[4:]))
"""


def device_site(root: Path) -> Path:
    """The device's distributions linked into one folder (``tests/device_site.py``), from the device
    interpreter's own installation (:data:`DEVICE_PYTHON`)."""
    if DEVICE_PYTHON == sys.executable:
        return build_site(root)
    made = subprocess.run(
        [DEVICE_PYTHON, "-I", str(Path(__file__).parents[1] / "device_site.py"), str(root)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return Path(made.stdout.strip())


def device_python(*code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [DEVICE_PYTHON, "-I", "-S", "-c", *code], capture_output=True, text=True, timeout=120, check=False
    )


async def test_a_device_with_only_its_own_dependencies_runs_a_protected_federation(
    tmp_path: Path, broker: MosquittoProcess
) -> None:
    site = device_site(tmp_path)
    # The environment is what it claims: the device package imports, the rest is not there.
    probe = (
        f"import sys; sys.path += [{str(site)!r}, {str(SDK)!r}]\n"
        "import importlib.util as u, fedsdk.client, onnxruntime, phe, paho.mqtt, psutil, cryptography\n"
        f"print([m for m in {list(NOT_ON_A_DEVICE)!r} if u.find_spec(m) is not None])"
    )
    got = device_python(probe)
    assert got.returncode == 0 and got.stdout.strip() == "[]", got.stdout + got.stderr
    # The operator's commands and the benchmark harnesses say what to install, with the usage exit code.
    cli = f"import sys; sys.path += [{str(site)!r}, {str(SDK)!r}]\nfrom fedsdk.cli import main\n"
    cli += "sys.exit(main(sys.argv[1:]))"
    listed = device_python(cli, "--help")
    assert listed.returncode == 0 and "coordinator" in listed.stdout and "join" in listed.stdout, listed
    for words in (["coordinator", "--broker", "mqtt://x"], ["bench", "fleet"]):
        refused = device_python(cli, *words)
        assert refused.returncode == 2, refused
        assert "pip install 'fedsdk[coordinator]'" in refused.stderr, refused.stderr

    # 1024-bit keys keep the test short; which modules a device imports does not depend on the key size.
    with generate_backend("packed", key_bits=1024) as full:
        public = save_he(tmp_path / "he-public", full, include_secret=False)
        secret = save_he(tmp_path / "he-device", full, include_secret=True)
    digits = load_digits()
    part = partition_iid(digits.y_train, 3, seed=0)  # three: the fewest a masked sum holds by default
    fed = f"do{secrets.token_hex(3)}"
    config = CoordinatorConfig(
        rounds=RoundConfig(
            federation=fed, rounds=2, min_clients=3, start_clients=3, strategy="fedsdk", seed=1,
            deadline_s=60,
        ),
        state_dir=tmp_path / "state", model="mlp", broker_url=broker.url, insecure=True, he_dir=public,
    )  # fmt: skip
    procs: list[asyncio.subprocess.Process] = []
    async with TestClient(TestServer(create_app(config))) as http:
        engine = http.app[ENGINE]
        for i, idx in enumerate(part.indices):
            data = tmp_path / f"d{i}.npz"
            save_npz(data, digits.x_train[idx], digits.y_train[idx])
            args = [
                DEVICE, str(site), str(SDK), str(tmp_path / f"d{i}.mods"),
                "join", broker.url, "--insecure", "--client-id", f"d{i}", "--federation", fed,
                "--data", str(data), "--he", str(secret), "--timeout", "240",
                "--json", str(tmp_path / f"d{i}.json"),
            ]  # fmt: skip
            procs.append(
                await asyncio.create_subprocess_exec(
                    DEVICE_PYTHON,
                    "-I",
                    "-S",
                    "-c",
                    *args,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                )
            )
        outs = [await asyncio.wait_for(p.communicate(), 300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err.decode()[-3000:]
    assert engine.state == "finished" and engine.completed_round == 2, engine.detail
    for i in range(3):
        summary: dict[str, Any] = json.loads((tmp_path / f"d{i}.json").read_text())
        assert summary["state"] == "finished" and summary["applied_rounds"] == [1, 2], summary
        assert all(r["timings"]["encrypted_ratio"] > 0 for r in summary["rounds"]), summary["rounds"]
        modules = json.loads((tmp_path / f"d{i}.mods").read_text())
        assert "fedsdk.client" in modules and "fedsdk.crypto.packed" in modules
        assert "fedsdk.secagg.session" in modules  # every update went masked
        tops = {m.partition(".")[0] for m in modules}
        assert not tops & set(NOT_ON_A_DEVICE), sorted(tops & set(NOT_ON_A_DEVICE))
        assert {m for m in modules if m.startswith("fedsdk.cli.")} <= DEVICE_CLI, modules
