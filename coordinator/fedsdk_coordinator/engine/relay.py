"""Getting a device its cluster's model under HE, where only the devices hold it.

A device that lacks the model its cluster trains from (it joined late, its process restarted without a state
directory, or it was down while rounds went by) used to get the federation's *initial* model in its task
and send an update computed against it, which the cluster's aggregate then mixed with everyone else's: a
silent error in the model that the device kept making. Now the coordinator asks a device of the cluster
that holds the newest model (:class:`~fedsdk.protocol.ModelRequest`) to seal it for the one that lacks it;
the holder answers on its ``up/<id>/model`` topic and the coordinator relays the sealed bytes unchanged to
the device's ``down`` topic (:mod:`fedsdk.client.relay`). The seal's key comes from the HE secret key, which
the coordinator never holds: it relays a model it cannot read.

Decisions:

* **Who lacks a model**: a device whose model (the round it said in its hello, or the last round it
  reported) is older than the newest one an online device of its cluster holds, when that one is not the
  initial model (the coordinator sends the initial model itself). Relayed only in key mode ``shared``:
  under the key server the devices do not hold the key the seal needs, and nothing else can give a device
  the model without showing it to the coordinator. There such a device is **left out of the rounds**, with
  a warning naming what would get it in (its state directory, or key mode ``shared``): it used to get the
  initial model, and its updates, computed against it, went into every later aggregate of its cluster.
* **Not tasked while it lacks one**: a round is planned without it (after waiting up to
  :data:`RELAY_WAIT_S` for the relay: a device that lacks a model at the end of a round usually holds it
  moments later), and a task of a round it is already in waits until its next hello says it holds the
  model; the round's deadline bounds that wait as for any missing reply.
* **A model no online device holds is waited for, then given up loudly.** The coordinator knows the newest
  round each cluster aggregated (its stored encrypted aggregates) but cannot read it. When no online device
  of the cluster holds that round's model (its holders are offline: the devices back first are new ones,
  or ones that lost or missed it), the round is planned only after a device holding it says hello, for up
  to :data:`RELAY_WAIT_S` (at most one deadline); then it goes on from the newest model an online device
  holds (the initial one if none), with a warning naming the rounds whose progress is lost, counted in
  ``model_rounds_lost`` (``/api/health``, ``fedsdk_model_rounds_lost_total``). Decision: wait and then go
  on, not wait forever: holders that never come back would stop the federation, and a loud regression
  can be acted on; before, the cluster silently restarted from whatever its online devices held. Not
  rebuilt from the stored encrypted aggregates (any key holder could decrypt them and add them up): each
  round's aggregate tells a device that did not take part in that round more than the model, their sum,
  does; in a cluster of two or three devices, nearly another device's update of that round.
* **A model of another run is no model**: a device's state directory outlives the coordinator's (a
  service install keeps ``/var/lib/fedsdk``; the operator starts the federation over with a new coordinator
  state directory under the same name). Such a device said in its hello that it held, say, round 2's model
  while the new coordinator had aggregated nothing: it was counted as its cluster's holder of the newest
  model, sealed that model for every other device, and all of them then failed round 1 on a model "not from
  before round 1" (``tests/integration/test_model_of_another_run.py``). Now a hello whose model is of
  another run is taken as holding no model, with a warning, and the device's task carries the federation's
  model, which replaces the kept one. Another run: the hello names the run its model is of
  (``model_run``, the ``config["run"]`` of the task it came from) and it is not this coordinator's
  (:meth:`Store.run_tag`, kept with the state directory); or, from a device that does not say (earlier
  versions, files kept by them), the model's round is newer than any round kept here (every aggregate is
  kept before it is published, so no device of this run can hold one).
* **One request at a time** per device, sent again to the then-best holder after :data:`RELAY_WAIT_S`
  (a holder that left, or one whose answer was lost), and no sooner after a model was relayed to it that it
  did not take (its hello says an older round; asking again at once went round in a loop).
  A plan waits for a device's first request only: a relay that failed once does not hold every later
  round up as well.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import TYPE_CHECKING

from fedsdk.errors import ValidationError
from fedsdk.protocol import ModelRequest, SealedModel, encode
from fedsdk.protocol import topics as T
from fedsdk_coordinator.engine.cluster import ROUND_LINES
from fedsdk_coordinator.engine.config import RoundConfig

if TYPE_CHECKING:
    from fedsdk_coordinator.rounds import RoundEngine
    from fedsdk_coordinator.store import Store

__all__ = ["RELAY_WAIT_S", "ModelRelays", "cluster_members", "without_lacking"]

log = logging.getLogger("fedsdk_coordinator.rounds")
progress = logging.getLogger(ROUND_LINES)  # the CLI shows these lines by default

RELAY_WAIT_S = 30.0


class ModelRelays:
    """The rounds of the models devices hold, and the relays under way (module docstring)."""

    def __init__(
        self,
        config: RoundConfig,
        post: Callable[[str, bytes], None],
        *,
        he: bool,
        store: Store | None = None,
    ) -> None:
        self.federation = config.federation
        self.enabled = he  # under HE only the devices hold the model
        self.sealed = he and config.key_mode == "shared"  # and they hold the key a relay is sealed under
        self.run = store.run_tag() if store is not None else 0  # the federation's run; 0: unknown
        self._told: set[str] = set()  # devices left out without a relay, warned of
        self._post = post
        self.held: dict[str, int] = {}  # the round of the model each device holds (-1: none)
        # per cluster, the newest round aggregated (also by an earlier instance of the coordinator)
        self.newest: dict[int, int] = store.newest_encrypted() if store is not None and he else {}
        self._given_up: set[tuple[int, int]] = set()  # (cluster, round) whose model was waited for in vain
        self.rounds_lost = 0  # rounds of progress given up that way
        self._asked: dict[str, tuple[str, float, int]] = {}  # device -> (holder asked, when, requests sent)
        self.relayed = 0  # sealed models relayed so far
        self._relayed_at: dict[str, tuple[float, int]] = {}  # device -> when, which round last relayed to it

    def of_another_run(self, model_round: int, model_run: int | None = None) -> bool:
        """Whether a device's model of round ``model_round`` is of an earlier run of a federation of the same
        name, kept by the device's state directory (module docstring): its hello names another run than
        this coordinator's (``model_run``; devices of earlier versions do not say), or its round is newer
        than any round this federation aggregated (also by an earlier instance of the coordinator on the
        same state directory)."""
        if not self.enabled or model_round < 0:
            return False
        if model_run is not None and self.run and model_run != self.run:
            return True
        return model_round > max(self.newest.values(), default=0)

    def heard(self, client_id: str, model_round: int, *, at_least: bool = False) -> None:
        """A device's hello said it holds ``model_round``'s model (``at_least``: a report showed it
        applied that round)."""
        r = int(model_round)
        self.held[client_id] = max(self.held.get(client_id, -1), r) if at_least else r

    def counts(self) -> dict[str, int]:
        """For ``/api/health``: models relayed, and rounds of progress given up."""
        return {"models_relayed": self.relayed, "model_rounds_lost": self.rounds_lost}

    def published(self, cluster_id: int, round_id: int) -> None:
        """``cluster_id``'s aggregate of ``round_id`` went out: the model its devices will hold."""
        self.newest[cluster_id] = max(self.newest.get(cluster_id, 0), int(round_id))

    def stranded(self, members: Mapping[str, int]) -> dict[int, tuple[int, int]]:
        """Per cluster of an online device (``members``: online device -> cluster) whose newest model no
        online device holds and was not given up yet: (that round, the newest an online device holds)."""
        if not self.enabled:
            return {}
        best = self._newest(members, members)
        return {
            k: (self.newest[k], b)
            for k, b in best.items()
            if 1 <= self.newest.get(k, 0) > b and (k, self.newest[k]) not in self._given_up
        }

    def give_up(self, cluster_id: int, newest: int, held: int) -> None:
        """Go on without ``cluster_id``'s model of round ``newest``, from the one of round ``held``."""
        self._given_up.add((cluster_id, newest))
        self.rounds_lost += newest - max(held, 0)

    def offline_holders(
        self, newest: int, online: Iterable[str], in_cluster: Callable[[str], bool]
    ) -> list[str]:
        """The devices known to hold a model of round ``newest`` or later that are not online."""
        on = set(online)
        return sorted(c for c, r in self.held.items() if r >= newest and c not in on and in_cluster(c))

    def _newest(self, online: Iterable[str], members: Mapping[str, int]) -> dict[int, int]:
        """Per cluster, the round of the newest model one of its online devices holds."""
        best: dict[int, int] = {}
        for c in online:
            if c in members:
                best[members[c]] = max(best.get(members[c], -1), self.held.get(c, -1))
        # a device's held round may be of another cluster's model (the trial of proposed clusters takes
        # turns with the shared model: engine/trial.py); no cluster's model is newer than its last aggregate
        return {k: min(b, self.newest[k]) if k in self.newest else b for k, b in best.items()}

    def target(
        self, client_id: str, cluster: int | None, members: Mapping[str, int], online: Iterable[str]
    ) -> int:
        """The round of the model ``client_id`` should get from a device of its cluster, or -1 when it needs
        none (``members``: device -> cluster): the newest its cluster's online devices hold, when that is
        newer than its own and not the initial model (round 0, which the coordinator sends itself)."""
        if not self.enabled or cluster is None:
            return -1
        best = self._newest(online, members).get(cluster, -1)
        return best if 1 <= best > self.held.get(client_id, -1) else -1

    def lacking(self, online: Iterable[str], members: Mapping[str, int]) -> set[str]:
        """The online devices that lack their cluster's newest model (:meth:`target` for all at once)."""
        if not self.enabled:
            return set()
        ids = [c for c in online if c in members]
        best = self._newest(ids, members)
        return {c for c in ids if 1 <= best[members[c]] > self.held.get(c, -1)}

    def request(self, client_id: str, members: Mapping[str, int], online: Iterable[str]) -> bool:
        """Ask the device of ``client_id``'s cluster that holds the newest model to seal it for
        ``client_id``, unless a request is under way; False when it needs no model (True: do not task it;
        under the key server nothing is asked and it stays left out)."""
        ids, cluster = list(online), members.get(client_id)
        target = self.target(client_id, cluster, members, ids)
        if target < 0:
            self._asked.pop(client_id, None)
            self._relayed_at.pop(client_id, None)
            self._told.discard(client_id)
            return False
        if not self.sealed:  # under the key server: nobody can give it the model; left out, said once
            if client_id not in self._told:
                self._told.add(client_id)
                progress.warning(
                    "device %s lacks cluster %s's model of round %d and is left out of its rounds: under the "
                    "key server no device can seal the model for it (give it back its state directory, or "
                    "run the federation in key mode shared)",
                    client_id, cluster, target,
                )  # fmt: skip
            return True
        now = time.monotonic()
        asked = self._asked.get(client_id)
        if asked is not None and now - asked[1] < RELAY_WAIT_S:
            return True
        when, given = self._relayed_at.get(client_id, (-RELAY_WAIT_S, -1))
        if now - when < RELAY_WAIT_S and self.held.get(client_id, -1) < given:
            return True  # relayed moments ago and it did not take it: not at once again
        sent = 1 if asked is None else asked[2] + 1
        assert cluster is not None  # a target implies a cluster
        holders = [
            c for c in ids if c != client_id and members.get(c) == cluster and self.held.get(c, -1) >= target
        ]
        holder = min(holders, key=lambda c: (self.held.get(c) != target, c))
        self._asked[client_id] = (holder, now, sent)
        msg = ModelRequest(round_id=target, cluster_id=cluster, for_client=client_id)
        self._post(T.down(self.federation, holder), encode(msg))
        log.info(
            "device %s lacks cluster %d's model of round %d: %s seals it for it",
            client_id, cluster, target, holder,
        )  # fmt: skip
        return True

    def first_tries(self, ids: Iterable[str]) -> set[str]:
        """Those of ``ids`` whose first request is under way (what a plan waits for)."""
        now = time.monotonic()
        return {
            c
            for c in ids
            if (a := self._asked.get(c)) is not None and a[2] == 1 and now - a[1] < RELAY_WAIT_S
        }

    def on_sealed(self, client_id: str, msg: SealedModel, payload: bytes, online: Iterable[str]) -> None:
        """A holder's sealed model: relayed, as received, to the device it was asked for."""
        asked = self._asked.get(msg.for_client)
        if asked is None or asked[0] != client_id:
            raise ValidationError("unasked", f"model from {client_id} for {msg.for_client}, not asked for")
        if msg.for_client not in set(online):
            self._asked.pop(msg.for_client, None)
            raise ValidationError("stale_round", f"model for {msg.for_client}, which left")
        self._post(T.down(self.federation, msg.for_client), payload)
        self._asked.pop(msg.for_client, None)  # its next hello says what it holds now
        self._relayed_at[msg.for_client] = (time.monotonic(), msg.round_id)
        self.relayed += 1
        progress.info(  # shown by default, as the rounds are
            "device %s lacked cluster %d's model: relayed round %d's, sealed by %s (%d bytes)",
            msg.for_client, msg.cluster_id, msg.round_id, client_id, len(msg.sealed),
        )  # fmt: skip


