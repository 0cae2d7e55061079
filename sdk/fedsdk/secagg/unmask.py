"""What the coordinator does with the shares it is sent: rebuild the secrets of a sum's members and the
mask that removes what does not cancel (SecAgg+, Bell et al. CCS 2020, round 4).

The sum of the survivors' masked updates holds, besides their updates,

* each survivor's self mask ``+PRG(b_v)``: the coordinator rebuilds ``b_v`` from ``t`` shares;
* for each device ``d`` that shared keys but sent no update (dropped), the pairwise masks its surviving
  partners ``u`` added for it, ``±PRG(s_ud)`` (``+`` when ``u < d``): it rebuilds ``d``'s mask key from
  ``t`` shares and agrees ``s_ud`` with each ``u``'s public key, as ``u`` did.

:func:`correction_terms` lists them with the opposite sign; expanded and added to the sum they leave
exactly the sum of the survivors' updates. Pure functions: no I/O, no state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from fedsdk.errors import ValidationError
from fedsdk.secagg.keys import Context, KeyPair, pair_seed, self_seed
from fedsdk.secagg.shamir import combine

__all__ = ["correction_terms", "pair_sign", "rebuild"]


def pair_sign(me: str, other: str) -> int:
    """The sign of the pairwise mask ``me`` adds for ``other``: + when ``me`` sorts first."""
    return 1 if me < other else -1


def rebuild(shares: Mapping[int, bytes], threshold: int) -> bytes:
    """A secret from ``threshold`` or more shares ``{index: share}``."""
    try:
        return combine(shares, threshold)
    except ValueError as exc:
        raise ValidationError("bad_share", f"the shares do not rebuild a secret: {exc}") from None


def correction_terms(
    ctx: Context,
    survivors: Iterable[str],
    dropped: Iterable[str],
    seeds: Mapping[str, bytes],
    keys: Mapping[str, bytes],
    s_pks: Mapping[str, bytes],
    partners: Mapping[str, Iterable[str]],
) -> list[tuple[bytes, int]]:
    """``(seed, sign)`` terms whose expansion, added to the survivors' sum, removes every mask left in it:
    ``seeds`` are the survivors' rebuilt self-mask seeds, ``keys`` the dropped devices' rebuilt mask keys,
    ``s_pks`` every member's advertised mask public key, ``partners`` whom each device masked with.
    ValidationError ``bad_share`` when a rebuilt key is not the one its device advertised."""
    alive = set(survivors)
    terms = [(self_seed(seeds[v], ctx, v), -1) for v in sorted(alive)]
    for d in sorted(dropped):
        pair = KeyPair.from_private_bytes(keys[d])
        if pair.public != s_pks[d]:
            raise ValidationError("bad_share", f"the shares of {d}'s mask key rebuild another key")
        for u in sorted(set(partners[d]) & alive):
            terms.append((pair_seed(pair, s_pks[u], ctx, d, u), -pair_sign(u, d)))
    return terms
