"""Which workers' records keep failing verification: strikes, quarantine, and who made each group.

Pure bookkeeping, no lock (the intake, intake.py, holds the state's), no I/O. A refusal an honest
worker never earns (a forged reward, a fabricated log-prob, a prompt that is not the leased one:
`INTEGRITY`) is a strike against the worker that sent it; after `quarantine_after` strikes the
worker is quarantined: it gets no more leases and its pushes are refused, and /status shows it.
Stale records and expired leases are the network's doing and never strike; a lease given back
with nothing pushed on it strikes past an allowance (`returned`). The learner's own
refusals after training (log-probs that disagree with its recomputation) strike too, through the
group -> worker map kept here. Quarantine is bound to the worker's credential, not only its id:
the digest of a quarantined worker's credential is banned for the coordinator's lifetime, so the
credential is refused even after its registration is forgotten, and presenting it to register again
is refused. An install report the publisher refuses (bytes that are not the version the learner
published) is a strike, and the worker's records of that version are refused. Does not know leases
or the registry: the intake puts a quarantined worker's leases back.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from echo2.wire.errors import Reason

INTEGRITY = frozenset(
    {
        Reason.NON_FINITE_REWARD,
        Reason.REWARD_OUT_OF_RANGE,
        Reason.BAD_LOGPROB,
        Reason.BAD_MASK,
        Reason.WRONG_VERSION,
        Reason.DUPLICATE_ID,
        Reason.WRONG_PROMPT,
        Reason.REWARD_MISMATCH,
        Reason.LOGPROB_MISMATCH,
        Reason.NOT_SAMPLED,
        Reason.WRONG_GROUP,
        Reason.PARTIAL_GROUP,
        Reason.WRONG_SNAPSHOT,
        Reason.FUTURE_VERSION,
        Reason.OUT_OF_VOCAB,
        Reason.TOO_LONG,
        Reason.MALFORMED,
    }
)
"""Refusals an honest worker never earns: each is a strike."""
RETURNED_UNPUSHED = "returned_unpushed"
"""A lease given back with nothing pushed on it, past the allowance (`returned`): a strike, so a
worker cannot re-lease prompts in a loop to hold them (or re-draw their sampling noise) for free."""
BAD_INSTALLS = 64
"""Versions with a refused install report remembered per worker (the newest)."""
ORIGINS = 65536
"""Groups whose generating worker is remembered (for the learner's flags after training)."""


class Integrity:
    def __init__(self, *, quarantine_after: int) -> None:
        assert quarantine_after >= 1
        self.quarantine_after = quarantine_after
        self.strikes: Counter[str] = Counter()
        self.quarantined: set[str] = set()
        self.banned: set[bytes] = set()
        """Credential digests (wire/identity.py) of the workers ever quarantined: kept when the
        worker's registration is forgotten, so its credential stays refused (`quarantined`)."""
        self.bad_installs: dict[str, set[int]] = {}
        """Versions whose install report each worker made was refused (a snapshot the learner did
        not publish): its records of those versions are refused too."""
        self.unpushed: Counter[str] = Counter()
        """Leases each worker gave back with nothing pushed, since its last stored push."""
        self.flagged: Counter[str] = Counter()
        """Records the learner refused after taking them, by reason."""
        self.origin: OrderedDict[str, str] = OrderedDict()
        """Group id -> the worker whose push stored it (the newest `ORIGINS` groups)."""

    def strike(self, worker_id: str, reason: str, *, credential: bytes = b"") -> bool:
        """Count `reason` against `worker_id`; True when this strike quarantines it (and bans its
        `credential` digest, if given)."""
        if (reason not in INTEGRITY and reason != RETURNED_UNPUSHED) or worker_id in self.quarantined:
            return False
        self.strikes[worker_id] += 1
        if self.strikes[worker_id] < self.quarantine_after:
            return False
        self.quarantined.add(worker_id)
        if credential:
            self.banned.add(credential)
        return True

    def install_refused(self, worker_id: str, version: int) -> None:
        """`worker_id` reported installing bytes that are not the learner's `version`."""
        versions = self.bad_installs.setdefault(worker_id, set())
        versions.add(version)
        while len(versions) > BAD_INSTALLS:
            versions.remove(min(versions))

    def returned(self, worker_id: str, *, allowance: int) -> bool:
        """`worker_id` gave a lease back with nothing pushed on it: True (a strike is due) once it
        has done so more than `allowance` times since its last stored push. An honest worker gives
        back what it holds when it stops or is told it holds too many (at most `allowance` at once)."""
        self.unpushed[worker_id] += 1
        return self.unpushed[worker_id] > allowance

    def stored(self, worker_id: str, group_ids: set[str]) -> None:
        """`worker_id`'s push stored records of these groups."""
        self.unpushed.pop(worker_id, None)
        for gid in group_ids:
            self.origin[gid] = worker_id
            self.origin.move_to_end(gid)
        while len(self.origin) > ORIGINS:
            self.origin.popitem(last=False)

    def makers(self, group_ids: list[str]) -> list[str]:
        """The workers that made these groups (those still remembered)."""
        return sorted({self.origin[g] for g in group_ids if g in self.origin})

    def forget(self, worker_id: str) -> None:
        """A purged worker: nothing is kept about it."""
        self.strikes.pop(worker_id, None)
        self.unpushed.pop(worker_id, None)
        self.bad_installs.pop(worker_id, None)
        self.quarantined.discard(worker_id)  # its credential stays banned

    def status(self) -> dict:
        return {
            "quarantined": sorted(self.quarantined),
            "strikes": dict(self.strikes),
            "flagged": dict(self.flagged),
        }
