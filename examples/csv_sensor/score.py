"""Accuracy of an exported model on a CSV file, with plain onnxruntime (no fedsdk needed).

python score.py models/pi-01.onnx data/test.csv [--label-column state]
"""

from __future__ import annotations

import argparse
import csv

import numpy as np
import onnxruntime as ort


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("data", help="CSV with a header line")
    p.add_argument("--label-column", default="state")
    args = p.parse_args()
    with open(args.data, newline="", encoding="utf-8") as fh:
        header = next(csv.reader(fh))
    table = np.loadtxt(args.data, delimiter=",", skiprows=1, dtype=np.float32, ndmin=2)
    label = header.index(args.label_column)
    x, y = np.delete(table, label, axis=1), table[:, label].astype(np.int64)
    session = ort.InferenceSession(args.model, providers=["CPUExecutionProvider"])
    logits = session.run(None, {session.get_inputs()[0].name: x})[0]
    accuracy = float((logits.argmax(axis=1) == y).mean())
    print(f"{args.model}: accuracy {accuracy:.4f} on {len(y)} samples of {args.data}")


if __name__ == "__main__":
    main()
