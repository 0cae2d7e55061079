"""The README and the docs, read as a newcomer reads them: every command shown runs as written, every link
leads somewhere, and the pages stay short enough to read.

How commands are found and run: ``tests/docs_commands.py``. Each shell block of the docs is registered below:
in a scenario this test runs (blocks pasted in order into one shell, in an empty folder that sees the
repository's files by the same relative paths), as run by another named test, or as typed on another
machine (a Raspberry Pi over ssh), with the reason. A block that is in none of them fails the test: a new
command in the docs needs a test.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from docs_commands import (
    ROOT,
    Block,
    blocks,
    commands,
    doc_files,
    dry_parse,
    inline_commands,
    parse_targets,
    plain_block_commands,
)
from docs_commands import script as make_script

README_MAX_LINES = 160
CELL_MAX_WORDS = 60

# Scenarios: blocks run in order in one shell, as a reader pastes them top to bottom.
CERTS = "certs/README.md#certs-fleet-certificates-broker-configuration-and-acls"
SCENARIOS: dict[str, list[str]] = {
    "readme-demo": ["README.md#two-commands"],
    "readme-model-and-fleet": ["README.md#your-model-on-your-data", "README.md#a-fleet"],
    "fleet-folder-and-mosquitto": [
        "setup#example-fleet",
        CERTS,
        "certs/README.md#mosquitto-tested-mosquitto-2011-testsintegrationtestaclpy",
    ],
    "fleet-folder-and-embedded-broker": [
        "setup#example-fleet",
        CERTS,
        "certs/README.md#embedded-broker-amqtt-small-fleets",
    ],
    "operations": [
        "setup#example-fleet",
        "docs/operations.md#provisioning-a-fleet",
        "docs/operations.md#adding-a-device",
        "docs/operations.md#removing-a-device",
    ],
}
# What a reader does by hand before a scenario's blocks ("write a fleet file, start from the example").
SETUP = {"setup#example-fleet": "sed 's/8883/8883/' certs/fleet.example.json > fleet.json\n"}
# What a scenario leaves out of a block, because the test's own environment already did it: the install
# (the suite runs in the venv scripts/test.sh made with the same extras; installing again from a temporary
# folder would repoint that venv's editable install).
LEFT_OUT = {
    "README.md#two-commands": "python3 -m venv .venv && .venv/bin/pip install -e '.[coordinator]' && "
}

# Blocks run by another test: key -> "tests/<file>.py::<test function>", or ".ci/run" for the test command.
ELSEWHERE: dict[str, str] = {
    "README.md#two-commands:2": ".ci/run",
    **{
        f"examples/csv_sensor/README.md#run-it{n}": "tests/examples/test_csv_sensor.py::"
        "test_the_readme_commands_train_the_spec_on_the_csv_files_and_export_models_that_score"
        for n in ("", ":2", ":3")
    },
}

OWN_MODEL = (  # the same steps without torch, which the suite does not install (model.py needs it)
    "tests/integration/test_own_model.py::test_csv_devices_on_the_command_line_save_models_that_plain_"
    "onnxruntime_scores"
)
ELSEWHERE.update(
    {
        "docs/operations.md#provisioning-a-fleet:2": "tests/integration/test_acl.py::"
        "test_a_federation_runs_from_the_kits_alone",
        "docs/scale.md#run-it": "tests/integration/test_cluster_aggregation.py::"
        "test_the_documented_commands_bring_up_a_cluster_and_its_workers",
        "docs/training.md#your-own-model": "tests/integration/test_own_model.py::"
        "test_a_federation_trains_an_imported_onnx_classifier",
        "examples/own_model/README.md#your-own-model-on-your-own-data": OWN_MODEL,
        **{f"examples/own_model/README.md#step-by-step{n}": OWN_MODEL for n in ("", ":2", ":3", ":4", ":5")},
    }
)

# Blocks typed on another machine, with the reason this machine cannot run them as written.
PI = "on the Raspberry Pi (examples/raspberry_pi/verify_arm64.sh runs it on an emulated arm64 Pi, as root)"
PHONE = "in Termux on the phone (tests/examples/test_examples.py installs a host kit the same way)"
ELSEWHERE_MACHINE: dict[str, str] = {
    "docs/scale.md#run-it:2": "on each broker host and aggregation machine of a fleet",
    "docs/operations.md#provisioning-a-fleet:3": "copies a kit to a device over ssh",
    "certs/README.md#mosquitto-tested-mosquitto-2011-testsintegrationtestaclpy:2": "installs into /etc of a "
    "broker host; tests/integration/test_broker_in_place.py runs the same configuration in place",
    "examples/raspberry_pi/README.md#from-a-fresh-sd-card-to-a-joined-device": "downloads the arm64 wheels "
    "for the kits (verify_arm64.sh does, as root); the suite builds --platform host kits",
    "examples/raspberry_pi/README.md#from-a-fresh-sd-card-to-a-joined-device:2": "copies the kit to the Pi",
    "examples/raspberry_pi/README.md#from-a-fresh-sd-card-to-a-joined-device:3": PI,
    "examples/raspberry_pi/README.md#the-service": PI,
    "examples/android_termux/README.md#install": "downloads the phone's wheels for the kits; the suite "
    "builds --platform host kits (tests/examples/test_examples.py)",
    "examples/android_termux/README.md#install:2": "copies the kit to the phone",
    "examples/android_termux/README.md#install:3": PHONE,
}


def _all_blocks() -> list[Block]:
    return blocks()


def test_every_shell_block_is_run_by_a_test() -> None:
    keys = {b.key for b in _all_blocks()}
    registered = {k for parts in SCENARIOS.values() for k in parts if k not in SETUP}
    registered |= set(ELSEWHERE) | set(ELSEWHERE_MACHINE)
    missing = sorted(keys - registered)
    stale = sorted(registered - keys)
    assert not missing, f"shell blocks no test runs (register them in tests/test_docs.py): {missing}"
    assert not stale, f"registered blocks that no longer exist in the docs: {stale}"


@pytest.mark.parametrize("key,test", sorted(ELSEWHERE.items()))
def test_blocks_run_elsewhere_name_a_real_test(key: str, test: str) -> None:
    if test == ".ci/run":  # CI runs the README's test command itself
        block = next(b for b in _all_blocks() if b.key == key)
        assert block.text.strip() in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
        return
    path, _, name = test.partition("::")
    source = (ROOT / path).read_text(encoding="utf-8")
    assert re.search(rf"^(async )?def {re.escape(name)}\(", source, re.M), f"{key}: {test} does not exist"


def test_every_documented_command_parses() -> None:
    items: list[tuple[list[str], bool, str]] = []
    where: list[str] = []
    for b in _all_blocks():
        for command in commands(b.text):
            for argv in parse_targets(command):
                items.append((argv, False, str((ROOT / b.file).parent)))
                where.append(f"{b.file}:{b.line}: {command.splitlines()[0][:120]}")
    for file, line, command in plain_block_commands():  # reproduce lines with placeholders (--seed S)
        for argv in parse_targets(command):
            items.append((argv, True, str((ROOT / file).parent)))
            where.append(f"{file}:{line}: {command[:120]}")
    for file, line, command in inline_commands():
        for argv in parse_targets(command):
            items.append((argv, True, str((ROOT / file).parent)))
            where.append(f"{file}:{line}: `{command[:120]}`")
    assert len(items) > 50
    failures = [f"{w}\n    {err}" for w, err in zip(where, dry_parse(items)) if err]
    assert not failures, "documented commands their own parser refuses:\n" + "\n".join(failures)


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    from docs_commands import slug

    found, in_fence = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def test_every_relative_link_resolves() -> None:
    broken = []
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        for target in _LINK.findall(text):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_readme_code_is_the_example_that_runs() -> None:
    """The README's Python is an excerpt of examples/embed/app.py, which the fleet scenario runs."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    app = (ROOT / "examples" / "embed" / "app.py").read_text(encoding="utf-8")
    app_lines = [line.strip() for line in app.splitlines()]
    snippets = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert snippets
    for snippet in snippets:
        lines = [line.strip() for line in snippet.strip().splitlines()]
        starts = [i for i, line in enumerate(app_lines) if line == lines[0]]
        assert any(app_lines[i : i + len(lines)] == lines for i in starts), (
            f"not in examples/embed/app.py:\n{snippet}"
        )


