"""A device app that embeds fedsdk: the same work as ``fedsdk join --kit KIT --data DATA``, in your own
asyncio program (the README shows its core).

    python examples/embed/app.py fleet/devices/pi-03 data/pi-03.csv [LABEL_COLUMN]

Exits 0 when the federation finished and this device applied at least one aggregate.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from fedsdk import FedClient
from fedsdk.kit import load_kit
from fedsdk.model.data import load_data


async def main(kit_dir: str, data_file: str, label: str = "label") -> int:
    kit = load_kit(kit_dir)  # certificates, broker URL, federation and HE key from `fedsdk provision`
    x, y = load_data(data_file, label_columns=[label])  # .csv with a label column, or .npz (x and y)
    async with FedClient(
        kit.broker_url,
        client_id=kit.client_id,
        federation=kit.federation,
        data=(x, y),
        tls=kit.tls,
        he=kit.load_backend(),
    ) as client:
        summary = await client.run()
    print(f"{summary.client_id}: {summary.state}, applied rounds {summary.applied_rounds}")
    return 0 if summary.state == "finished" and summary.applied_rounds else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a device app that embeds fedsdk's FedClient")
    parser.add_argument("kit", help="the device's kit from 'fedsdk provision' (fleet/devices/<id>)")
    parser.add_argument("data", help="the local samples: .csv with a header, or .npz with x and y")
    parser.add_argument("label", nargs="?", default="label", help="the CSV file's label column")
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.kit, args.data, args.label)))
