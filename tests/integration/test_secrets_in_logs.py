"""No secret key material in any log: real HE federations (packed Paillier, mutual TLS) at maximum
verbosity, every byte of their output searched for every form of every secret they hold.

Runs:
* ``fedsdk -vv demo --strategy fedsdk --key-mode keyserver`` and ``... --key-mode shared``: the demo's own
  stdout/stderr (the coordinator and its embedded broker at DEBUG), and every file under ``W/logs/``
  (devices and key server, which the demo starts at INFO), the JSON summary and the coordinator's SQLite;
* the same federations again, each process started by hand at ``-vv`` from the demo's keys and
  certificates (``fedsdk -vv coordinator``, ``fedsdk -vv keyserver``, ``fedsdk -vv join``), so that the
  processes holding the secrets (the key server; the devices in key mode ``shared``) log at DEBUG too.

Secrets: the HE secret key file ``W/he/*/he_secret.bin`` (raw bytes, hex, base64) and the Paillier
numbers behind it, p, q, λ = lcm(p-1, q-1), μ = λ⁻¹ mod n, φ = (p-1)(q-1) and phe's CRT values
(decimal, hex, base64 of the big-endian bytes, Python's bytes repr; also a 24-character prefix of each, so a
truncated print is caught); every TLS private key ``W/pki/*.key`` (its PEM body lines, the DER bytes, the
EC private scalar) and the PEM marker ``PRIVATE KEY``. The search itself is checked against planted
secrets and against public material (which must not match). Secret files must be mode 0600.
"""

from __future__ import annotations

import base64
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedsdk.crypto import PaillierKeys, generate_backend
from fedsdk.hekeys import save_he
from fedsdk_coordinator.pki import make_dev_pki

pytestmark = pytest.mark.slow

CLIENTS = ["dev-00", "dev-01", "dev-02"]
FEDERATION = ["--model", "mlp16", "--key-bits", "1024", "--strategy", "fedsdk"]
ENV = dict(os.environ, PYTHONUNBUFFERED="1")
FEDSDK = [sys.executable, "-m", "fedsdk", "-vv"]
PREFIX = 24  # characters: 96 bits of hex, ~80 of decimal; a chance match in 10 MB of logs is ~1e-17


