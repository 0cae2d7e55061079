"""Score an exported model with plain onnxruntime (no fedsdk needed): accuracy on a CSV file.

python score.py models/pi-01.onnx data/test.csv
"""

from __future__ import annotations

import argparse

import numpy as np
import onnxruntime as ort


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("data", help="CSV with a header; the last column is the label")
    args = p.parse_args()
    table = np.loadtxt(args.data, delimiter=",", skiprows=1, dtype=np.float32)
    x, y = table[:, :-1], table[:, -1].astype(np.int64)
    session = ort.InferenceSession(args.model, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    logits = session.run(None, {name: x})[0]
    accuracy = float((logits.argmax(axis=1) == y).mean())
    print(f"{args.model}: accuracy {accuracy:.4f} on {len(y)} samples of {args.data}")


if __name__ == "__main__":
    main()
