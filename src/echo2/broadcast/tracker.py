"""The learner's side of snapshot broadcast: kept snapshots (chunked, signed), the chain plan of each
version, peer scores, the Bw estimate, install times and T_bcast.

Pure bookkeeping with the caller's clock, no I/O and no lock of its own: `CoordinatorState` owns one
and calls it under its lock, passing the workers that are alive now (`Peer`). Policies come from
`echo2.broadcast.plan` (scores, N_ch, chain assembly, excision).

- **Plan.** At each publication the live workers are scored (Appendix C.3) and laid out as
  N_ch = floor(B0 / Bw_hat) chains (mode "chain") or all fed by the learner (mode "star"). Bw_hat is
  the median rate of the last 20 credited transfers, the configured figure until then.
  Speed in the scores compares a relay's median credited rate with the lower quartile of the
  last 20 credited relay transfers (Bw_hat until there are 3); the peers' rate (their median) sets
  the relay floor. A worker with no relay server, one that failed as a parent
  more than 3 times in a row, or one demoted as slow since the last plan, is only a tail. Relays
  with a credited transfer rank above newcomers; ties (and the choice among equally short chains
  for a late joiner) follow a random order drawn from a secret seed and the version, never the
  worker id, so re-registering buys no rank (plan.tie_order).
- **What a claim can move.** A relay's transfer is a claim of two workers that may collude, so its
  weight is bounded by what the coordinator can check: a relay forwards a version as it receives
  it, so its transfer counts only once its own receipt of that version is credited (held until
  then) and at most at that receipt's rate; the chain's head received from the learner, whose
  streams the coordinator times itself, so every credited rate is bounded by a rate the coordinator
  measured or an honest sender confirmed, and a pair confirming each other's invented transfers
  is credited at their upstream's rate at best. Each relay earns at most one credit (score and rate
  sample) per version; a sample enters the medians clipped to within a factor CLIP of the current
  estimate (broadcast/credits.py); Speed is from the relay's median rate, 100 at the peers' lower quartile, so a relay
  within the measurement noise of its peers scores as any other (ties: the seeded order).
- **Route.** A worker asks whom to receive a version from. One that joined after the publication is
  appended to the shortest chain whose tail may relay (else fed by the learner); a parent that has
  been lost since planning is excised first.
- **Failure.** A receiver reports its parent: the parent's score falls, it is excised (its tail
  reattaches to the nearest healthy upstream peer, or the learner), and it may not get a child for
  this version again; the receiver gets its new parent.
- **Slow relays.** A route to a relay carries a rate floor (`relay_floor`: a fraction of the peers'
  rate, once 3 relay transfers are credited); a receiver whose chunks from that relay arrive below
  it, over a progress timeout of reading, reports it `slow`. The relay leaves the plan (a failure
  for its score; it may not get a child for this version again), and since it is still receiving,
  its tail moves behind the tail of the shortest other chain that may relay (a peer with free
  upload; the relay's parent is still busy feeding it, and a new learner stream would take its
  share of B0 from every seed), or to its parent if there is none. It is demoted: only a tail in
  the next plan, then ranked by its score again. A receiver can demote one parent per version
  (its later routes for that version carry no floor, and a second `slow` report only re-routes
  it), so a worker whose own downlink is the bottleneck cannot demote every relay it is given.
- **Transfers.** A transfer counts for its parent's score (and for Bw_hat) only once the
  coordinator's route, the receiver's install report and the sender's own account agree
  (broadcast/transfers.py); a worker cannot credit itself or a parent it was not given.
- **Installed.** A receiver reports the exact moment it runs a version; who runs what since when,
  and T_bcast, are kept by `Installs` (broadcast/installs.py).
- **Eviction.** The newest `keep` (S + 1) versions are kept; an older one only as long as a live
  worker is still receiving it.
"""

from __future__ import annotations

import math
import secrets
from collections import Counter
from dataclasses import dataclass

from echo2.broadcast.blob import NotKept, SnapshotBlob
from echo2.broadcast.credits import RateCredits
from echo2.broadcast.installs import Installs
from echo2.broadcast.plan import (
    ChainPlan,
    PeerInfo,
    PeerStats,
    ScoreParams,
    plan_broadcast,
    relay_floor,
    tie_order,
)
from echo2.broadcast.transfers import Credit, TransferLedger
from echo2.config import SLOW_RELAY_FRACTION


