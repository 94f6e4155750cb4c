"""What the journal's MAC costs (coordinator/journal.py): HMAC-SHA256 of one accepted-batch line of 8
records of 31 prompt and 16 response tokens (the identity_cost.py shape), per record, and the resume
check of the same lines (`accepted_since` over a journal of them).

    cd bench && python journal_mac.py --lines 2000 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from echo2.coordinator import journal
from echo2.records import Trajectory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    records = [
        Trajectory(
            group_id="g",
            prompt_ids=tuple(range(31)),
            response_ids=tuple(range(16)),
            behaviour_logprobs=(-0.5,) * 16,
            loss_mask=(1,) * 16,
            reward=1.0,
            version=0,
            record_id=f"r{i}",
        )
        for i in range(8)
    ]
    body = journal._encode({"accepted": records, "prompts": {"g": 0}, "seq": 1})
    key = bytes(32)
    sign, check = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        for _ in range(args.lines):
            journal._sign(key, body)
        sign.append((time.perf_counter() - t) / args.lines / len(records) * 1e6)
        with tempfile.TemporaryDirectory() as d:
            log = journal.Journal(Path(d) / journal.NAME, epoch="e")
            for _ in range(args.lines):
                log.accepted(records, {"g": 0})
            log.close()
            t = time.perf_counter()
            n = sum(len(batch) for batch, _ in journal.accepted_since(log.path, 0))
            check.append((time.perf_counter() - t) / n * 1e6)
    print(f"line: {len(body)} bytes of {len(records)} records")
    print(f"sign: {', '.join(f'{x:.2f}' for x in sign)} us/record, median {statistics.median(sign):.2f}")
    print(
        f"resume read + check: {', '.join(f'{x:.2f}' for x in check)} us/record, median {statistics.median(check):.2f}"
    )


if __name__ == "__main__":
    main()
