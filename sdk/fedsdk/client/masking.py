"""The device's secure-aggregation sessions (``fedsdk.secagg``), on the event loop: a masked task starts a
session and sends its keys; the roster, the relay and the unmask request are taken as they arrive, while
the device trains. Once the roster is in and the task's mask shape is known (:meth:`Masking.expect`), the
mask vector is expanded in the executor while training goes on, with every neighbour of the roster; the
relay then names the partners (the neighbours whose shares came back), nearly always all of them, and the
masks of any that are not are taken out again. The training step takes the vector after training
(:meth:`Masking.blind_for`) and seldom waits for it.

A task carries ``secagg_session`` when its round is masked. The same task again (a coordinator that asks
again after a restart or a lost message) re-sends what the session sent so far, unchanged. A task of the
same round with another session (the round failed and runs again) starts a new session only when the old
one revealed nothing; otherwise the device refuses (``secagg_spent``): its update must not be in two sums.

A device sends its certificate with its first keys after each hello and keeps the certificates of the
neighbours it checked, so that a coordinator that knows the device has them sends them once per
connection (:class:`~fedsdk.protocol.MaskRoster`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedsdk.client.link import Link, Publish
from fedsdk.client.state import DeviceState
from fedsdk.crypto import HEBackend
from fedsdk.errors import ConfigError, MaskingRefused, ValidationError
from fedsdk.protocol import MaskRelay, MaskRoster, Task, UnmaskRequest
from fedsdk.protocol import topics as T
from fedsdk.secagg.identity import Signer, Trust
from fedsdk.secagg.keys import Context
from fedsdk.secagg.plain import plain_encoding
from fedsdk.secagg.ring import MaskRing
from fedsdk.secagg.session import DeviceSession
from fedsdk.transport import TlsConfig

__all__ = ["SUPERSEDED", "Masking", "expand_vector", "mask_shape", "session_of"]

log = logging.getLogger(__name__)
KEEP_ROUNDS = 3  # sessions kept behind the newest (their unmask requests come after the update)
SUPERSEDED = "secagg_superseded"  # a session the round left for a new one: its task answers nothing


def session_of(task: Task) -> str | None:
    """The masking session a task's round runs under, or None for an unmasked round."""
    sid = task.config.get("secagg_session")
    return sid if isinstance(sid, str) and sid else None


VectorFn = Callable[..., Any]  # as expand_vector


def _retrieved(fut: asyncio.Future[Any]) -> asyncio.Future[Any]:
    """``fut``, its exception retrieved once done, so that asyncio does not log one nobody awaited."""
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut


def expand_vector(
    session: DeviceSession, ring: MaskRing, count: int, among: Sequence[str] | None = None, undo: bool = False
) -> Any:
    """``session``'s mask vector of ``count`` elements in ``ring``: with its partners (its relay taken) or
    the neighbours ``among``; ``undo``: the pairwise masks with ``among`` alone, negated (to take them out
    of a vector expanded with more neighbours than became partners)."""
    if undo:
        return ring.expand_sum([(seed, -sign) for seed, sign in session.pair_terms(among)], count)
    return ring.expand_sum(session.mask_terms(among), count)


def mask_shape(task: Task, size: int, he: HEBackend | None) -> tuple[MaskRing, int] | None:
    """The ring and length of the mask vector ``task`` will take for an update of ``size`` values (None
    for an unmasked round, or an HE round without the device's backend)."""
    if session_of(task) is None:
        return None
    if str(task.config.get("mask", "none")) == "none":
        return plain_encoding(task.config)[1], size
    return None if he is None else (he.mask_ring(), he.mask_count(size))


@dataclass
class _Live:
    session: DeviceSession
    ready: asyncio.Future[None]
    sent_shares: bool = False
    failures: list[str] = field(default_factory=list)
    shape: tuple[MaskRing, int] | None = None  # the mask vector the task will take
    draft: tuple[frozenset[str], asyncio.Future[Any]] | None = None  # ... with the roster's neighbours
    vector: asyncio.Future[Any] | None = None  # ... with the partners, once the relay is in
    keys_sent: asyncio.Future[Any] | None = None  # the keys' publication, acknowledged or failed

    def fail(self, exc: ValidationError) -> None:
        if not self.ready.done():
            self.ready.set_exception(MaskingRefused(exc.code, exc.reason, round_id=self.session.ctx.round_id))