def cluster_members(e: RoundEngine) -> dict[str, int]:
    """The cluster of each online device (every one in cluster 0 when the federation is not clustered; a
    clustered federation's device without a cluster yet is not in it)."""
    if e.clustered:
        return {c: k for c, k in e.clusters.items() if c in e.online}
    return dict.fromkeys(e.online, 0)


async def without_lacking(e: RoundEngine, round_id: int) -> list[str]:
    """The online devices that hold their cluster's model, once the models the others lack were asked for and
    waited for a while (module docstring)."""
    await _wait_for_holders(e, round_id)
    relays, members = e.relays, cluster_members(e)
    lacking = relays.lacking(e.online, members)
    if lacking:
        for cid in sorted(lacking):
            relays.request(cid, members, e.online)
        wait_s = min(RELAY_WAIT_S, e.config.deadline_s)
        first = relays.first_tries(lacking)
        if first:
            await e.presence_until(lambda: not first & relays.lacking(e.online, cluster_members(e)), wait_s)
        lacking = relays.lacking(e.online, cluster_members(e))
        if lacking:
            why = (
                f"no model of their cluster reached them within {wait_s:.0f} s"
                if relays.sealed
                else ("they lack their cluster's model, which the key server's devices cannot relay")
            )
            log.warning("round %d runs without %s: %s", round_id, ", ".join(sorted(lacking)), why)
    return [c for c in e.online if c not in lacking]


