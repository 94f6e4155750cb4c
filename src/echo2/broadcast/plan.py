"""Forwarding chains for snapshot broadcast (paper 4.2 and Appendix C.3): pure, no I/O, no clock.

Workers are scored from their transfer history (`PeerStats`, the Appendix C.3 formula with the
constants of `ScoreParams`; Speed relative to the peers' rate), ranked, and laid out as
N_ch = floor(B0 / Bw) chains of fan-out 1 (`build_chains`). A failed relay is excised and its tail
reattaches to its parent (`ChainPlan.excise`). A relay measured below `relay_floor` (slow) is
removed too, its tail moving behind another chain's tail (`ChainPlan.demote`), and it sits out the
next plan as a tail (`PeerStats.may_relay`). The broadcast-time formulas let the planner, the simulator and the benchmarks
compare chains with a star against the fluid lower bound M / Bw.

Units: sizes in bytes, bandwidths in bytes per second, times in seconds (callers convert Mbps).
The caller passes `now` (any monotonic clock in seconds) wherever time matters.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

NEUTRAL_SCORE = 55.0
"""Score of a worker with no history: below a relay with a clean record at its peers' rate (100; 61
even after 10 idle minutes with a single success), above one at a tenth of it (50). The coordinator
ranks established relays above every newcomer whatever the scores (`PeerInfo.established`), so
re-registering cannot buy a rank; among peers that are all new the score alone decides."""
PEER_RATE_SAMPLES = 3
"""Relay transfers measured before the peers' rate counts (for Speed and the relay floor)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ScoreParams:
    """The operational defaults of Appendix C.3 ("Coefficient choices")."""

    failure_threshold: int = 3
    """Stability drops to 0 after more than this many consecutive failures."""
    success_saturation: int = 10
    """Consecutive successes at which Stability reaches 1."""
    decay_window_s: float = 600.0
    """Idle seconds over which Decay falls; it never falls below 1 - max_decay."""
    max_decay: float = 0.3
    history: int = 10
    """Speed is the mean rate of this many most recent transfers."""
    median: bool = False
    """Speed from the median of those rates instead of their mean (the coordinator's, whose rates
    are reports of workers: one outlier moves a median by one order statistic); the mean is Appendix
    C.3's and the simulator's."""
    speed_decades: float = 1.0
    """Speed falls from 100 at the peers' rate to 0 over this many decades below it."""


