"""``examples/csv_sensor``: its README's commands, run as written, federate the spec on the CSV files.

The ```` ```sh ```` blocks of the README are the test's script, in order, so the README and what is tested
cannot drift apart. The only change made to them: the broker and dashboard ports (8883, 8080, in the
commands and in ``fleet.json``) become free ports, since other tests may hold the usual ones. The spec
snippets, the layer table and the example error lines of the README are checked against the files and
the code too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedsdk.errors import ConfigError
from fedsdk_coordinator.cli._coord import free_port
from fedsdk_coordinator.models import ModelSpec
from fedsdk_coordinator.models.source import load_model
from fedsdk_coordinator.models.specfile import LAYER_TYPES, layer_params

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "csv_sensor"
README = (EXAMPLE / "README.md").read_text(encoding="utf-8")
FLOOR = 0.8  # test accuracy of the exported models; chance is 1/3, the run scores about 0.89


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.DOTALL | re.MULTILINE)


def _env(bin_dir: Path) -> dict[str, str]:
    paths = [str(ROOT / d) for d in ("sdk", "coordinator")]
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]),
    }


def _shims(bin_dir: Path) -> None:
    """``python`` and ``fedsdk`` on PATH, both this interpreter (as in the venv the README assumes)."""
    bin_dir.mkdir()
    for name, command in (("python", f'"{sys.executable}"'), ("fedsdk", f'"{sys.executable}" -m fedsdk')):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        (bin_dir / name).chmod(0o755)


def _accuracy(model: Path, csv_path: Path) -> float:
    ort = pytest.importorskip("onnxruntime")
    table = np.loadtxt(csv_path, delimiter=",", skiprows=1, dtype=np.float32)
    header = csv_path.read_text(encoding="utf-8").splitlines()[0].split(",")
    label = header.index("state")
    x, y = np.delete(table, label, axis=1), table[:, label].astype(np.int64)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    logits = session.run(None, {session.get_inputs()[0].name: x})[0]
    return float((logits.argmax(axis=1) == y).mean())


def test_the_readme_commands_train_the_spec_on_the_csv_files_and_export_models_that_score(
    tmp_path: Path,
) -> None:
    script = "\n".join(blocks("sh"))
    for needle in ("--model sensor.json", "fedsdk join", "--label-column state", "--save-model", "provision"):
        assert needle in script, needle
    work = tmp_path / "csv_sensor"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("data", "fleet", "state", "models", "logs"))
    broker, http = free_port(), free_port()
    assert "127.0.0.1:8080" in script  # the broker's port is the fleet file's, below
    script = script.replace("127.0.0.1:8080", f"127.0.0.1:{http}")
    fleet = json.loads((work / "fleet.json").read_text())
    fleet["broker"]["port"], fleet["coordinator"]["http_port"] = broker, http
    (work / "fleet.json").write_text(json.dumps(fleet))
    _shims(tmp_path / "bin")
    proc = subprocess.Popen(
        ["bash", "-c", "set -euo pipefail\n" + script],
        cwd=work,
        env=_env(tmp_path / "bin"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the coordinator and devices it starts share its process group
    )
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the script left running
        except ProcessLookupError:
            pass
    logs = work / "logs"
    coordinator_log = (logs / "coordinator.log").read_text() if (logs / "coordinator.log").exists() else ""
    assert proc.returncode == 0, out[-3000:] + coordinator_log[-3000:]
    assert "federation finished after round 8" in coordinator_log, coordinator_log[-3000:]
    for k in ("01", "02", "03"):
        log = (logs / f"pi-{k}.log").read_text()
        assert f"pi-{k}: finished after 8 rounds applied" in log, log[-2000:]
        accuracy = _accuracy(work / "models" / f"pi-{k}.onnx", work / "data" / "test.csv")
        assert accuracy >= FLOOR, (k, accuracy)
    scored = re.search(r"models/pi-01\.onnx: accuracy ([0-9.]+) on 300 samples", out)
    assert scored is not None and float(scored.group(1)) >= FLOOR, out[-2000:]
    # the generated data stays small: a few hundred rows
    assert sum(p.stat().st_size for p in (work / "data").iterdir()) < 100_000


def test_the_json_and_toml_specs_are_the_model_the_readme_shows() -> None:
    from_json = load_model(str(EXAMPLE / "sensor.json")).bundle
    from_toml = load_model(str(EXAMPLE / "sensor.toml")).bundle
    assert from_json.model_id == from_toml.model_id
    (json_block,), (toml_block,) = blocks("json"), blocks("toml")
    import tomllib

    spec = ModelSpec.from_dict(json.loads((EXAMPLE / "sensor.json").read_text()))
    assert ModelSpec.from_dict(json.loads(json_block)) == spec
    assert ModelSpec.from_dict(tomllib.loads(toml_block)) == spec
    assert ModelSpec.from_dict(tomllib.loads((EXAMPLE / "sensor.toml").read_text())) == spec
    assert spec.input_shape == (12,) and spec.num_classes == 3


def test_the_readme_layer_table_is_what_the_loader_accepts() -> None:
    rows = re.findall(r"^\| `(\w+)` \| (.*?) \| (.*?) \|$", README, flags=re.MULTILINE)
    table = {kind: (required, optional) for kind, required, optional in rows if kind != "type"}
    assert sorted(table) == sorted(LAYER_TYPES)
    for kind, (required, optional) in table.items():
        params = layer_params(kind)
        want_required = ", ".join(f"`{p.name}`" for p in params if p.required) or "—"
        want_optional = ", ".join(f"`{p.name} = {p.default_text()}`" for p in params if not p.required) or "—"
        assert (required, optional) == (want_required, want_optional), kind


def test_the_readme_error_lines_are_what_the_loader_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shown = [
        line.removeprefix("fedsdk: ") for line in re.findall(r"^fedsdk: .*$", README, flags=re.MULTILINE)
    ]
    assert len(shown) == 2, shown
    monkeypatch.chdir(tmp_path)
    toml = (EXAMPLE / "sensor.toml").read_text()
    last = toml.rindex("in_features = 16")
    Path("sensor.toml").write_text(
        toml[:last] + toml[last:].replace("in_features", "in").replace("out_features", "out")
    )
    spec = json.loads((EXAMPLE / "sensor.json").read_text())
    spec["layers"][0]["in_features"] = 13
    Path("sensor.json").write_text(json.dumps(spec))
    for name, line in zip(("sensor.toml", "sensor.json"), shown, strict=True):
        with pytest.raises(ConfigError) as info:
            load_model(name)
        assert str(info.value) == line