def test_readme_fits_on_a_few_screens() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_no_table_cell_is_an_essay() -> None:
    long = []
    for path in doc_files():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith("|"):
                for cell in line.strip().strip("|").split("|"):
                    if len(cell.split()) > CELL_MAX_WORDS:
                        long.append(f"{path.relative_to(ROOT)}:{n}: {len(cell.split())} words")
    assert not long, f"table cells over {CELL_MAX_WORDS} words:\n" + "\n".join(long)


def test_commands_of_a_block_are_what_a_shell_runs() -> None:
    text = "fedsdk a \\\n    --b c &   \n# a comment\n\ncat > f.json <<'EOF'\n{\"x\": 1}\nEOF\nnext\n"
    assert commands(text) == ["fedsdk a --b c &", "cat > f.json <<'EOF'\n{\"x\": 1}\nEOF", "next"]
    assert parse_targets("fedsdk join --kit k > log 2>&1 &") == [["-m", "fedsdk", "join", "--kit", "k"]]
    assert parse_targets("python3 -m venv .venv && .venv/bin/fedsdk demo --clients 4") == [
        ["-m", "fedsdk", "demo", "--clients", "4"]
    ]
    # a renamed option fails the parse check: the check can fail
    assert dry_parse([(["-m", "fedsdk", "demo", "--clientz", "4"], False, str(ROOT))])[0]
    assert dry_parse([(["-m", "fedsdk", "join", "--self-audit"], True, str(ROOT))]) == [""]