class Masking:
    """One device's masking sessions by (round, cluster)."""

    def __init__(
        self,
        device: DeviceState,
        link: Link,
        *,
        signer: Signer | None,
        trust: Trust,
        min_aggregate: int,
    ) -> None:
        if isinstance(min_aggregate, bool) or not isinstance(min_aggregate, int) or min_aggregate < 2:
            raise ConfigError(f"min_aggregate must be an integer >= 2, got {min_aggregate!r}")
        self.device = device
        self.link = link
        self.signer = signer
        self.trust = trust
        self.min_aggregate = int(min_aggregate)
        self.certificates: dict[str, bytes] = {}  # neighbours' certificates, checked, by id
        self._cert_sent = -1  # the hello after which this device's certificate last went out
        self._live: dict[tuple[int, int], _Live] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unsigned_said = False
        self.vector: VectorFn = expand_vector  # how a mask vector is expanded (the fleet emulation times it)

    @classmethod
    def with_identity(
        cls,
        device: DeviceState,
        link: Link,
        tls: TlsConfig | None,
        min_aggregate: int,
    ) -> Masking:
        """A device's sessions: signed with its client certificate, neighbours checked against its CA, when
        it has a fleet identity (mutual TLS); unsigned otherwise."""
        if tls is not None and tls.cert_file is not None and tls.key_file is not None:
            signer, trust = Signer(tls.cert_file, tls.key_file), Trust.from_file(tls.ca_file)
            return cls(device, link, signer=signer, trust=trust, min_aggregate=min_aggregate)
        return cls(device, link, signer=None, trust=Trust(), min_aggregate=min_aggregate)

    def _key(self, msg: Task | MaskRoster | MaskRelay | UnmaskRequest) -> tuple[int, int]:
        return msg.round_id, msg.cluster_id

    def _find(self, msg: MaskRoster | MaskRelay | UnmaskRequest) -> _Live:
        live = self._live.get(self._key(msg))
        if live is None or live.session.ctx.session != msg.session:
            raise ValidationError("stale_round", f"a masking message for session {msg.session}, not ours")
        return live

    def can_rerun(self, task: Task) -> bool:
        """Whether ``task`` (a round this device took a task of before) may run again under its session."""
        sid = session_of(task)
        live = self._live.get(self._key(task))
        return (
            sid is not None
            and live is not None
            and live.session.ctx.session != sid
            and not live.session.revealed
        )

    async def begin(self, task: Task, publish: Publish) -> None:
        """Start ``task``'s session (nothing for an unmasked task) and send its keys without waiting for
        the broker's acknowledgement (the device trains meanwhile; :meth:`blind_for` raises a failed
        publication); the same session again re-sends what it sent. MaskingRefused when the round's update
        is already in another sum."""
        sid = session_of(task)
        if sid is None:
            return
        self._loop = asyncio.get_running_loop()
        key = self._key(task)
        live = self._live.get(key)
        if live is not None and live.session.ctx.session == sid:
            await self.resend(task, publish)
            return
        if live is not None and live.session.revealed:
            raise MaskingRefused(
                "secagg_spent",
                f"round {task.round_id} again under another masking session: this device's update is "
                "already in a sum, it is not sent into a second one",
                round_id=task.round_id,
            )
        ctx = Context(self.device.federation, task.round_id, task.cluster_id, sid)
        session = DeviceSession(
            ctx,
            self.device.client_id,
            trust=self.trust,
            signer=self.signer,
            min_aggregate=self.min_aggregate,
            send_certificate=self._cert_sent != self.link.hellos,  # a new coordinator may not have it
        )
        live = self._live[key] = _Live(session, self._loop.create_future())
        for old in [k for k in self._live if k[0] < task.round_id - KEEP_ROUNDS]:
            self._forget(old)
        live.keys_sent = asyncio.ensure_future(publish(T.KEYS, session.keys))
        _retrieved(live.keys_sent)
        if session.keys.certificate:
            self._cert_sent = self.link.hellos

    def expect(self, task: Task, ring: MaskRing, count: int) -> None:
        """``task`` will take a mask vector of ``count`` elements in ``ring``: expand it as soon as the
        relay is in, while the device trains."""
        live = self._live.get(self._key(task))
        if live is None or live.session.ctx.session != session_of(task) or live.shape is not None:
            return
        live.shape = (ring, count)
        self._expand_ahead(live)

    def _expand_ahead(self, live: _Live) -> None:
        """Start the draft once the roster is in, the vector once the relay is (module docstring)."""
        ready, session = live.ready, live.session
        if live.shape is None or live.vector is not None or ready.cancelled():
            return
        if not ready.done():
            if live.draft is None and session.neighbours:
                among = frozenset(session.neighbours)
                live.draft = (among, self._expand(session, *live.shape, sorted(among)))
            return
        if ready.exception() is not None:
            return
        if live.draft is None:
            live.vector = self._expand(session, *live.shape)
            return
        among, draft = live.draft
        gone = sorted(among - set(session.partners))
        if gone:
            draft = asyncio.ensure_future(self._corrected(live, draft, gone))
            _retrieved(draft)
        live.vector = draft

    def _expand(self, session: DeviceSession, ring: MaskRing, count: int, *args: Any) -> asyncio.Future[Any]:
        assert self._loop is not None
        fut = self._loop.run_in_executor(None, self.vector, session, ring, count, *args)
        return _retrieved(fut)

    async def _corrected(self, live: _Live, draft: asyncio.Future[Any], gone: list[str]) -> Any:
        """The draft without the masks of the neighbours ``gone`` (they did not become partners)."""
        assert live.shape is not None
        ring, _ = live.shape
        undo = await self._expand(live.session, *live.shape, gone, True)
        return ring.add(await draft, undo)

    def close(self) -> None:
        """End every session: a training step waiting for its relay stops at once (``secagg_state``)."""
        for key in list(self._live):
            self._forget(key)

    def _forget(self, key: tuple[int, int]) -> None:
        live = self._live.pop(key)
        if not live.ready.done():
            live.ready.cancel()
        elif not live.ready.cancelled():
            live.ready.exception()  # retrieved, so that asyncio does not log it as never retrieved

    def supersede(self, task: Task) -> None:
        """``task`` runs its round under a new session (the round failed and runs again): a task of the old
        session still waiting for its relay stops at once, sending nothing (``secagg_superseded``), so that
        the new one need not wait for it."""
        sid = session_of(task)
        live = self._live.get(self._key(task))
        if sid is not None and live is not None and live.session.ctx.session != sid and not live.ready.done():
            live.ready.set_exception(
                MaskingRefused(SUPERSEDED, "the round runs again under a new session", round_id=task.round_id)
            )

    async def resend(self, task: Task, publish: Publish) -> None:
        """What ``task``'s session sent so far, again (the coordinator asked again)."""
        live = self._live.get(self._key(task))
        if live is None or live.session.ctx.session != session_of(task):
            return
        await publish(T.KEYS, live.session.keys)
        shares = live.session.shares
        if shares is not None:
            await publish(T.SHARES, shares)

    async def on_roster(self, roster: MaskRoster, publish: Publish) -> None:
        live = self._find(roster)
        try:
            shares = live.session.on_roster(roster, self.certificates)
        except ValidationError as exc:
            live.fail(exc)
            raise
        if self.trust.ca is None and not self._unsigned_said:
            self._unsigned_said = True
            log.info("masking keys of neighbours are accepted unsigned (no client certificate, no CA): the "
                     "coordinator could invent devices; a fleet with mutual TLS checks them")  # fmt: skip
        for cid, _, _, _, _, cert in roster.entries():
            if (
                cert
                and live.session.neighbours.get(cid, None) is not None
                and live.session.neighbours[cid].certified
            ):
                self.certificates[cid] = cert
        await publish(T.SHARES, shares)
        self._expand_ahead(live)

    def on_relay(self, relay: MaskRelay) -> None:
        live = self._find(relay)
        try:
            live.session.on_relay(relay)
        except ValidationError as exc:
            live.fail(exc)
            raise
        if not live.ready.done():
            live.ready.set_result(None)
        self._expand_ahead(live)

    async def on_unmask(self, req: UnmaskRequest, publish: Publish) -> None:
        live = self._find(req)
        answer = live.session.on_unmask(req)
        await publish(T.UNMASK, answer)
        log.debug("round %d: unmask shares sent for %d owners", req.round_id, len(answer.owners))

    async def take(self, msg: MaskRoster | MaskRelay | UnmaskRequest, topic: str, link: Link) -> None:
        """A message of a masking session, on the message loop: checked (an unmask request comes on the
        cluster topic, the rest on this device's), answered. A refusal is logged and counted; the task
        waiting on the session answers its round with the reason."""
        publish = link.publish
        if topic != (link.cluster_topic if isinstance(msg, UnmaskRequest) else link.down_topic):
            self.device.rejected.add("bad_kind")
            link.said.warning("bad_kind", "unexpected %s on %s", type(msg).__name__, topic)
            return
        try:
            if isinstance(msg, MaskRoster):
                await self.on_roster(msg, publish)
            elif isinstance(msg, MaskRelay):
                self.on_relay(msg)
            else:
                await self.on_unmask(msg, publish)
        except ValidationError as exc:
            self.device.rejected.add(exc.code)
            link.said.warning(exc.code, "round %d: masking refused: %s", msg.round_id, exc.reason)

    # -- in the executor --------------------------------------------------------------------------
    def blind_for(self, task: Task, ring: MaskRing, count: int) -> Any:
        """The mask vector of ``task``'s session in ``ring`` (``count`` elements), once the relay arrived.
        Called from the training step's thread; waits up to the task's deadline. MaskingRefused when the
        session failed or the relay did not come."""
        live = self._live.get(self._key(task))
        if live is None or live.session.ctx.session != session_of(task) or self._loop is None:
            raise MaskingRefused("secagg_state", "no masking session for this task", round_id=task.round_id)

        async def ready() -> Any:
            if live.keys_sent is not None:
                await asyncio.shield(live.keys_sent)  # a TransportError: the round's error reply says so
            await asyncio.shield(live.ready)
            if live.vector is not None and live.shape == (ring, count):
                return await asyncio.shield(live.vector)
            return None

        try:
            ahead = asyncio.run_coroutine_threadsafe(ready(), self._loop).result(timeout=task.deadline_s)
        except concurrent.futures.CancelledError:
            raise MaskingRefused(
                "secagg_state", "the masking session ended", round_id=task.round_id
            ) from None
        except concurrent.futures.TimeoutError:
            raise MaskingRefused(
                "secagg_timeout",
                f"the partners' shares did not arrive within the round's {task.deadline_s:.0f} s: the round "
                "went on without this device",
                round_id=task.round_id,
            ) from None
        return ahead if ahead is not None else self.vector(live.session, ring, count)
