"""``--kit`` and the options that override it, for ``fedsdk join``, ``fedsdk coordinator`` and ``fedsdk
keyserver``: each option given replaces its own item and nothing else (the others still come from the kit),
and a path given that does not exist is refused with the option's name (exit 2). Also the device's start-up
check that its certificate is issued to its client id (:func:`fedsdk.transport.check_client_identity`).
No broker here: tests/integration/test_join_identity.py runs these against mosquitto and the embedded
broker."""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedsdk.cli import _parser, main
from fedsdk.cli.join import settings
from fedsdk.client import FedClient
from fedsdk.errors import ConfigError, IdentityMismatch
from fedsdk.files import write_private
from fedsdk.hekeys import load_he
from fedsdk.model.data import save_npz
from fedsdk.transport import TlsConfig, certificate_identity, check_client_identity
from fedsdk_coordinator.cli.coordinator import _apply_kit as coordinator_kit
from fedsdk_coordinator.cli.keyserver import _apply_kit as keyserver_kit
from fedsdk_coordinator.provision import fleet_from_mapping, load_kit, provision

FED = "kitfed"


def _provision(root: Path, federation: str) -> Path:
    fleet = {
        "federation": federation,
        "devices": ["a", "b"],
        "coordinator": {"host": "127.0.0.1"},
        "broker": {"hosts": ["127.0.0.1"], "port": 1},  # nothing listens: these tests never connect
        "key_mode": "keyserver",
        "he": {"backend": "packed", "options": {"key_bits": 1024}},
    }
    provision(fleet_from_mapping(fleet), root)
    return root


class Files:
    """A provisioned fleet, and files that may replace a kit's: copies of device a's CA, certificate and
    key at other paths, device b's certificate and key, and the HE key folder of another federation."""

    def __init__(self, tmp: Path) -> None:
        self.fleet = _provision(tmp / "fleet", FED)
        other = _provision(tmp / "other", "otherfed")
        a = self.fleet / "devices" / "a"
        self.copies = tmp / "copies"
        self.copies.mkdir()
        self.ca = str(shutil.copy(a / "ca.pem", self.copies / "ca-copy.pem"))
        self.cert = str(shutil.copy(a / "client.pem", self.copies / "a-copy.pem"))
        self.key = str(write_private(self.copies / "a-copy.key", (a / "client.key").read_bytes()))
        self.b_cert = str(self.fleet / "devices" / "b" / "client.pem")
        self.b_key = str(self.fleet / "devices" / "b" / "client.key")
        self.other_he = str(other / "devices" / "a" / "he")
        self.data = tmp / "d.npz"
        save_npz(self.data, np.zeros((4, 64), np.float32), np.arange(4) % 10)

    def kit(self, name: str) -> str:
        return str(self.fleet / ("devices/" + name if name in ("a", "b") else name))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return Files(tmp_path_factory.mktemp("kits"))


def parse(command: str, *words: str) -> argparse.Namespace:
    return _parser(command).parse_args([command, *words])


# -- each option given replaces its own item only ---------------------------------------------------------
def join_items(*words: str, files: Files) -> dict[str, Any]:
    s = settings(parse("join", "--kit", files.kit("a"), "--data", str(files.data), *words))
    assert s.tls is not None
    return {
        "broker": s.broker,
        "client_id": s.client_id,
        "federation": s.federation,
        "ca": s.tls.ca_file,
        "cert": s.tls.cert_file,
        "key": s.tls.key_file,
        "he": s.he_dir,
    }


# option words -> {item: the value it must take}; "@name" is the attribute ``name`` of Files
JOIN_OVERRIDES = [
    pytest.param(["mqtts://elsewhere.lan:18883"], {"broker": "mqtts://elsewhere.lan:18883"}, id="broker"),
    pytest.param(
        ["--client-id", "b", "--cert", "@b_cert", "--key", "@b_key"],
        {"client_id": "b", "cert": "@b_cert", "key": "@b_key"},
        id="client-id",  # with b's certificate: a's would be refused (another identity)
    ),
    pytest.param(["--federation", "otherfed"], {"federation": "otherfed"}, id="federation"),
    pytest.param(["--ca", "@ca"], {"ca": "@ca"}, id="ca"),
    pytest.param(["--cert", "@cert"], {"cert": "@cert"}, id="cert"),
    pytest.param(["--key", "@key"], {"key": "@key"}, id="key"),
    pytest.param(["--he", "@other_he"], {"he": "@other_he"}, id="he"),
]


def _resolve(files: Files) -> Callable[[str], str]:
    return lambda word: getattr(files, word[1:]) if word.startswith("@") else word


@pytest.mark.parametrize(("words", "changed"), JOIN_OVERRIDES)
def test_join_kit_option_overrides_its_own_item_only(
    files: Files, words: list[str], changed: dict[str, str]
) -> None:
    r = _resolve(files)
    kit_only = join_items(files=files)
    assert kit_only["cert"] == str(load_kit(files.kit("a")).cert_file)
    expected = kit_only | {item: r(value) for item, value in changed.items()}
    assert join_items(*map(r, words), files=files) == expected


def test_join_he_override_loads_that_key(files: Files) -> None:
    s = settings(parse("join", "--kit", files.kit("a"), "--data", str(files.data), "--he", files.other_he))
    kit = load_kit(files.kit("a"))
    he = s.load_he()
    assert he is not None and he.key_id == load_he(files.other_he).key_id != kit.he_key_id
    he.close()


