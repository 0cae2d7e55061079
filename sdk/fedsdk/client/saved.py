"""The model a device holds, kept on disk across restarts of its process (``FedClient(state_dir=DIR)``,
``fedsdk join --state-dir DIR``).

Under HE the coordinator never holds the model: every device keeps its cluster's model and adds each
decrypted average update to it, and a task carries no weights for a device that says (``model_round`` in
its hello) that it holds one. A device process that restarted used to hold nothing, say so, and get the
federation's *initial* model, computing its next updates against the wrong base (now it gets its cluster's
model from another device: :mod:`fedsdk.client.relay`; the file saves that trip). With a state directory
the device writes the model it holds after each aggregate it applies, and a new process reads it back
before it says hello, so the coordinator goes on sending it weightless tasks and its updates stay on the
cluster's model.

Decisions:

* One file, ``<state_dir>/model.npz``: the weights as float32 arrays and a JSON header (federation, client
  id, cluster, the round of the model, model id, parameter names, and the federation run the model is of,
  which the hello says so that a coordinator of another run does not take the model as its own), written
  atomically with mode 0600 (the plaintext model of an HE federation is as private as the key:
  ``fedsdk.files.write_private``) and read with ``allow_pickle=False``. No key material goes in it.
* A file of another federation or device, of another format, unreadable or inconsistent is not used: the
  device logs why at WARNING and starts holding nothing, as without a state directory (it is rewritten at
  the next applied round).
* A kept model that cannot be this run's (a task without weights for a round not after the kept model's:
  the state directory of an earlier run of the federation) is dropped: the device answers that task with
  an error and says hello again holding nothing, so that its next task brings the federation's model.
  The coordinator catches it before any task: a hello holding a model of another run (the file's ``run``,
  or for a file without one a round newer than any it aggregated) gets the federation's model
  (``fedsdk_coordinator.engine.relay``).
* What it does not cover: a device that missed rounds while it was down restores the model of the last
  round it applied, not the cluster's current one; in key mode ``shared`` the coordinator then has a
  device of its cluster relay the current one (:mod:`fedsdk.client.relay`) before it trains; under the
  key server, where nobody can relay it, the coordinator leaves it out of the rounds. A round the old
  process trained in but had not applied is not applied by the new one (the coordinator waits for that
  report until ``report_timeout_s``).
"""

from __future__ import annotations

import io
import json
import logging
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedsdk.client.state import DeviceState
from fedsdk.files import write_private

__all__ = [
    "MODEL_FILE",
    "SavedModel",
    "held_model",
    "keep_model",
    "load_model",
    "model_bytes",
    "model_from_bytes",
    "save_model",
]

log = logging.getLogger(__name__)

MODEL_FILE = "model.npz"
FORMAT = 1
MAX_FILE_BYTES = 2 * 1024**3  # a model file larger than this is not read (2 GiB: ~500 M float32 values)


@dataclass(frozen=True)
class SavedModel:
    """The model a device holds and what it belongs to."""

    federation: str
    client_id: str
    cluster_id: int
    model_round: int
    model_id: str
    param_names: tuple[str, ...]
    weights: list[np.ndarray]
    run: int | None = None  # the federation run the model is of (the coordinator's run tag; None: unknown)


def save_model(state_dir: str | os.PathLike[str], saved: SavedModel) -> Path:
    """Write ``saved`` to ``<state_dir>/model.npz`` (made 0700 if missing), atomically, mode 0600."""
    folder = Path(state_dir)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return write_private(folder / MODEL_FILE, model_bytes(saved))


def held_model(device: DeviceState, names: tuple[str, ...], cluster_id: int) -> SavedModel | None:
    """The model ``device`` holds (of cluster ``cluster_id``, parameters ``names``), as it is kept and
    relayed: the one it trains, or the one it keeps aside for ``cluster_id`` when it trains another
    cluster's (:func:`~fedsdk.client.state.follow_model`); None when it holds none."""
    model_round, weights = device.model_round, device.weights
    if cluster_id != device.summary.cluster_id and cluster_id in device.parked:
        model_round, weights = device.parked[cluster_id]
    if weights is None:
        return None
    return SavedModel(
        federation=device.federation,
        client_id=device.client_id,
        cluster_id=cluster_id,
        model_round=model_round,
        model_id=device.model_id or "",
        param_names=names,
        weights=weights,
        run=device.model_run,
    )