@dataclass(slots=True, kw_only=True)
class PeerStats:
    """Transfer history of one worker and its score (Appendix C.3, Lattica's peer selection).

    Score = Decay * (0.5 Speed + 0.35 Success*100 + 0.15 Stability*100), on a 0-100 scale, with
    Speed measured against the peers' rate (`reference_bps`, the caller's: the coordinator passes
    the lower quartile of recent relay transfers, the simulator their median), so that ranking is dominated by Speed as the paper reports: a perfect
    record at the peers' rate (or faster: a chain runs at the rate it was planned at, so a faster
    relay gains it nothing) scores 100, at half of it 84.9, at a tenth 50 (below a newcomer's 55).
    """

    params: ScoreParams = field(default_factory=ScoreParams)
    successes: int = 0
    failures: int = 0
    consecutive_successes: int = 0
    consecutive_failures: int = 0
    last_update: float | None = None
    demoted: bool = False
    """Reported slow as a parent since the last plan was made: only a tail in the next one."""
    rates: deque[float] = field(init=False)
    """Bytes/s of the most recent transfers (at most `params.history`)."""

    def __post_init__(self) -> None:
        self.rates = deque(maxlen=self.params.history)

    def record_transfer(self, nbytes: int, seconds: float, now: float) -> None:
        """A successful transfer of `nbytes` in `seconds`; a zero duration counts but has no rate."""
        self.successes += 1
        self.consecutive_successes += 1
        self.consecutive_failures = 0
        self.last_update = now
        if seconds > 0:
            self.rates.append(nbytes / seconds)

    def record_failure(self, now: float) -> None:
        self.failures += 1
        self.consecutive_failures += 1
        self.consecutive_successes = 0
        self.last_update = now

    def record_slow(self, now: float) -> None:
        """Its child left it for delivering below the relay floor: a failed transfer, and it sits
        out the next plan as a tail (Appendix C.3: degraded relays are "moved toward chain tails")."""
        self.record_failure(now)
        self.demoted = True

    def may_relay(self) -> bool:
        """May it serve a child in a new plan: not demoted since the last plan, and not failed as a
        parent more than `failure_threshold` times in a row (then it is only ever a tail)."""
        return not self.demoted and self.consecutive_failures <= self.params.failure_threshold

    def speed(self, reference_bps: float) -> float:
        """clamp(100 * (1 + log10(mean rate / reference_bps) / speed_decades), 0, 100): 100 at the
        peers' rate or faster, 69.9 at half of it, 0 at a tenth (one decade by default). The
        median rate instead of the mean with `params.median`."""
        if reference_bps <= 0:
            raise ValueError("reference_bps must be positive")
        if not self.rates:
            return 0.0
        if self.params.median:
            rate = statistics.median(self.rates)
        else:
            rate = sum(self.rates) / len(self.rates)
        if rate <= 0:
            return 0.0
        ratio = math.log10(rate / reference_bps) / self.params.speed_decades
        return min(100.0, max(0.0, 100 * (1 + ratio)))

    def success(self) -> float:
        total = self.successes + self.failures
        return self.successes / total if total else 0.5

    def stability(self) -> float:
        if self.consecutive_failures > self.params.failure_threshold:
            return 0.0
        sat = self.params.success_saturation
        return min(self.consecutive_successes, sat) / sat

    def decay(self, now: float) -> float:
        if self.last_update is None:
            return 1.0
        idle = max(0.0, now - self.last_update)
        return 1 - min(idle / self.params.decay_window_s, self.params.max_decay)

    def score(self, now: float, reference_bps: float) -> float:
        """The score at `now`, Speed against the peers' rate `reference_bps` (bytes/s)."""
        if self.successes == 0 and self.failures == 0:
            return NEUTRAL_SCORE
        speed = self.speed(reference_bps)
        raw = 0.5 * speed + 0.35 * self.success() * 100 + 0.15 * self.stability() * 100
        return min(100.0, max(0.0, self.decay(now) * raw))


def relay_floor(peer_bps: float | None, fraction: float) -> float | None:
    """The rate (bytes/s) below which a relay's chunks reach its child too slowly: `fraction` of
    the peers' measured rate (the rate its chain was planned at). None when there is nothing to
    measure against yet or demotion is off (`fraction` 0): a configured Bw is no evidence. `fraction`
    is `broadcast.slow_relay_fraction` (default `config.schema.SLOW_RELAY_FRACTION`)."""
    if peer_bps is None or peer_bps <= 0 or fraction <= 0:
        return None
    return fraction * peer_bps


def n_chains(uplink_bps: float, worker_bps: float, n_workers: int) -> int:
    """N_ch = floor(B0 / Bw_hat), at least 1 and at most n_workers (still 1 when there are none)."""
    if worker_bps <= 0 or uplink_bps <= 0:
        raise ValueError("uplink_bps and worker_bps must be positive")
    if math.isinf(uplink_bps):
        k = n_workers
    elif math.isinf(worker_bps):  # a worker as fast as the learner's whole uplink: one chain
        k = 1
    else:
        ratio = uplink_bps / worker_bps
        k = n_workers if math.isinf(ratio) else math.floor(ratio * (1 + 1e-9))  # 0.3/0.1 is 2.999...
    return max(1, min(k, n_workers))


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerInfo:
    worker_id: str
    score: float
    inbound: bool
    """Accepts inbound connections, so it can serve a child; without it a worker is only a tail."""
    established: bool = False
    """Has relayed a transfer the coordinator credited: ranked above every peer that has not, so a
    newcomer (or a worker that re-registered to shed its record) never outranks a proven relay."""