def _in_cluster(e: RoundEngine, cluster: int, client_id: str) -> bool:
    return not e.clustered or e.clusters.get(client_id) == cluster


async def _wait_for_holders(e: RoundEngine, round_id: int) -> None:
    """When no online device of a cluster holds its newest model: wait for one to say hello, then go on from
    the newest model an online device holds, with a warning (module docstring)."""
    relays = e.relays
    stranded = relays.stranded(cluster_members(e))
    if not stranded:
        return
    wait_s = min(RELAY_WAIT_S, e.config.deadline_s)
    for k, (newest, _) in sorted(stranded.items()):
        away = relays.offline_holders(newest, e.online, partial(_in_cluster, e, k))
        progress.warning(
            "cluster %d: no online device holds its model of round %d (offline: %s); round %d waits up to "
            "%.0f s for one to return",
            k, newest, ", ".join(away) or "none known", round_id, wait_s,
        )  # fmt: skip
    await e.presence_until(lambda: not relays.stranded(cluster_members(e)).keys() & stranded.keys(), wait_s)
    for k, (newest, held) in sorted(relays.stranded(cluster_members(e)).items()):
        if k not in stranded:
            continue
        relays.give_up(k, newest, held)
        progress.warning(
            "cluster %d goes on from %s: no device holding its model of round %d returned within %.0f s; "
            "the progress of rounds %d-%d is lost",
            k, f"round {held}'s model" if held > 0 else "the initial model", newest, wait_s,
            max(held, 0) + 1, newest,
        )  # fmt: skip