def keep_model(
    state_dir: str | os.PathLike[str], device: DeviceState, names: tuple[str, ...], cluster_id: int
) -> None:
    """Write the model ``device`` holds to ``state_dir`` (:func:`held_model`); nothing when it holds none."""
    saved = held_model(device, names, cluster_id)
    if saved is not None:
        save_model(state_dir, saved)


def model_bytes(saved: SavedModel) -> bytes:
    """``saved`` as the bytes of a model file (an ``.npz`` of float32 arrays and a JSON header): what
    :func:`save_model` writes and what a device seals to relay its model (:mod:`fedsdk.client.relay`)."""
    header = {
        "format": FORMAT,
        "federation": saved.federation,
        "client_id": saved.client_id,
        "cluster_id": int(saved.cluster_id),
        "model_round": int(saved.model_round),
        "model_id": saved.model_id,
        "param_names": list(saved.param_names),
    }
    if saved.run is not None:
        header["run"] = int(saved.run)
    arrays: dict[str, Any] = {f"w{i}": np.asarray(w, dtype=np.float32) for i, w in enumerate(saved.weights)}
    arrays["header"] = np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def load_model(state_dir: str | os.PathLike[str], *, federation: str, client_id: str) -> SavedModel | None:
    """The model kept in ``<state_dir>/model.npz`` for ``federation`` and ``client_id``; None when there is
    none, or (logged at WARNING) when it cannot be used."""
    path = Path(state_dir) / MODEL_FILE
    if not path.is_file():
        return None
    try:
        saved = _read(path)
    except (OSError, EOFError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as exc:
        log.warning("not using the model kept in %s: %s", path, exc)
        return None
    if (saved.federation, saved.client_id) != (federation, client_id):
        log.warning(
            "not using the model kept in %s: it is device %s's of federation %s",
            path, saved.client_id, saved.federation,
        )  # fmt: skip
        return None
    return saved


def _read(path: Path) -> SavedModel:
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
    return model_from_bytes(path.read_bytes())


def model_from_bytes(data: bytes) -> SavedModel:
    """The model in the bytes of a model file (:func:`model_bytes`); ValueError (or the zip and numpy
    readers' errors: KeyError, EOFError, zipfile.BadZipFile) when they are not one, or hold a model whose
    weights are not all finite. The arrays are stored, never compressed (``np.savez``), so what they unpack
    to is bounded by ``len(data)``: a compressed member, which could unpack to far more, is refused."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        members = zf.infolist()
        if any(m.compress_type != zipfile.ZIP_STORED for m in members):
            raise ValueError("a compressed member: model files store their arrays")
        if sum(m.file_size for m in members) > len(data):
            raise ValueError("members larger than the file")
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        header = json.loads(bytes(z["header"]).decode("utf-8"))
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ValueError("not a fedsdk model file of a known format")
        names = header["param_names"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError("parameter names are not a list of strings")
        weights = [np.array(z[f"w{i}"], dtype=np.float32) for i in range(len(names))]
        if len(z.files) != len(names) + 1:
            raise ValueError(f"{len(z.files) - 1} arrays for {len(names)} parameter names")
    if not all(np.isfinite(w).all() for w in weights):
        raise ValueError("the weights are not all finite")
    run = header.get("run")  # absent in files of earlier versions
    numbers = [header["cluster_id"], header["model_round"], *([] if run is None else [run])]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in numbers):
        raise ValueError("cluster and round must be integers >= 0")
    texts = [header["federation"], header["client_id"], header["model_id"]]
    if not all(isinstance(v, str) for v in texts):
        raise ValueError("federation, client id and model id must be text")
    return SavedModel(
        federation=header["federation"],
        client_id=header["client_id"],
        cluster_id=header["cluster_id"],
        model_round=header["model_round"],
        model_id=header["model_id"],
        param_names=tuple(names),
        weights=weights,
        run=run,
    )
