"""The cluster's consensus mask: which packs the devices of a cluster are asked to prefer next round.

Why. In key mode ``shared`` every device of a cluster decrypts the *union* of the cluster's masks, and the
devices' own top packs overlap little: in the system scenario of docs/results/fleet-scenarios.md each device
encrypted 36-46 % of the packs and the union was 69-89 % (union ÷ largest mask 1.7-1.9), so decryption, not
encryption, made `fedsdk`'s rounds long. If the devices agree on which packs to encrypt, the union shrinks
towards one mask.

How (paper 003, MASER, adapted). MASER's clients send their local masks, the server majority-votes a
global mask and sends it back, and every client then uses exactly that mask: one extra round-trip per
round, and a client may end up protecting less of its own sensitivity than it wanted. Decisions here:

* **No extra round-trip**: the consensus of round t is voted on the masks of round t − 1 (the coordinator
  holds them: masks travel in the clear) and rides in round t's task (``config["mask_consensus"]``,
  :func:`fedsdk.pipeline.encode_pack_mask`). Sensitivity rankings move slowly between rounds, so last
  round's vote is a good guess; the first training round has none, and neither has the first round after
  a coordinator restart (the consensus is not stored: it is a hint, rebuilt from the next round's masks).
* **A preference, not an order**: a device solves its own mask with the consensus packs first in its
  chains (``fedsdk.masking.solve_mask(prefer=...)``), so it still meets eq. 7 and 8 on its *own*
  sensitivity; the consensus can cost it values, never protection. A coordinator that sends a bad
  consensus (stale or adversarial) only makes devices encrypt more.
* **Size = the largest mask, not a 50 % vote**: MASER's threshold fixes what everyone encrypts; here each
  device takes a prefix of the consensus ranked by its own sensitivity until eq. 7 holds, and the top k of
  a larger set cover at least as much as the top k of a smaller one, so a larger consensus never makes a
  device encrypt more; it only bounds the union from above. Too small, and every device whose needs
  exceed it adds its own extras, which is what makes the union. So: the ``m`` most-voted packs, ``m`` the
  largest mask of the round, ties to the lower pack index, packs nobody voted for never.
  Measured (system scenario, seed 1, rounds 2-8; docs/results/fleet-scenarios.md): without a consensus each
  device encrypted 40 % of the packs and the union was 70 %; with a median-sized consensus 43 % and 57 %; with
  the largest 44 % and 51-55 % from round 3 (64 % in round 2), union ÷ consensus 1.04.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["consensus_mask"]


def consensus_mask(masks: Sequence[np.ndarray]) -> np.ndarray | None:
    """The ``m`` most-voted packs of ``masks`` (one bool per pack each), ``m`` the largest mask's size.

    ``None`` when there is nothing to agree on: no masks, or no device encrypted anything.
    """
    if not masks:
        return None
    stack = np.stack([np.asarray(m, dtype=bool) for m in masks])
    votes = stack.sum(axis=0)
    m = int(stack.sum(axis=1).max())
    m = min(m, int((votes > 0).sum()))
    if m == 0:
        return None
    order = np.argsort(-votes, kind="stable")  # most votes first; ties to the lower index
    out = np.zeros(stack.shape[1], dtype=bool)
    out[order[:m]] = True
    return out
