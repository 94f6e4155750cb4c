"""Benchmark: what two of issue 12's defences cost in the coordinator's own code, in process.

- ingestion (`Intake.ingest`, the state's intake) per record, without and with the accepted-records
  journal (coordinator/journal.py): batches of 8 records of 31 prompt and 16 response tokens, one lease each;
- one credential check (`CoordinatorState.authenticate`).

Median of R repeats; prints one line per figure (and `--json PATH` writes them).

    python bench/identity_cost.py --batches 2000 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import write_json

from echo2.config import CoordinatorConfig
from echo2.coordinator import journal
from echo2.coordinator.leases import Limits, Work
from echo2.coordinator.state import CoordinatorState
from echo2.data.buffer import ReplayBuffer
from echo2.records import Trajectory

GROUP = 8


def state() -> CoordinatorState:
    return CoordinatorState(
        CoordinatorConfig(lease_timeout=1e9, heartbeat_timeout=1e9, max_leases_per_worker=10**6),
        work=Work(
            buffer=ReplayBuffer(staleness=1, group_size=GROUP),
            limits=Limits(vocab_size=100, max_prompt_tokens=64, max_new_tokens=64, group_size=GROUP),
            group_id_of=lambda i: f"g{i}",
        ),
    )


def record(gid: str, k: int) -> Trajectory:
    return Trajectory(
        group_id=gid,
        prompt_ids=tuple(range(31)),
        response_ids=tuple(range(16)),
        behaviour_logprobs=tuple(-0.5 - 0.01 * i for i in range(16)),
        loss_mask=(1,) * 16,
        reward=1.0,
        version=0,
        record_id=f"{gid}-{k}",
    )


def ingest_seconds_per_record(batches: int, *, with_journal: bool) -> float:
    st = state()
    wid = st.register(name="w", hardware="x", price_per_hour=0.0, inbound=False).worker_id
    st.publisher.publish(0, b"v", keep=2)
    with tempfile.TemporaryDirectory() as tmp:
        log = journal.Journal(Path(tmp) / journal.NAME, epoch=st.epoch) if with_journal else None
        st.intake.journal = log.accepted if log is not None else None
        leases = [st.intake.lease(wid, version=0, max_groups=1) for _ in range(batches)]
        work = [(le.lease_id, [record(f"g{le.indices[0]}", k) for k in range(GROUP)]) for le in leases]
        start = time.perf_counter()
        for lease_id, records in work:
            st.intake.ingest(wid, lease_id, records)
        took = time.perf_counter() - start
        if log is not None:
            log.close()
    return took / (batches * GROUP)


def authenticate_seconds(calls: int) -> float:
    st = state()
    wid = st.register(name="w", hardware="x", price_per_hour=0.0, inbound=False).worker_id
    credential = st.issue_credential(wid)
    start = time.perf_counter()
    for _ in range(calls):
        st.authenticate(credential)
    return (time.perf_counter() - start) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out = {}
    for name, flag in (("ingest_us_per_record", False), ("ingest_journal_us_per_record", True)):
        runs = [ingest_seconds_per_record(args.batches, with_journal=flag) for _ in range(args.repeats)]
        out[name] = statistics.median(runs) * 1e6
    out["authenticate_us"] = statistics.median(authenticate_seconds(20000) for _ in range(args.repeats)) * 1e6
    for k, v in out.items():
        print(f"{k}: {v:.1f}")
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
