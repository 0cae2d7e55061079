"""One masking session on a device: its keys, what it checks of the neighbours the coordinator names, the
shares it gives and holds, the masks it adds, and the shares it reveals (SecAgg+, Bell et al. CCS 2020;
the stages are those of Flower's ``secaggplus`` workflow: setup, share keys, collect masked vectors,
unmask).

Each answer is made once per session and kept: a request repeated with the same content gets the same
bytes, one with other content is refused (``secagg_conflict``). That is what keeps a device from ever
revealing both the self-mask seed and the mask key of one neighbour, or masking one update twice.

A device refuses, with ``min_aggregate`` in the reason:

* a roster of fewer than ``min_aggregate`` members (itself included), or whose threshold is not a
  majority of them;
* to mask with fewer than ``min_aggregate − 1`` partners (neighbours whose shares reached it);
* to reveal anything for a sum in which fewer than ``min_aggregate`` certified members it knows are
  counted (its partners and itself);
* any member whose advertisement its :class:`~fedsdk.secagg.identity.Trust` does not accept, and a roster
  in which its own keys are not the ones it advertised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from fedsdk.errors import ValidationError
from fedsdk.protocol.secagg import (
    SHARE_BYTES,
    SHARE_OF_KEY,
    SHARE_OF_SEED,
    MaskKeys,
    MaskRelay,
    MaskRoster,
    MaskShares,
    UnmaskRequest,
    UnmaskShares,
    advert_bytes,
)
from fedsdk.protocol.selective import join_parts
from fedsdk.secagg.identity import Signer, Trust
from fedsdk.secagg.keys import Context, KeyPair, open_shares, pair_seed, seal_shares, self_seed
from fedsdk.secagg.shamir import random_secret, split
from fedsdk.secagg.unmask import pair_sign

__all__ = ["DeviceSession", "Neighbour"]


@dataclass(frozen=True)
class Neighbour:
    client_id: str
    index: int
    c_pk: bytes
    s_pk: bytes
    certified: bool


@dataclass
class _Answers:
    shares: MaskShares | None = None
    roster_members: tuple[str, ...] = ()
    relay_senders: tuple[str, ...] | None = None
    unmask: UnmaskShares | None = None
    unmask_of: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    held: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)  # owner -> (seed share, key share)


class DeviceSession:
    """One device's part in one session (``ctx``); no I/O."""

    def __init__(
        self,
        ctx: Context,
        client_id: str,
        *,
        trust: Trust,
        signer: Signer | None = None,
        min_aggregate: int = 3,
        send_certificate: bool = True,
    ) -> None:
        self.ctx = ctx
        self.me = client_id
        self.trust = trust
        self.min_aggregate = int(min_aggregate)
        self._c, self._s = KeyPair(), KeyPair()
        self._b = random_secret()
        data = advert_bytes(ctx.federation, ctx.round_id, ctx.cluster_id, ctx.session, client_id,
                            self._c.public, self._s.public)  # fmt: skip
        signature = signer.sign(data) if signer is not None else b""
        cert = signer.certificate if signer is not None and send_certificate else b""
        self.keys = MaskKeys(client_id, ctx.round_id, ctx.cluster_id, ctx.session, self._c.public,
                             self._s.public, signature, cert)  # fmt: skip
        self.neighbours: dict[str, Neighbour] = {}
        self.certified = 0
        self._answers = _Answers()

    # -- the stages ---------------------------------------------------------------------------
    def _same_session(self, msg: MaskRoster | MaskRelay | UnmaskRequest) -> None:
        c = self.ctx
        if (msg.round_id, msg.cluster_id, msg.session) != (c.round_id, c.cluster_id, c.session):
            raise ValidationError("stale_round", "a masking message of another session")

    def on_roster(self, roster: MaskRoster, certificates: dict[str, bytes] | None = None) -> MaskShares:
        """Check the neighbours named in ``roster`` and seal this device's shares for them.
        ``certificates``: certificates this device was sent earlier, by id, for members sent without."""
        self._same_session(roster)
        done = self._answers
        if done.shares is not None:
            if roster.members != done.roster_members:
                raise ValidationError("secagg_conflict", "a second roster with other members in one session")
            return done.shares
        m = len(roster.members)
        if m < self.min_aggregate:
            raise ValidationError(
                "min_aggregate", f"a roster of {m} devices, fewer than min_aggregate {self.min_aggregate}"
            )
        if not 2 * roster.threshold > m:
            raise ValidationError("bad_field", f"threshold {roster.threshold} is no majority of {m}")
        c = self.ctx
        neighbours, index, certified = {}, 0, 0
        for cid, x, c_pk, s_pk, sig, cert in roster.entries():
            if cid == self.me:
                if (c_pk, s_pk) != (self.keys.c_pk, self.keys.s_pk):
                    raise ValidationError("bad_field", "the roster holds other keys under this device's id")
                index = x
                continue
            cert = cert or (certificates or {}).get(cid, b"")
            data = advert_bytes(c.federation, c.round_id, c.cluster_id, c.session, cid, c_pk, s_pk)
            ok = self.trust.check(cid, cert, sig, data)
            certified += ok
            neighbours[cid] = Neighbour(cid, x, c_pk, s_pk, ok)
        if not index:
            raise ValidationError("bad_field", "a roster without this device")
        xs = [index] + [n.index for n in neighbours.values()]
        seed_shares = split(self._b, xs, roster.threshold)
        key_shares = split(self._s.private_bytes(), xs, roster.threshold)
        done.held[self.me] = (seed_shares[index], key_shares[index])
        recipients, sealed = [], []
        for cid, n in sorted(neighbours.items()):
            data = seed_shares[n.index] + key_shares[n.index]
            recipients.append(cid)
            sealed.append(seal_shares(self._c, n.c_pk, c, self.me, cid, data))
        blob, lengths = join_parts(sealed)
        self.neighbours, self.certified = neighbours, certified
        done.roster_members = roster.members
        done.shares = MaskShares(self.me, c.round_id, c.cluster_id, c.session, tuple(recipients), (lengths,),
                                 blob)  # fmt: skip
        return done.shares

    def on_relay(self, relay: MaskRelay) -> None:
        """Open the shares the partners in ``relay`` sealed for this device; they are whom it masks with."""
        self._same_session(relay)
        done = self._answers
        if done.shares is None:
            raise ValidationError("stale_round", "shares relayed before this device shared its own")
        if done.relay_senders is not None:
            if relay.senders != done.relay_senders:
                raise ValidationError("secagg_conflict", "a second relay with other senders in one session")
            return
        if len(relay.senders) + 1 < self.min_aggregate:
            raise ValidationError(
                "min_aggregate",
                f"{len(relay.senders)} partners: a sum of {len(relay.senders) + 1} devices, fewer than "
                f"min_aggregate {self.min_aggregate}",
            )
        held = {}
        for sender, sealed in zip(relay.senders, relay.parts(), strict=True):
            n = self.neighbours.get(sender)
            if n is None:
                raise ValidationError("bad_field", f"shares relayed from {sender}, not a neighbour")
            data = open_shares(self._c, n.c_pk, self.ctx, sender, self.me, sealed)
            if len(data) != 2 * SHARE_BYTES:
                raise ValidationError("bad_share", f"shares from {sender} of {len(data)} bytes")
            held[sender] = (data[:SHARE_BYTES], data[SHARE_BYTES:])
        done.held.update(held)
        done.relay_senders = relay.senders

    @property
    def partners(self) -> tuple[str, ...]:
        """The neighbours this device masks with (known once the relay arrived)."""
        senders = self._answers.relay_senders
        if senders is None:
            raise ValidationError("stale_round", "no relay yet: nobody to mask with")
        return senders

    def mask_terms(self, among: Sequence[str] | None = None) -> list[tuple[bytes, int]]:
        """The ``(seed, sign)`` terms of this device's mask: its self mask and a pairwise mask with each
        partner (``+`` for partners that sort after it), to be expanded in the backend's ring. ``among``:
        with these neighbours instead of the partners (a mask expanded before the relay names them)."""
        return [(self_seed(self._b, self.ctx, self.me), 1), *self.pair_terms(among)]

    def pair_terms(self, among: Sequence[str] | None = None) -> list[tuple[bytes, int]]:
        """The pairwise terms of :meth:`mask_terms` alone."""
        c = self.ctx
        return [
            (pair_seed(self._s, self.neighbours[v].s_pk, c, self.me, v), pair_sign(self.me, v))
            for v in (self.partners if among is None else among)
        ]

    def on_unmask(self, req: UnmaskRequest) -> UnmaskShares:
        """This device's shares for the sum ``req`` names: of each surviving partner's (and its own) self-
        mask seed, of each dropped partner's mask key."""
        self._same_session(req)
        done = self._answers
        asked = (req.survivors, req.dropped)
        if done.unmask is not None:
            if asked != done.unmask_of:
                raise ValidationError("secagg_conflict", "a second unmask request for another sum")
            return done.unmask
        partners = set(self.partners)
        alive, gone = set(req.survivors), set(req.dropped)
        known = len(alive & (partners | {self.me}))
        if known < self.min_aggregate:
            raise ValidationError(
                "min_aggregate",
                f"a sum of {known} devices this device knows, fewer than min_aggregate {self.min_aggregate}",
            )
        revealed: list[tuple[str, int, bytes]] = []
        for v in sorted(partners | {self.me}):
            seed_share, key_share = done.held[v]
            if v in alive:
                revealed.append((v, SHARE_OF_SEED, seed_share))
            elif v in gone and v != self.me:
                revealed.append((v, SHARE_OF_KEY, key_share))
        owners = tuple(v for v, _, _ in revealed)
        kinds = np.array([k for _, k, _ in revealed], dtype=np.uint8)
        c = self.ctx
        done.unmask = UnmaskShares(self.me, c.round_id, c.cluster_id, c.session, owners, (kinds,),
                                   b"".join(s for _, _, s in revealed))  # fmt: skip
        done.unmask_of = asked
        return done.unmask

    @property
    def shares(self) -> MaskShares | None:
        """The shares this device sealed for its neighbours (None before its roster came)."""
        return self._answers.shares

    @property
    def revealed(self) -> bool:
        """Whether this device answered an unmask request (its session's sum may have been formed)."""
        return self._answers.unmask is not None
