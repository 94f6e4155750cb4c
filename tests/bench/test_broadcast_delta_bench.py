"""The broadcast benchmark's base/successor option (issue 24): the pair (bench/delta_pair.py), the
flags, the learner's state publishing a delta for it, and one small loopback run in each form."""

from __future__ import annotations

import json

import numpy as np
import pytest
from broadcast import main
from broadcast_delta import summarize as summarize_runs
from broadcast_delta import where_the_time_went
from broadcast_learner import bench_state
from broadcast_report import BenchSpec, check, warmup_bytes
from delta_pair import Pair, calibrate, delta_ratio, layout

from echo2.broadcast import delta as codec

pytestmark = pytest.mark.slow


def _elements(data: bytes) -> np.ndarray:
    (n,) = np.frombuffer(data[:8], "<u8")
    return np.frombuffer(data[8 + int(n) :], "<u2")


def test_pair_is_bf16_safetensors_of_the_size_asked_and_moves_one_ulp():
    p = Pair(400_000, seed=1)
    entries = codec._layout(p.base)  # the codec's own parser: contiguous bf16 tensors
    assert len(entries) == len(layout(400_000)) > 10 and {e[1] for e in entries} == {"BF16"}
    d = layout(400_000)[0][1][1]
    assert 400_000 - 2 * d - 4096 <= len(p.base) <= 400_000 + 4096
    assert p.successor(0.0) == p.base
    new = p.successor(0.01)
    assert len(new) == len(p.base) and codec._layout(new) == entries
    a, b = _elements(p.base).astype(np.int32), _elements(new).astype(np.int32)
    changed = np.flatnonzero(a != b)
    assert len(changed) == round(0.01 * a.size)
    assert set(np.unique(np.abs((b - a)[changed]))) == {1}, "one ulp (bit pattern +-1)"
    assert set(np.flatnonzero(a != _elements(p.successor(0.005)))) < set(changed), "a prefix"
    assert Pair(400_000, seed=1).successor(0.01) == new, "deterministic per seed"


def test_calibrate_hits_the_ratio_by_the_codecs_own_measurement():
    fraction, got = calibrate(1_000_000, 0.02)
    assert got["ratio"] == pytest.approx(0.02, rel=0.02)
    p = Pair(1_000_000)
    again = delta_ratio(p.base, p.successor(fraction))
    assert again["delta_bytes"] == got["delta_bytes"] and again["methods"].get("sparse", 0) > 0
    with pytest.raises(ValueError, match="delta ratio"):
        calibrate(1_000_000, 1.5)


def test_spec_checks_and_warmup_is_the_base():
    kw = dict(workers=2, snapshot_mb=1, uplink_mbps=10, worker_mbps=5, chunk_mb=0.0625)
    spec = BenchSpec(**kw, changed_fraction=0.01, delta=True)
    check(spec)
    assert warmup_bytes(spec) == spec.snapshot_bytes
    assert warmup_bytes(BenchSpec(**kw)) == spec.snapshot_bytes // 8, "unchanged without a successor"
    with pytest.raises(ValueError, match="delta: needs"):
        check(BenchSpec(**kw, delta=True))
    with pytest.raises(ValueError, match="--changed-fraction"):
        check(BenchSpec(**kw, changed_fraction=1.5))
    with pytest.raises(ValueError, match="--throttle"):
        check(BenchSpec(**kw, changed_fraction=0.01, throttle=0.1))


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--changed-fraction", "2"], "--changed-fraction"),
        (["--full"], "--full"),
        (["--delta-ratio", "0"], "--delta-ratio"),
        (["--changed-fraction", "0.01", "--delta-ratio", "0.01"], "--delta-ratio"),
    ],
)
def test_bad_successor_flags_exit_2(args, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--workers", "2", "--snapshot-mb", "1", "--uplink-mbps", "8", "--worker-mbps", "4", *args])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_bench_state_with_delta_publishes_the_successors_delta():
    base, new = Pair(300_000).base, Pair(300_000).successor(0.01)
    state = bench_state(
        mode="chain", chunk_bytes=4096, uplink_budget_bps=1e6, worker_bps=1e6, timeout=10, delta=True
    )
    try:
        state.publisher.publish(0, base, keep=2)
        state.publisher.publish(1, new, keep=2)
        assert len(state.publisher.deltas[1].data) == delta_ratio(base, new)["delta_bytes"]
        assert codec.apply(base, state.publisher.deltas[1].data) == new
    finally:
        state.close()
    off = bench_state(mode="chain", chunk_bytes=4096, uplink_budget_bps=1e6, worker_bps=1e6, timeout=10)
    try:
        off.publisher.publish(0, base, keep=2)
        off.publisher.publish(1, new, keep=2)
        assert off.publisher.deltas == {}, "broadcast.delta off by default, as before"
    finally:
        off.close()


def test_runs_summary_and_breakdown():
    run = {
        "routed_by_worker_s": {"w00": 0.1, "w01": 0.2},
        "streaming_by_worker_s": {"w00": 0.05, "w01": 0.05},
        "install_by_worker_s": {"w00": 0.2, "w01": 0.3},
    }
    b = where_the_time_went(run)
    assert b["routed_max_s"] == 0.2 and b["rest_median_s"] == pytest.approx(0.05)
    runs = [
        {"form": f, "ok": True, "t_bcast_q90_s": t, "t_bcast_q100_s": t, "learner_mb_sent": 1.0}
        | {"publish_s": 0.01, "breakdown": b}
        for f, t in (("full", 5.0), ("delta", 0.2), ("full", 6.0), ("delta", 0.3))
    ]
    s = summarize_runs(runs)
    assert s["full"]["t_bcast_q90_s"] == {"median": 5.5, "min": 5.0, "max": 6.0, "n": 2}
    assert s["delta_over_full"]["t_bcast_q100_s"] == pytest.approx(0.25 / 5.5)


@pytest.mark.parametrize("full", [False, True])
def test_small_successor_run_on_loopback(full, capsys):
    """Three workers on 127.0.0.1 install the base, then the successor: as its delta (the learner
    sends a few percent of M) or, with --full, as the full snapshot."""
    args = ["--workers", "3", "--snapshot-mb", "1", "--uplink-mbps", "16", "--worker-mbps", "8"]
    args += ["--chunk-mb", "0.0625", "--timeout", "20", "--loopback", "--json", "--changed-fraction", "0.01"]
    assert main(args + (["--full"] if full else [])) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["ok"] and s["installed"] == 3 and s["delta"] is (not full)
    assert s["delta_check"]["ratio"] < 0.05 and s["snapshot_bytes"] == s["delta_check"]["full_bytes"]
    if full:
        assert s["forms"] == {} and s["learner_mb_sent"] >= 2 * 0.99
    else:
        assert s["forms"] == {"delta": 3} and s["learner_mb_sent"] < 0.1