class WrongSnapshot(ValueError):
    """A worker reports installing bytes that differ from the published snapshot."""


SCORE_PARAMS = ScoreParams(median=True)
"""Relays' Speed from the median of their recent credited rates (one claim: one order statistic)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BroadcastPolicy:
    mode: str = "chain"
    """"chain" or "star"."""
    chunk_size: int = 4 * 2**20
    uplink_budget_bps: float | None = None
    """B0 in bytes/s for planning; None: unlimited (every worker is a seed)."""
    worker_bps: float = 100e6 / 8
    """Bw_hat in bytes/s until transfers are measured."""
    slow_relay_fraction: float = SLOW_RELAY_FRACTION
    """A relay delivering below this fraction of its peers' measured rate is demoted; 0: never."""
    delta: bool = False
    """Publish, beside each snapshot, a delta from the previous one (coordinator/publisher.py);
    runs take `broadcast.delta` (on by default)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Peer:
    """A live worker, as the broadcast bookkeeping needs to know it."""

    worker_id: str
    relay_url: str | None
    """Where its relay server listens; None: it cannot serve a child."""
    registered_at: float


class BroadcastState:
    def __init__(self, policy: BroadcastPolicy, *, seed: int | None = None) -> None:
        if policy.mode not in ("chain", "star"):
            raise ValueError(f"broadcast mode must be 'chain' or 'star', not {policy.mode!r}")
        self.policy = policy
        self.seed = secrets.randbits(64) if seed is None else seed
        """Secret: the tie-break order of each version's plan is drawn from it (plan.tie_order)."""
        self.snapshots: dict[int, SnapshotBlob] = {}
        self.plans: dict[int, ChainPlan] = {}
        self.leaf_only: dict[int, set[str]] = {}
        """Per version, parents excised for it: they may not get a child again for that version."""
        self.receiving: dict[int, set[str]] = {}
        """Per version, workers that asked for a route and do not run it (or newer) yet."""
        self.credits = RateCredits()
        """What agreed transfers count for: rates, one credit per relay and version (broadcast/credits.py)."""
        self.installs = Installs()
        """Who runs which version since when, and T_bcast (broadcast/installs.py)."""
        self.stats: dict[str, PeerStats] = {}
        self.slow_reported: dict[int, set[str]] = {}
        """Per version, receivers that demoted a parent as slow (one each per version)."""
        self.failures: Counter[str] = Counter()
        """Parent failures reported by receivers, by reason."""
        self.bytes_served = 0
        """Snapshot bytes the learner itself sent (chunk streams and whole downloads)."""
        self.ledger = TransferLedger()
        """Routes given and both sides' accounts of each transfer, until they agree."""

    # ------------------------------------------------------------------ planning
    def bw_hat(self) -> float:
        return self.credits.bw_hat(self.policy.worker_bps)

    def peer_bps(self) -> float | None:
        """The peers' measured relay rate (bytes/s), None until PEER_RATE_SAMPLES are credited."""
        return self.credits.peer_bps()

    def reference_bps(self) -> float:
        """What Speed is measured against (RateCredits.reference_bps; Bw_hat until measured)."""
        return self.credits.reference_bps(self.bw_hat())

    def relay_floor(self, worker_id: str, version: int, parent_id: str | None) -> float | None:
        """The rate floor (bytes/s) of a route: below it the receiver reports its relay `slow`.
        None for the learner, in star mode, before the peers' rate is measured, and once this
        receiver has demoted a parent for this version."""
        if parent_id is None or self.policy.mode != "chain":
            return None
        if worker_id in self.slow_reported.get(version, ()):
            return None
        return relay_floor(self.peer_bps(), self.policy.slow_relay_fraction)

    def _stats(self, worker_id: str) -> PeerStats:
        stats = self.stats.get(worker_id)
        if stats is None:
            stats = self.stats[worker_id] = PeerStats(params=SCORE_PARAMS)
        return stats

    def _can_relay(self, worker_id: str, peers: dict[str, Peer]) -> bool:
        stats = self.stats.get(worker_id)
        return peers[worker_id].relay_url is not None and (stats is None or stats.may_relay())

    def tie_seed(self, version: int) -> int | None:
        """The seed of `version`'s tie-break order (None: by worker id, for tests that subclass)."""
        return hash((self.seed, version)) & (2**64 - 1)

    def make_plan(self, peers: dict[str, Peer], now: float, version: int = 0) -> ChainPlan:
        reference = self.reference_bps()
        infos = [
            PeerInfo(
                worker_id=w,
                score=(self.stats[w] if w in self.stats else PeerStats()).score(now, reference),
                inbound=self._can_relay(w, peers),
                established=w in self.stats and self.stats[w].successes > 0,
            )
            for w in sorted(peers)
        ]
        return plan_broadcast(
            infos,
            mode=self.policy.mode,
            uplink_bps=self.policy.uplink_budget_bps or math.inf,
            worker_bps=self.bw_hat(),
            seed=self.tie_seed(version),
        )

    def publish(self, blob: SnapshotBlob, peers: dict[str, Peer], now: float, *, keep: int) -> None:
        v = blob.version
        self.snapshots[v] = blob
        self.installs.published(v, now)
        self.plans[v] = self.make_plan(peers, now, v)
        for w in peers:  # a demoted relay has sat out this plan as a tail
            if w in self.stats:
                self.stats[w].demoted = False
        self.leaf_only[v] = set()
        self.receiving[v] = set()
        self.slow_reported[v] = set()
        self.evict(keep, peers)

    def evict(self, keep: int, peers: dict[str, Peer]) -> None:
        for v in sorted(self.snapshots)[:-keep]:
            if not self.receiving.get(v, set()) & peers.keys():
                del self.snapshots[v]
                self.plans.pop(v, None)
                self.leaf_only.pop(v, None)
                self.receiving.pop(v, None)
                self.slow_reported.pop(v, None)
                self.ledger.forget(v)
                self.credits.forget(v)

    # ------------------------------------------------------------------ routing
    def route(
        self, worker_id: str, version: int, peers: dict[str, Peer], now: float | None = None
    ) -> tuple[str | None, str | None]:
        """(parent worker id, its relay URL); (None, None) means the learner. With `now`, the
        route is noted so a transfer over it may later count (broadcast/transfers.py)."""
        plan = self.plans.get(version)
        if plan is None:
            raise NotKept(version)
        while True:
            try:
                parent = plan.parent_of(worker_id)
            except KeyError:
                plan = self._attach(plan, worker_id, version, peers)
                continue
            if parent is None or parent in peers:
                break
            plan = plan.excise(parent)  # lost since the plan was made
        self.plans[version] = plan
        if not self.installs.runs(worker_id, version):
            self.receiving[version].add(worker_id)
        if now is not None:
            self.ledger.route(version, parent, worker_id, now)
        return parent, (peers[parent].relay_url if parent is not None else None)

    def _open_tails(self, plan: ChainPlan, version: int, peers: dict[str, Peer]) -> set[str]:
        """Chain tails that may take a child for this version (live, may relay, not excised)."""
        return {
            chain[-1]
            for chain in plan.chains
            if chain[-1] in peers
            and self._can_relay(chain[-1], peers)
            and chain[-1] not in self.leaf_only[version]
        }

    def _attach(self, plan: ChainPlan, worker_id: str, version: int, peers: dict[str, Peer]) -> ChainPlan:
        """A worker the plan does not know: the new tail of the shortest chain whose tail may relay."""
        chains = list(plan.chains)
        if plan.mode == "chain":
            tails = self._open_tails(plan, version, peers)
            open_tails = [i for i, chain in enumerate(chains) if chain[-1] in tails]
            if open_tails:
                seed = self.tie_seed(version)
                i = min(open_tails, key=lambda i: (len(chains[i]), tie_order(seed, chains[i][-1])))
                chains[i] = chains[i] + (worker_id,)
                return ChainPlan(chains=tuple(chains), mode=plan.mode)
        return ChainPlan(chains=(*chains, (worker_id,)), mode=plan.mode)

    def failure(
        self,
        worker_id: str,
        version: int,
        parent_id: str | None,
        reason: str,
        peers: dict[str, Peer],
        now: float,
    ) -> tuple[str | None, str | None]:
        """A receiver's parent failed: score it down and excise it if it is still that receiver's
        parent (a report about an old parent changes nothing); returns the receiver's new route.
        Reason "slow" also demotes the parent for the next plan, once per receiver and version."""
        plan = self.plans.get(version)
        if plan is None:
            raise NotKept(version)
        self.failures[reason] += 1
        try:
            current = plan.parent_of(worker_id)
        except KeyError:
            current = None
        if parent_id is not None and parent_id == current:
            slow = self.slow_reported.setdefault(version, set())
            if reason == "slow" and worker_id in slow:  # its own link is the likelier culprit
                return self.route(worker_id, version, peers, now)
            if reason == "slow":  # still receiving: its tail moves behind a free chain tail
                slow.add(worker_id)
                self._stats(parent_id).record_slow(now)
                self.plans[version] = plan.demote(parent_id, self._open_tails(plan, version, peers))
            else:
                if reason != "gone":  # a parent that dropped an old version did nothing wrong
                    self._stats(parent_id).record_failure(now)
                self.plans[version] = plan.excise(parent_id)
            self.leaf_only[version].add(parent_id)
        return self.route(worker_id, version, peers, now)

    def forget(self, worker_id: str) -> None:
        """A worker was lost: excise it from every plan (its receivers will be routed around it)."""
        for v, plan in self.plans.items():
            self.plans[v] = plan.excise(worker_id)
        self.installs.forget(worker_id)

    # ------------------------------------------------------------------ installs and T_bcast
    def installed(
        self,
        worker_id: str,
        version: int,
        sha256: str,
        transfers: list[tuple[str | None, int, float]],
        peers: dict[str, Peer],
        now: float,
    ) -> None:
        """An exact install report, with the (parent, bytes, seconds) segments the chunks came in
        (the receiver's accounts: each counts once the sender's agrees)."""
        blob = self.snapshots.get(version)
        if blob is not None and blob.sha256 != sha256:
            raise WrongSnapshot(f"sha256 {sha256[:12]}... is not the one published for version {version}")
        for parent_id, nbytes, seconds in transfers if blob is not None else ():
            key = (version, parent_id, worker_id)
            self._credit(
                version, self.ledger.received(key, nbytes, seconds, size=len(blob.data), now=now), now
            )
        self.note_version(worker_id, version, now)
        self.installs.update(peers)

    def sent(
        self, parent_id: str | None, version: int, receiver_id: str, nbytes: int, seconds: float, now: float
    ) -> None:
        """A sender's own account of a stream (None: the learner's, measured by the coordinator)."""
        blob = self.snapshots.get(version)
        if blob is not None:
            key = (version, parent_id, receiver_id)
            self._credit(version, self.ledger.sent(key, nbytes, seconds, size=len(blob.data), now=now), now)

    def _credit(self, version: int, credit: Credit | None, now: float) -> None:
        """Count an agreed transfer (RateCredits.credit); each credited relay transfer also
        counts in that relay's score."""
        self.credits.credit(version, credit, now, record=self._record)

    def _record(self, parent: str, nbytes: int, seconds: float, now: float) -> None:
        self._stats(parent).record_transfer(nbytes, seconds, now)

    def note_version(self, worker_id: str, version: int, now: float) -> bool:
        """The worker runs `version` (and so no longer receives any version up to it). False (and
        O(1)) when that was already known, as on every heartbeat between installs."""
        counted = self.installs.note(worker_id, version, now)
        if counted is None:
            return False
        for v in counted:
            if v in self.receiving:
                self.receiving[v].discard(worker_id)
        return True

    # ------------------------------------------------------------------ reporting
    def status(self, names: dict[str, str], now: float) -> dict:
        newest = max(self.plans, default=None)
        plan = self.plans.get(newest) if newest is not None else None
        return {
            "mode": self.policy.mode,
            "chunk_size": self.policy.chunk_size,
            "bw_hat_mbps": self.bw_hat() * 8 / 1e6,
            "uplink_budget_mbps": (
                None if self.policy.uplink_budget_bps is None else self.policy.uplink_budget_bps * 8 / 1e6
            ),
            "kept_versions": sorted(self.snapshots),
            "plan_version": newest,
            "chains": [[names.get(w, w) for w in chain] for chain in plan.chains] if plan else [],
            **self.installs.status(),
            "parent_failures": dict(self.failures),
            "transfer_accounts": dict(self.ledger.outcomes),
            "learner_bytes_sent": self.bytes_served,
            "peer_mbps": None if (peer := self.peer_bps()) is None else peer * 8 / 1e6,
            "scores": {
                names.get(w, w): round(s.score(now, self.reference_bps()), 1) for w, s in self.stats.items()
            },
            "demoted": sorted(names.get(w, w) for w, s in self.stats.items() if s.demoted),
        }