# -- scenarios -------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _workdir(tmp: Path, substitutions: dict[str, str]) -> Path:
    """An empty folder that sees the repository's files under the same relative paths, as a reader's clone
    does, while what the commands write stays in it. ``examples/`` is a copy whose JSON files (the example
    fleets) get the same port substitutions as the commands."""
    work = tmp / "clone"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name.startswith(".") or not (entry.is_dir() or entry.suffix in {".toml", ".md"}):
            continue
        if entry.name == "examples":
            shutil.copytree(
                entry, work / entry.name, ignore=shutil.ignore_patterns("run", "data", "__pycache__")
            )
            for path in (work / entry.name).rglob("*.json"):
                text = path.read_text(encoding="utf-8")
                for old, new in substitutions.items():
                    text = text.replace(old, new) if old != "http" else text
                path.write_text(text, encoding="utf-8")
        elif entry.name not in {"fleet", "data", "results", "sensors", "lab"}:
            (work / entry.name).symlink_to(entry)
    return work


def run_scenario(name: str, tmp: Path, timeout: float = 600) -> tuple[Path, subprocess.CompletedProcess[str]]:
    by_key = {b.key: b for b in _all_blocks()}
    by_key.update({k: Block("setup", k, 1, text, 0) for k, text in SETUP.items()})
    parts = []
    for key in SCENARIOS[name]:
        block = by_key[key]
        if key in LEFT_OUT:
            assert LEFT_OUT[key] in block.text, f"{key} no longer starts with {LEFT_OUT[key]!r}"
            block = dataclasses.replace(block, text=block.text.replace(LEFT_OUT[key], ""))
        parts.append(block)
    http = _free_port()
    substitutions = {
        ".venv/bin/": "",
        "8883": str(_free_port()),
        "8080": str(http),
        "http": f"127.0.0.1:{http}",
    }
    work = _workdir(tmp, substitutions)
    text = make_script(parts, substitutions)
    (work / "scenario.sh").write_text(text)
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}
    if shutil.which("mosquitto") is None and Path("/usr/sbin/mosquitto").exists():
        env["PATH"] += os.pathsep + "/usr/sbin"
    proc = subprocess.run(
        ["bash", "scenario.sh"], cwd=work, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"{name} exited {proc.returncode}\n{text}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    )
    return work, proc


def test_the_demo_runs_as_the_readme_writes_it(tmp_path: Path) -> None:
    _, proc = run_scenario("readme-demo", tmp_path)
    assert "final accuracy" in proc.stdout.lower() or "accuracy" in proc.stdout, proc.stdout[-3000:]


def test_a_newcomer_runs_the_readme_model_and_fleet_sections_top_to_bottom(tmp_path: Path) -> None:
    """The spec on CSV files with the embedded broker, then the same model on a mosquitto fleet with one
    device embedded in an app, pasted in order into one shell; every process must exit 0."""
    if shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists():
        pytest.fail("mosquitto is not installed (bash scripts/test.sh installs it)")
    work, proc = run_scenario("readme-model-and-fleet", tmp_path)
    assert "accuracy" in proc.stdout and (work / "pi-01.onnx").is_file(), proc.stdout[-3000:]
    assert "pi-03: finished" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize(
    "name", ["fleet-folder-and-mosquitto", "fleet-folder-and-embedded-broker", "operations"]
)
def test_the_operators_commands_run_as_the_docs_write_them(name: str, tmp_path: Path) -> None:
    if (
        name.endswith("mosquitto")
        and shutil.which("mosquitto") is None
        and not Path("/usr/sbin/mosquitto").exists()
    ):
        pytest.fail("mosquitto is not installed (bash scripts/test.sh installs it)")
    work, _ = run_scenario(name, tmp_path)
    assert (work / "fleet" / "devices" / "pi-04" / "fedsdk.json").is_file()  # added
    assert not (work / "fleet" / "devices" / "pi-02").exists()  # revoked
