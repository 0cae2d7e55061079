"""FedClient: the asyncio object a device app embeds (DESIGN.md, "One round, end to end").

::

    async with FedClient("mqtts://broker:8883", client_id="pi-01", tls=tls, data=(x, y),
                         he=load_he("kit/he")) as client:
        summary = await client.run()

FedClient (``core.py``) composes one part per stretch of the round, over the device's state (``state.py``):

* ``link.py``: the session: the MQTT transport, hello, status, reconnects, goodbye, the run's end;
* ``work.py``: a task: train → sensitivity/leakage → mask → self-audit → protect → upload, or the sketch;
* ``apply.py``: an aggregate: decrypt, cooperative decryption shares, apply once, evaluate, report.
"""

from fedsdk.client.core import FedClient
from fedsdk.client.state import ClientSummary, RoundRecord

__all__ = ["ClientSummary", "FedClient", "RoundRecord"]
