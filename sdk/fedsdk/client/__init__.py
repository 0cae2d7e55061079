"""FedClient: the asyncio object a device app embeds (DESIGN.md, "One round, end to end")."""

from fedsdk.client.core import ClientSummary, FedClient, RoundRecord

__all__ = ["ClientSummary", "FedClient", "RoundRecord"]