def tie_order(seed: int | None, worker_id: str) -> str:
    """The tie-break between equal ranks: a random order drawn from `seed` (the coordinator's
    secret, mixed with the version), so no worker can buy a rank by its id (re-registering until
    it gets a low one); the worker id itself when `seed` is None (the simulator, tests)."""
    if seed is None:
        return worker_id
    return hashlib.blake2b(f"{seed}:{worker_id}".encode(), digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class ChainPlan:
    """Chains of worker ids, each listed from its seed (fed by the learner) downwards."""

    chains: tuple[tuple[str, ...], ...]
    mode: str = "chain"
    """"chain" (peer forwarding) or "star" (the learner feeds everyone)."""

    def __post_init__(self) -> None:
        if self.mode not in ("chain", "star"):
            raise ValueError(f"mode must be 'chain' or 'star', not {self.mode!r}")
        ids = [w for chain in self.chains for w in chain]
        if len(set(ids)) != len(ids):
            raise ValueError("a worker appears more than once in the plan")
        if any(not chain for chain in self.chains):
            raise ValueError("a chain is empty")

    def _locate(self, worker_id: str) -> tuple[int, int]:
        for ci, chain in enumerate(self.chains):
            if worker_id in chain:
                return ci, chain.index(worker_id)
        raise KeyError(worker_id)

    def parent_of(self, worker_id: str) -> str | None:
        """The peer this worker receives from; None means the learner. KeyError if not planned."""
        ci, pos = self._locate(worker_id)
        return self.chains[ci][pos - 1] if pos > 0 else None

    def child_of(self, worker_id: str) -> str | None:
        """The peer this worker forwards to; None at a tail. KeyError if not planned."""
        ci, pos = self._locate(worker_id)
        chain = self.chains[ci]
        return chain[pos + 1] if pos + 1 < len(chain) else None

    def workers(self) -> tuple[str, ...]:
        return tuple(w for chain in self.chains for w in chain)

    def excise(self, worker_id: str) -> ChainPlan:
        """Remove a failed worker (Appendix C.3, "Recovery mechanism"): its child and the rest of
        its chain reattach to its parent, the nearest healthy upstream peer or the learner. A
        worker not in the plan leaves it unchanged (failure reports may arrive twice)."""
        try:
            ci, pos = self._locate(worker_id)
        except KeyError:
            return self
        rest = self.chains[ci][:pos] + self.chains[ci][pos + 1 :]
        chains = self.chains[:ci] + ((rest,) if rest else ()) + self.chains[ci + 1 :]
        return ChainPlan(chains=chains, mode=self.mode)

    def demote(self, worker_id: str, open_tails: set[str] | frozenset[str] = frozenset()) -> ChainPlan:
        """Remove a slow relay that is still receiving (so its parent's upload, or the learner's
        stream to it, is still busy): its child and the rest of its chain move behind the tail of
        the shortest other chain whose tail is in `open_tails` (ties: the first), a peer whose
        upload is free, so no parent feeds two children and no new learner stream takes its share
        of B0 from every seed. Without such a tail they reattach to its parent, as `excise` does.
        A worker not in the plan leaves it unchanged."""
        try:
            ci, pos = self._locate(worker_id)
        except KeyError:
            return self
        rest = self.chains[ci][pos + 1 :]
        hosts = [i for i, c in enumerate(self.chains) if i != ci and c[-1] in open_tails]
        if not rest or not hosts:
            return self.excise(worker_id)
        host = min(hosts, key=lambda i: len(self.chains[i]))
        chains = list(self.chains)
        chains[host] = chains[host] + rest
        chains[ci] = chains[ci][:pos]
        return ChainPlan(chains=tuple(c for c in chains if c), mode=self.mode)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "chains": [list(chain) for chain in self.chains]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChainPlan:
        return cls(chains=tuple(tuple(str(w) for w in chain) for chain in d["chains"]), mode=d["mode"])


def build_chains(peers: list[PeerInfo], n_ch: int, *, seed: int | None = None) -> ChainPlan:
    """Chain assembly of Appendix C.3, fan-out 1.

    Peers are ranked established first, then by score, descending (ties in the seeded random order
    of `tie_order`). The top n_ch inbound-capable peers
    are seeds; the other inbound-capable peers are appended to the chain tails round-robin in rank
    order. A peer without inbound connections cannot serve a child, so it only ever sits at a
    tail: such peers are appended last, in rank order, continuing the round robin (shortest chains
    first), at most one per chain. When there are fewer inbound-capable peers than n_ch, or more
    inbound-less peers than chains, each remaining inbound-less peer gets a chain of its own, fed
    directly by the learner (so the learner may then serve more than n_ch flows).
    """
    if n_ch < 1:
        raise ValueError("n_ch must be at least 1")
    ranked = sorted(peers, key=lambda p: (not p.established, -p.score, tie_order(seed, p.worker_id)))
    relays = [p.worker_id for p in ranked if p.inbound]
    tails = [p.worker_id for p in ranked if not p.inbound]
    chains: list[list[str]] = [[w] for w in relays[:n_ch]]
    cursor = 0
    for w in relays[n_ch:]:
        chains[cursor].append(w)
        cursor = (cursor + 1) % len(chains)
    n_relay_chains = len(chains)
    for i, w in enumerate(tails):
        if i < n_relay_chains:
            chains[(cursor + i) % n_relay_chains].append(w)
        else:
            chains.append([w])
    return ChainPlan(chains=tuple(tuple(c) for c in chains), mode="chain")


def build_star(worker_ids: list[str]) -> ChainPlan:
    """Push-to-all: every worker is its own length-1 chain, fed by the learner."""
    return ChainPlan(chains=tuple((w,) for w in worker_ids), mode="star")


def plan_broadcast(
    peers: list[PeerInfo],
    *,
    mode: str,
    uplink_bps: float,
    worker_bps: float,
    n_ch: int | None = None,
    seed: int | None = None,
) -> ChainPlan:
    """The plan of one publication: mode "star" feeds every peer from the learner, in the order
    given; mode "chain" lays them out by `build_chains` in N_ch = floor(B0 / Bw) chains, or `n_ch`
    when the caller fixes it (never more than there are peers), ties broken by `seed`
    (`tie_order`). The coordinator and the simulator both plan through this."""
    if mode not in ("chain", "star"):
        raise ValueError(f"mode must be 'chain' or 'star', not {mode!r}")
    if mode == "star" or not peers:
        return build_star([p.worker_id for p in peers])
    k = n_ch if n_ch is not None else n_chains(uplink_bps, worker_bps, len(peers))
    return build_chains(peers, min(k, len(peers)), seed=seed)


def broadcast_time(
    n: int,
    *,
    mode: str,
    size_bytes: float,
    chunk_bytes: float,
    uplink_bps: float,
    worker_bps: float,
    hop_delay_s: float,
    n_ch: int | None = None,
) -> float:
    """T_bcast the formulas predict for n receivers laid out as `plan_broadcast` lays them out
    (equal links of Bw; `n_ch` as there)."""
    if n <= 0:
        return 0.0
    if mode == "star":
        return star_broadcast_time(n, size_bytes, uplink_bps, worker_bps)
    k = n_ch if n_ch is not None else n_chains(uplink_bps, worker_bps, n)
    return chain_broadcast_time(n, min(k, n), size_bytes, chunk_bytes, worker_bps, hop_delay_s)


def chain_broadcast_time(
    n: int, n_ch: int, size_bytes: float, chunk_bytes: float, worker_bps: float, hop_delay_s: float
) -> float:
    """L*d + (K + L - 1) * c / Bw with L = ceil(n / n_ch) hops and K = ceil(M / c) chunks
    (store-and-forward pipeline; sim/broadcast.py derives it)."""
    if n <= 0:
        return 0.0
    hops = math.ceil(n / n_ch)
    k = math.ceil(size_bytes / chunk_bytes)
    return hops * hop_delay_s + (k + hops - 1) * chunk_bytes / worker_bps


def star_broadcast_time(n: int, size_bytes: float, uplink_bps: float, worker_bps: float) -> float:
    """M / min(B0 / n, Bw): the learner uplink is shared by all n receivers."""
    if n <= 0:
        return 0.0
    return size_bytes / min(uplink_bps / n, worker_bps)


def lower_bound(size_bytes: float, worker_bps: float) -> float:
    """M / Bw: no receiver can download faster than its own link (fluid model, B0 >= Bw)."""
    return size_bytes / worker_bps