_COMMON = [
    ("federation", ["--federation", "otherfed"], {"federation": "otherfed"}),
    ("ca", ["--ca", "@ca"], {"ca": "@ca"}),
    ("cert", ["--cert", "@cert"], {"cert": "@cert"}),
    ("key", ["--key", "@key"], {"key": "@key"}),
    ("he", ["--he", "@other_he"], {"he": "@other_he"}),
]
_OWN = {
    "coordinator": [
        ("broker", ["--broker", "mqtts://elsewhere.lan:18883"], {"broker": "mqtts://elsewhere.lan:18883"}),
        ("http", ["--http", "127.0.0.1:18080"], {"http": "127.0.0.1:18080"}),
    ],
    "keyserver": [
        ("broker", ["mqtts://elsewhere.lan:18883"], {"broker": "mqtts://elsewhere.lan:18883"}),
        ("client-id", ["--client-id", "ks2"], {"client_id": "ks2"}),
    ],
}
SERVICE_OVERRIDES = [
    pytest.param(cmd, words, changed, id=f"{cmd}-{name}")
    for cmd, own in _OWN.items()
    for name, words, changed in [*own, *_COMMON]
]
ITEMS = ("broker", "client_id", "federation", "ca", "cert", "key", "he", "http", "key_mode")


def _service_items(
    command: str, apply: Callable[[argparse.Namespace], None], files: Files, *words: str
) -> Any:
    args = parse(command, "--kit", files.kit(command), *words)
    apply(args)
    return {item: getattr(args, item) for item in ITEMS if hasattr(args, item)}


@pytest.mark.parametrize(("command", "words", "changed"), SERVICE_OVERRIDES)
def test_service_kit_option_overrides_its_own_item_only(
    files: Files, command: str, words: list[str], changed: dict[str, str]
) -> None:
    apply = coordinator_kit if command == "coordinator" else keyserver_kit
    r = _resolve(files)
    kit_only = _service_items(command, apply, files)
    kit = load_kit(files.kit(command))
    assert (kit_only["ca"], kit_only["cert"], kit_only["key"]) == tuple(
        str(f) for f in (kit.ca_file, kit.cert_file, kit.key_file)
    )
    expected = kit_only | {item: r(value) for item, value in changed.items()}
    assert _service_items(command, apply, files, *map(r, words)) == expected


@pytest.mark.parametrize("command", ["join", "coordinator", "keyserver"])
@pytest.mark.parametrize("option", ["--ca", "--cert", "--key", "--he"])
def test_a_kit_override_path_that_does_not_exist_is_refused_by_name(
    files: Files, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, option: str
) -> None:
    missing = str(tmp_path / "nowhere" / "file.pem")
    kit = files.kit("a" if command == "join" else command)
    words = [command, "--kit", kit, option, missing]
    if command == "join":
        words += ["--data", str(files.data)]
    else:
        words += ["--timeout", "1"] if command == "keyserver" else ["--state-dir", str(tmp_path / "state")]
    assert main(words) == 2
    err = capsys.readouterr().err
    assert f"{option} {missing}: no such file or directory" in err


# -- the certificate must be issued to the client id ------------------------------------------------------
def test_check_client_identity(files: Files) -> None:
    tls = load_kit(files.kit("a")).tls
    assert certificate_identity(str(tls.cert_file)) == "a"
    check_client_identity(tls, "a")
    check_client_identity(None, "b")  # plain TCP: nothing to check
    check_client_identity(TlsConfig(tls.ca_file), "b")  # no client certificate: nothing to check
    with pytest.raises(IdentityMismatch) as exc:
        check_client_identity(tls, "b")
    assert (exc.value.cert_identity, exc.value.requested_id) == ("a", "b")
    assert "is issued to 'a' but the client id is 'b'" in str(exc.value)
    with pytest.raises(ConfigError, match="cannot read the client certificate"):
        check_client_identity(TlsConfig(tls.ca_file, str(files.copies / "none.pem"), tls.key_file), "a")


def test_fedclient_refuses_another_devices_certificate_before_connecting(files: Files) -> None:
    tls = load_kit(files.kit("a")).tls
    x, y = np.zeros((4, 64), np.float32), np.arange(4) % 10
    with pytest.raises(IdentityMismatch, match="issued to 'a' but the client id is 'b'"):
        FedClient("mqtts://127.0.0.1:1", client_id="b", federation=FED, tls=tls, data=(x, y))


@pytest.mark.parametrize(
    ("words", "said"),
    [
        pytest.param(
            ["mqtts://127.0.0.1:1", "--ca", "@ca", "--cert", "@cert", "--key", "@key", "--client-id", "b"],
            "but --client-id is 'b': use --client-id a",
            id="files",
        ),
        pytest.param(
            ["--kit", "@b", "--cert", "@cert", "--key", "@key"],
            "but the kit's client id is 'b': use --client-id a",
            id="kit-with-a-cert",
        ),
        pytest.param(
            ["--kit", "@a", "--client-id", "b"],
            "but --client-id is 'b': use --client-id a",
            id="kit-with-an-id",
        ),
    ],
)
def test_join_refuses_another_devices_certificate(
    files: Files, capsys: pytest.CaptureFixture[str], words: list[str], said: str
) -> None:
    kits = {"@a": files.kit("a"), "@b": files.kit("b")}
    r = _resolve(files)
    argv = ["join", *(kits.get(w) or r(w) for w in words), "--data", str(files.data)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "is issued to 'a'" in err and said in err, err
