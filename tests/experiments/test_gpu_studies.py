"""experiments/gpu_studies.sh on a CPU with a fake interpreter: every study process starts, what finished is
packed into PACK while the others run, and at the time limit the rest are stopped (process groups)
and the pack is written once more. The lesson of 2026-12-04: a driver that packs only at its end
loses everything when its caller's limit comes first."""

from __future__ import annotations

import os
import subprocess
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[2]

FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "$$ $*" >> "$FAKE_LOG"
case " $* " in
  *" experiments/staleness/staleness_study.py "*)
    json=$(echo " $* " | sed -n 's/.* --json \([^ ]*\) .*/\1/p')
    echo '{"rows": []}' > "$json"
    echo "12:00:00 done lag=0,correction=clip,seed=0"
    [[ " $* " == *"seed=1 "* ]] && exec sleep 300 ;;  # seed 1 never finishes: stopped at the limit
  *" -m echo2.cli run "*) dir=$(echo " $* " | sed -n 's/.* --run.dir=\([^ ]*\) .*/\1/p'); mkdir -p "$dir/checkpoint"
    echo w > "$dir/checkpoint/model.safetensors"; echo m > "$dir/metrics.jsonl" ;;
  *" experiments/poker/poker_eval.py play "*) out=$(echo " $* " | sed -n 's/.* --out \([^ ]*\) .*/\1/p')
    mkdir -p "$out/hands"; echo x | gzip > "$out/hands/m__call_station.jsonl.gz" ;;
esac
"""


def test_packs_while_running_and_stops_the_rest_at_the_limit(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log, pack, work = tmp_path / "calls.log", tmp_path / "out" / "results.tgz", tmp_path / "work"
    pack.parent.mkdir()
    env = {
        **os.environ,
        "ECHO2_PYTHON": str(fake),
        "FAKE_LOG": str(log),
        "PACK": str(pack),
        "POKER_STEPS": "12",
    }
    start = time.monotonic()
    done = subprocess.run(
        ["bash", str(ROOT / "experiments" / "gpu_studies.sh"), str(work), "4", "0 1"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    took = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    assert "stopping what still runs" in done.stdout and took < 30
    calls = log.read_text().splitlines()
    assert sum("experiments/staleness/staleness_study.py" in c for c in calls) == 2  # one instance per seed
    assert sum(" -m echo2.cli run " in c for c in calls) == 3  # 3 poker seeds at 12 steps
    assert sum("poker_eval.py play" in c for c in calls) == 4  # the untrained model and 3 checkpoints
    # the seed-1 instance was stopped: no process of it is left
    pid = next(c.split()[0] for c in calls if "seed=1" in c)
    assert subprocess.run(["kill", "-0", pid], capture_output=True).returncode != 0
    with tarfile.open(pack) as tar:
        names = tar.getnames()
    assert "staleness/seed0.json" in names and "logs/staleness_seed1.log" in names
    assert any(n.endswith("hands/m__call_station.jsonl.gz") for n in names)
    assert not any("checkpoint" in n or n.endswith(".safetensors") for n in names)  # weights stay behind