# -- the needles ------------------------------------------------------------------------------------
def _int_forms(name: str, value: int, *, prefixes: bool = True) -> dict[str, bytes]:
    raw = value.to_bytes((value.bit_length() + 7) // 8, "big")
    forms = {
        "dec": str(value),
        "hex": format(value, "x"),
        "HEX": format(value, "X"),
        "b64": base64.b64encode(raw).decode(),
        "repr": repr(raw)[2:-1],
    }
    out = {f"{name} {k}": v.encode() for k, v in forms.items()}
    if prefixes:
        out.update({f"{name} {k} prefix": v[:PREFIX].encode() for k, v in forms.items() if len(v) > PREFIX})
    return out


def paillier_needles(he_dir: Path) -> dict[str, bytes]:
    """Every form of the HE secret key in ``he_dir`` (Paillier 1999: λ, μ; phe's CRT precomputations)."""
    secret = (he_dir / "he_secret.bin").read_bytes()
    keys = PaillierKeys.from_bytes((he_dir / "he_public.bin").read_bytes(), secret)
    assert keys.primes is not None and keys.private_key is not None
    p, q = keys.primes
    n = p * q
    lam = (p - 1) * (q - 1) // math.gcd(p - 1, q - 1)
    sk = keys.private_key
    numbers = {
        "p": p,
        "q": q,
        "lambda": lam,
        "mu": pow(lam, -1, n),
        "phi": (p - 1) * (q - 1),
        "hp": int(sk.hp),
        "hq": int(sk.hq),
        "p_inverse": int(sk.p_inverse),
    }
    out = {"he_secret.bin raw": secret, "he_secret.bin hex": secret.hex().encode()}
    out["he_secret.bin b64"] = base64.b64encode(secret)
    for name, value in numbers.items():
        # φ = n - p - q + 1 and λ = φ/gcd(p-1, q-1) share their leading digits with the public n (and n/2):
        # only their full forms are secret.
        out.update(_int_forms(f"{he_dir.name}/{name}", value, prefixes=name not in ("phi", "lambda")))
    return out


def tls_needles(key_file: Path) -> dict[str, bytes]:
    """A PEM private key's body lines, its DER bytes and (EC keys) its private scalar."""
    pem = key_file.read_bytes()
    key = serialization.load_pem_private_key(pem, password=None)
    public = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    body = [ln for ln in pem.splitlines() if ln and not ln.startswith(b"-----")]
    # A PKCS#8 EC key ends with its public point: a body line (48 whole bytes) made only of it is public
    # and turns up in the key's certificate whenever the certificate's base64 happens to align with it.
    out = {
        f"{key_file.name} line {i}": ln
        for i, ln in enumerate(body)
        if len(ln) >= 20 and base64.b64decode(ln) not in public
    }
    der = base64.b64decode(b"".join(body))
    out[f"{key_file.name} der"] = der
    out[f"{key_file.name} der hex"] = der.hex().encode()
    if isinstance(key, ec.EllipticCurvePrivateKey):
        out.update(_int_forms(f"{key_file.name} scalar", key.private_numbers().private_value))
    return out


def needles_of(work: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {"PEM marker": b"PRIVATE KEY"}
    for secret in sorted(work.glob("he/*/he_secret.bin")):
        out.update(paillier_needles(secret.parent))
    for key_file in sorted(work.glob("pki/*.key")):
        out.update(tls_needles(key_file))
    return out


def find_leaks(haystacks: Mapping[str, bytes], needles: Mapping[str, bytes]) -> list[tuple[str, str]]:
    """Every (source, secret form) pair where the form occurs in the source's bytes."""
    return [(src, name) for src, text in haystacks.items() for name, nd in needles.items() if nd in text]


# -- the runs ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_demo(work: Path, key_mode: str) -> dict[str, bytes]:
    cmd = [*FEDSDK, "demo", *FEDERATION, "--key-mode", key_mode, "--clients", str(len(CLIENTS))]
    cmd += ["--rounds", "1", "--deadline", "60", "--workdir", str(work), "--json", str(work / "summary.json")]
    proc = subprocess.run(cmd, capture_output=True, timeout=300, env=ENV)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert b" DEBUG " in proc.stderr, "the demo did not log at DEBUG"
    texts = {f"demo {key_mode} stdout": proc.stdout, f"demo {key_mode} stderr": proc.stderr}
    for path in sorted((work / "logs").rglob("*")):
        if path.is_file():
            texts[str(path.relative_to(work))] = path.read_bytes()
    texts["summary.json"] = (work / "summary.json").read_bytes()
    texts["coordinator.sqlite"] = (work / "state" / "coordinator.sqlite").read_bytes()
    return texts


def _tls(work: Path, who: str) -> list[str]:
    pki = work / "pki"
    return ["--ca", str(pki / "ca.pem"), "--cert", str(pki / f"{who}.pem"), "--key", str(pki / f"{who}.key")]


def run_by_hand(work: Path, key_mode: str) -> dict[str, bytes]:
    """The demo's federation again, every process at -vv, from the demo's keys and certificates."""
    logs = work / "vv"
    logs.mkdir()
    port, http = _free_port(), _free_port()
    url = f"mqtts://127.0.0.1:{port}"
    coord = [*FEDSDK, "coordinator", "--listen", f"127.0.0.1:{port}", "--http", f"127.0.0.1:{http}"]
    coord += [*FEDERATION[:2], "--strategy", "fedsdk", "--key-mode", key_mode, "--clustering", "off"]
    coord += ["--rounds", "1", "--min-clients", "3", "--start-clients", "3", "--deadline", "60"]
    coord += [
        "--he",
        str(work / "he" / "coordinator"),
        "--state-dir",
        str(logs / "state"),
        "--exit-when-done",
    ]
    coord += [*_tls(work, "coordinator"), "--broker-cert", str(work / "pki" / "server.pem")]
    coord += ["--broker-key", str(work / "pki" / "server.key")]
    cmds = {"coordinator": coord}
    device_he = work / "he" / "device"
    if key_mode == "keyserver":
        cmds["keyserver"] = [
            *FEDSDK, "keyserver", url, "--he", str(work / "he" / "keyserver"), "--timeout", "120",
            *_tls(work, "keyserver"),
        ]  # fmt: skip
    for cid in CLIENTS:
        cmds[cid] = [
            *FEDSDK, "join", url, "--client-id", cid, "--data", str(work / "data" / f"{cid}.npz"),
            "--he", str(device_he), "--timeout", "120", *_tls(work, cid),
        ]  # fmt: skip
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, cmd in cmds.items():
            with open(logs / f"{name}.log", "wb") as out:
                procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV)
            if name == "coordinator":
                _wait_port(port, procs[name])
        for name in [*CLIENTS, "coordinator"]:
            assert _wait(procs, name, logs, 180) == 0, (logs / f"{name}.log").read_text()[-3000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    texts = {f"vv {key_mode} {p.name}": p.read_bytes() for p in sorted(logs.glob("*.log"))}
    for name, text in texts.items():
        assert b" DEBUG " in text, f"{name} did not log at DEBUG"
    return texts


def _wait(procs: dict[str, subprocess.Popen[bytes]], name: str, logs: Path, timeout: float) -> int:
    """``procs[name]``'s exit code; past ``timeout``, every process still running prints its threads' stacks
    (``kill -USR1``, :mod:`fedsdk.cli`) and the test fails with the tails of their logs."""
    try:
        return procs[name].wait(timeout)
    except subprocess.TimeoutExpired:
        alive = [n for n, p in procs.items() if p.poll() is None]
        for n in alive:
            procs[n].send_signal(signal.SIGUSR1)
        time.sleep(2)
        tails = {n: (logs / f"{n}.log").read_text(errors="replace")[-6000:] for n in procs}
        state = {n: "running" if n in alive else "exited" for n in procs}
        report = "\n".join(f"===== {n} ({state[n]})\n{t}" for n, t in tails.items())
        raise AssertionError(f"{name} stuck after {timeout:.0f} s (running: {alive})\n{report}") from None


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the coordinator exited during startup"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"the coordinator's broker did not listen on {port}")


@dataclass(frozen=True)
class Run:
    work: Path
    texts: dict[str, bytes]


@pytest.fixture(scope="module", params=["keyserver", "shared"])
def federation(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Run:
    work = tmp_path_factory.mktemp(f"secrets-{request.param}") / "w"
    texts = run_demo(work, request.param)
    texts.update(run_by_hand(work, request.param))
    return Run(work, texts)


# -- the tests --------------------------------------------------------------------------------------
def test_no_secret_in_any_log(federation: Run) -> None:
    work, texts = federation.work, federation.texts
    holders = sorted(p.parent.name for p in work.glob("he/*/he_secret.bin"))
    assert holders == (["keyserver"] if (work / "he" / "keyserver").exists() else ["device"])
    needles = needles_of(work)
    assert sum(1 for n in needles if n.endswith("scalar dec")) == len(list(work.glob("pki/*.key")))
    assert len(texts) >= 8 and sum(map(len, texts.values())) > 50_000, sorted(texts)
    assert find_leaks(texts, needles) == []


def test_secret_files_are_private(federation: Run) -> None:
    work = federation.work
    secrets = [*work.glob("he/*/he_secret.bin"), *work.glob("pki/*.key")]
    assert len(secrets) >= len(CLIENTS) + 3
    for path in secrets:
        assert path.stat().st_mode & 0o777 == 0o600, (path, oct(path.stat().st_mode))
    assert not (work / "he" / "coordinator" / "he_secret.bin").exists()


def test_search_finds_planted_secrets_and_spares_public_material(tmp_path: Path) -> None:
    with generate_backend("packed", key_bits=1024) as he:
        save_he(tmp_path / "he" / "device", he, include_secret=True)
    make_dev_pki(tmp_path / "pki", client_ids=["dev-00"])
    needles = needles_of(tmp_path)
    he_dir = tmp_path / "he" / "device"
    keys = PaillierKeys.from_bytes(
        (he_dir / "he_public.bin").read_bytes(), (he_dir / "he_secret.bin").read_bytes()
    )
    assert keys.primes is not None
    p, q = keys.primes
    secret = (he_dir / "he_secret.bin").read_bytes()
    pem_line = (tmp_path / "pki" / "dev-00.key").read_bytes().splitlines()[1]
    planted = {
        "p in decimal": f"DEBUG keys: p={p}".encode(),
        "q in hex, truncated": f"q=0x{q:x}"[:30].encode() + b"...",
        "lambda": f"lam {(p - 1) * (q - 1) // math.gcd(p - 1, q - 1)}".encode(),
        "secret file base64": b"blob " + base64.b64encode(secret),
        "secret file raw": b"\x00" + secret + b"\x00",
        "secret bytes repr": repr(secret).encode(),
        "PEM line": b"key material: " + pem_line,
        "PEM header": b"-----BEGIN PRIVATE KEY-----",
    }
    for name, text in planted.items():
        assert find_leaks({name: text}, needles), f"planted secret not found: {name}"
    public = {
        "n": str(int(keys.n)).encode() + format(int(keys.n), "x").encode(),
        "public key file": (he_dir / "he_public.bin").read_bytes(),
        "certificates": b"".join(p.read_bytes() for p in (tmp_path / "pki").glob("*.pem")),
    }
    for key_file in sorted((tmp_path / "pki").glob("*.key")):
        # The public key at every byte offset of a 64-column base64 text, as a certificate may place it.
        spki = (
            serialization.load_pem_private_key(key_file.read_bytes(), None)
            .public_key()
            .public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
        for pad in range(48):
            text = base64.b64encode(bytes(pad) + spki)
            public[f"{key_file.stem} public key at {pad}"] = b"\n".join(
                text[i : i + 64] for i in range(0, len(text), 64)
            )
    assert find_leaks(public, needles) == []
