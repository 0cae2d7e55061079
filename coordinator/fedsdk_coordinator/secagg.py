"""The coordinator's side of one masking session (SecAgg+, Bell et al. CCS 2020), as plain data: it
collects the devices' keys, fixes the members and sends each its roster, collects the sealed shares and
relays them, names the sum, collects the unmask shares and turns them into the correction that leaves the
exact sum of the survivors' updates (:func:`fedsdk.secagg.unmask.correction_terms`). No I/O: the round
engine (:mod:`fedsdk_coordinator.engine.masking`) waits, publishes and stores.

Three decisions fix the session's sets, each once:

1. **members** (U1): the devices whose keys arrived; each gets a roster of its neighbourhood
   (:func:`fedsdk.secagg.graph.neighbourhoods`), with Shamir index ``1 + rank`` in the sorted members;
2. **partners** (U2): the members whose shares arrived; each gets the shares its partners sealed for it;
   it masks with exactly them, and only its update is taken;
3. **the sum** (U3 ⊆ U2): the partners whose valid updates are aggregated; the others of U2 dropped.

The coordinator never holds a device's secret: it learns a self-mask seed only of a device in the sum,
and a mask key only of one that dropped, each from ``t`` shares; the devices refuse to reveal both for
one device (:class:`fedsdk.secagg.session.DeviceSession`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from fedsdk.errors import ValidationError
from fedsdk.protocol import MaskKeys, MaskRelay, MaskRoster, MaskShares, UnmaskRequest, UnmaskShares
from fedsdk.protocol.secagg import SHARE_OF_KEY, SHARE_OF_SEED
from fedsdk.protocol.selective import join_parts
from fedsdk.secagg.graph import neighbourhoods, threshold
from fedsdk.secagg.keys import Context
from fedsdk.secagg.unmask import correction_terms, rebuild

__all__ = ["MaskingRound"]


@dataclass
class MaskingRound:
    """One cluster round's masking session."""

    ctx: Context
    participants: frozenset[str]
    min_aggregate: int
    keys: dict[str, MaskKeys] = field(default_factory=dict)
    members: tuple[str, ...] | None = None  # U1
    hoods: dict[str, list[str]] = field(default_factory=dict)
    shares: dict[str, MaskShares] = field(default_factory=dict)
    partners_set: tuple[str, ...] | None = None  # U2
    request: UnmaskRequest | None = None
    unmask: dict[str, UnmaskShares] = field(default_factory=dict)

    @property
    def session(self) -> str:
        return self.ctx.session

    def index(self, client_id: str) -> int:
        assert self.members is not None
        return self.members.index(client_id) + 1

    def _check(self, msg: MaskKeys | MaskShares | UnmaskShares) -> None:
        c = self.ctx
        if (msg.round_id, msg.cluster_id) != (c.round_id, c.cluster_id) or msg.session != c.session:
            raise ValidationError("stale_round", f"masking message for another session ({msg.session})")

    # -- 1. keys -> rosters -------------------------------------------------------------------
    def take_keys(self, msg: MaskKeys) -> bool:
        """Hold ``msg``; False for a repeat of the keys already held (harmless)."""
        self._check(msg)
        cid = msg.client_id
        if cid not in self.participants:
            raise ValidationError("not_participant", f"{cid} has no task in this round")
        held = self.keys.get(cid)
        if held is not None:
            if (held.c_pk, held.s_pk) != (msg.c_pk, msg.s_pk):
                raise ValidationError("duplicate", f"{cid} advertised other keys in one session")
            return False
        if self.members is not None:
            raise ValidationError("stale_round", f"keys from {cid} after the members were fixed")
        self.keys[cid] = msg
        return True

    def fix_members(self) -> None:
        """U1: every device whose keys arrived."""
        if self.members is None:
            self.members = tuple(sorted(self.keys))
            self.hoods = neighbourhoods(self.members, self.session)

    def roster(self, recipient: str, certificates: Mapping[str, bytes]) -> MaskRoster:
        """``recipient``'s roster; ``certificates``: the certificate to send for each member (empty for one
        the recipient was sent before)."""
        assert self.members is not None
        hood = self.hoods[recipient]
        entries = [(self.keys[m], self.index(m), certificates.get(m, b"")) for m in hood]
        c = self.ctx
        return MaskRoster.of(c.round_id, c.cluster_id, c.session, threshold(len(hood)), len(self.members),
                             entries)  # fmt: skip

    # -- 2. shares -> relays ------------------------------------------------------------------
    def take_shares(self, msg: MaskShares) -> bool:
        self._check(msg)
        cid = msg.client_id
        if self.members is None or cid not in self.members:
            raise ValidationError("not_participant", f"shares from {cid}, not a member of the session")
        if cid in self.shares:
            if self.shares[cid].recipients != msg.recipients or self.shares[cid].sealed != msg.sealed:
                raise ValidationError("duplicate", f"{cid} sent other shares in one session")
            return False
        if self.partners_set is not None:
            raise ValidationError("stale_round", f"shares from {cid} after they were relayed")
        expected = tuple(m for m in self.hoods[cid] if m != cid)
        if msg.recipients != expected:
            raise ValidationError("bad_field", f"{cid} shared with {len(msg.recipients)} devices, not its "
                                  f"{len(expected)} neighbours")  # fmt: skip
        self.shares[cid] = msg
        return True

    def fix_partners(self) -> None:
        """U2: every member whose shares arrived."""
        if self.partners_set is None:
            self.partners_set = tuple(sorted(self.shares))

    def partners(self, client_id: str) -> list[str]:
        """Whom ``client_id`` masks with: its neighbours in U2."""
        assert self.partners_set is not None
        u2 = set(self.partners_set)
        return [m for m in self.hoods[client_id] if m != client_id and m in u2]

    def relay(self, recipient: str) -> MaskRelay:
        senders = self.partners(recipient)
        sealed = []
        for s in senders:
            msg = self.shares[s]
            sealed.append(msg.parts()[msg.recipients.index(recipient)])
        blob, lengths = join_parts(sealed)
        c = self.ctx
        return MaskRelay(c.round_id, c.cluster_id, c.session, tuple(senders), (lengths,), blob)

    # -- 3. the sum -> unmask shares -> correction ----------------------------------------------
    def name_sum(self, survivors: set[str]) -> UnmaskRequest:
        """The unmask request for the sum of ``survivors``' updates (all in U2)."""
        assert self.partners_set is not None
        if self.request is None:
            u2 = set(self.partners_set)
            if not survivors <= u2:
                raise ValidationError("bad_field", "a survivor outside the partners")
            c = self.ctx
            self.request = UnmaskRequest(c.round_id, c.cluster_id, c.session, tuple(sorted(survivors)),
                                         tuple(sorted(u2 - survivors)))  # fmt: skip
        return self.request

    def take_unmask(self, msg: UnmaskShares) -> bool:
        self._check(msg)
        cid = msg.client_id
        if self.request is None or self.partners_set is None or cid not in self.partners_set:
            raise ValidationError("stale_round", f"unmask shares from {cid} outside the unmask stage")
        if cid in self.unmask:
            if self.unmask[cid].shares != msg.shares or self.unmask[cid].owners != msg.owners:
                raise ValidationError("duplicate", f"{cid} sent other unmask shares in one session")
            return False
        alive, gone = set(self.request.survivors), set(self.request.dropped)
        may = set(self.partners(cid)) | {cid}
        for owner, kind, _ in msg.items():
            if owner not in may:
                raise ValidationError("bad_field", f"{cid} sent a share of {owner}, not its partner")
            if (kind == SHARE_OF_SEED) != (owner in alive) or (kind == SHARE_OF_KEY) != (owner in gone):
                raise ValidationError("bad_field", f"{cid} sent the wrong kind of share of {owner}")
        self.unmask[cid] = msg
        return True

    def _collected(self) -> tuple[dict[str, dict[int, bytes]], dict[str, dict[int, bytes]]]:
        seeds: dict[str, dict[int, bytes]] = {}
        keys: dict[str, dict[int, bytes]] = {}
        for cid, msg in self.unmask.items():
            x = self.index(cid)
            for owner, kind, share in msg.items():
                (seeds if kind == SHARE_OF_SEED else keys).setdefault(owner, {})[x] = share
        return seeds, keys

    def missing(self) -> list[str]:
        """The devices whose secret still lacks shares (empty: the correction can be formed)."""
        assert self.request is not None
        seeds, keys = self._collected()
        out = []
        for v, got in [(v, seeds.get(v, {})) for v in self.request.survivors] + [
            (d, keys.get(d, {})) for d in self.request.dropped
        ]:
            if len(got) < threshold(len(self.hoods[v])):
                out.append(v)
        return out

    def correction(self) -> list[tuple[bytes, int]]:
        """The ``(seed, sign)`` terms that remove every mask from the survivors' sum."""
        assert self.request is not None
        seeds, keys = self._collected()
        rebuilt_seeds = {v: rebuild(seeds[v], threshold(len(self.hoods[v]))) for v in self.request.survivors}
        rebuilt_keys = {d: rebuild(keys[d], threshold(len(self.hoods[d]))) for d in self.request.dropped}
        s_pks = {m: k.s_pk for m, k in self.keys.items()}
        partners = {d: self.partners(d) for d in self.request.dropped}
        return correction_terms(self.ctx, self.request.survivors, self.request.dropped, rebuilt_seeds,
                                rebuilt_keys, s_pks, partners)  # fmt: skip
