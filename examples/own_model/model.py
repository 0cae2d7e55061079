"""The example's model, written in PyTorch and exported to ONNX as fedsdk imports it (needs torch here
only: devices run the graphs the coordinator makes from this file on stock onnxruntime).

    python model.py [--out sensor.onnx]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


class SensorNet(nn.Module):
    """12 sensor features -> 3 machine states, with a LayerNorm on the raw readings."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(12),
            nn.Linear(12, 32),
            nn.ReLU(),
            nn.Linear(32, 32),
            nn.ReLU(),
            nn.Linear(32, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="sensor.onnx")
    args = p.parse_args()
    torch.manual_seed(0)
    model = SensorNet().eval()
    torch.onnx.export(
        model,
        (torch.zeros(1, 12),),
        args.out,
        input_names=["input"],
        output_names=["output"],
        dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
        opset_version=17,
        do_constant_folding=False,
        dynamo=False,
    )
    print(f"wrote {args.out} ({sum(p.numel() for p in model.parameters())} parameters)")


if __name__ == "__main__":
    main()
