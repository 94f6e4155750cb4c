"""`python bench/broadcast.py`: the model's times and the report (pure), a small run with real worker
processes on loopback with token buckets (runs anywhere, bounded), the same in shaped network
namespaces where they are available, the flags refused with exit 2, and the learner's BenchPublisher
recording what the bench reports while the coordinator state decides. All `slow`: they exercise
the benchmark harness, not echo2."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re

import pytest
from broadcast import main
from broadcast_learner import bench_state
from broadcast_report import BenchSpec, broadcast_timeout, check, expected, render, summarize
from netcheck import leftovers
from netns import PREFIX
from shaping import htb_uplink_commands

pytestmark = pytest.mark.slow

KEYS = {
    "t_bcast_q90_s",
    "t_bcast_q100_s",
    "lower_bound_s",
    "star_fluid_s",
    "chain_formula_s",
    "star_formula_s",
    "ratio_q90",
    "ratio_q100",
    "n_chains",
    "installed",
    "backend",
}


# ---------------------------------------------------------------------------- pure parts
def test_expected_times():
    """M = 32 MB, Bw = 50 Mbit/s, B0 = 400: M/Bw = 5.12 s; 32 workers in 8 chains of 4 hops; star
    sends 32 copies through B0."""
    spec = BenchSpec(workers=32, snapshot_mb=32, uplink_mbps=400, worker_mbps=50, mode="chain", chunk_mb=0.5)
    e = expected(spec)
    assert e["lower_bound_s"] == pytest.approx(5.12)
    assert e["star_fluid_s"] == pytest.approx(32 * 5.12 / 8)
    assert e["star_formula_s"] == pytest.approx(e["star_fluid_s"])
    assert (e["n_chains"], e["hops"], e["chunks"]) == (8, 4, math.ceil(32e6 / 2**19))
    c_time = 2**19 * 8 / 50e6
    assert e["chain_formula_s"] == pytest.approx((e["chunks"] + 3) * c_time)
    small = BenchSpec(workers=4, snapshot_mb=32, uplink_mbps=400, worker_mbps=50, mode="star")
    assert expected(small)["star_formula_s"] == pytest.approx(5.12), "B0/N > Bw: each link is the bound"
    assert small.n_chains == 4


def test_summary_and_render():
    spec = BenchSpec(workers=4, snapshot_mb=8, uplink_mbps=100, worker_mbps=50, mode="chain")
    s = summarize(spec, {"t_bcast_q90_s": 1.5, "t_bcast_q100_s": 1.6, "installed": 4}, backend="netns")
    assert KEYS <= s.keys() and s["ok"]
    assert s["ratio_q90"] == pytest.approx(1.5 / 1.28) and s["goodput_factor"] == 0.96
    text = render(s)
    assert "q = 0.9: 1.50 s" in text and "M/Bw: 1.28 s" in text and "0.96" in text
    missing = summarize(spec, {"installed": 3}, backend="token-bucket", reason="no root")
    assert not missing["ok"] and missing["ratio_q90"] is None and missing["fallback_reason"] == "no root"
    assert "n/a" in render(missing)


def test_throttle_needs_chains_allows_for_the_slow_relay_and_is_reported():
    kw = dict(workers=6, snapshot_mb=16, uplink_mbps=10, worker_mbps=5, chunk_mb=0.0625)
    with pytest.raises(ValueError, match="--throttle"):
        check(BenchSpec(**kw, mode="star", throttle=0.1))
    spec = BenchSpec(**kw, throttle=0.1, throttle_after_s=5.0)
    check(spec)
    assert broadcast_timeout(spec) == pytest.approx(60 + 4 * 25.6 / 0.1), "an undemoted relay at 0.1 Bw"
    measured = {
        "t_bcast_q90_s": 39.6,
        "t_bcast_q100_s": 39.6,
        "installed": 6,
        "throttled": {"worker": "w04", "chain": ["w04", "w02", "w01"], "up_mbps": 0.5, "at_s": 5.03},
        "parent_failures": {"slow": 1},
        "demoted": ["w04"],
        "chains_after": [["w05", "w03", "w00", "w02", "w01"]],
        "next": {"t_bcast_q90_s": 27.8, "t_bcast_q100_s": 27.8, "chains": [["w00", "w03", "w01"]]},
    }
    text = render(summarize(spec, measured, backend="netns"))
    assert "throttled: w04" in text and "slow reports: 1" in text and "demoted: ['w04']" in text
    assert "next version: T_bcast q = 0.9: 27.80 s" in text


def test_htb_uplink_has_a_class_and_filter_per_worker():
    cmds = htb_uplink_commands("ns", "eth0", 40, ["10.77.1.1", "10.77.1.2"])
    flat = [" ".join(c) for c in cmds]
    assert flat[0].startswith("tc -n ns qdisc replace dev eth0 root handle 1: htb")
    assert any("classid 1:1 htb rate 40000000bit ceil 40000000bit" in c for c in flat)
    assert sum("u32 match ip dst" in c for c in flat) == 2
    assert any("rate 20000000bit ceil 40000000bit" in c for c in flat), "fair share, may borrow all"


@pytest.mark.parametrize(
    "field, value, flag",
    [
        ("workers", 0, "--workers"),
        ("snapshot_mb", 0.0, "--snapshot-mb"),
        ("uplink_mbps", -1.0, "--uplink-mbps"),
        ("worker_mbps", float("nan"), "--worker-mbps"),
        ("chunk_mb", 0.0, "--chunk-mb"),
        ("mode", "tree", "--mode"),
        ("pace", -0.1, "--pace"),
        ("throttle", 0.0, "--throttle"),
        ("throttle", 1.5, "--throttle"),
        ("throttle_after_s", -1.0, "--throttle-after"),
        ("slow_relay_fraction", 1.0, "--slow-relay-fraction"),
    ],
)
def test_check_names_the_flag(field, value, flag):
    kw = dict(workers=2, snapshot_mb=1, uplink_mbps=10, worker_mbps=5, mode="chain", chunk_mb=1)
    kw[field] = value
    with pytest.raises(ValueError, match=flag):
        check(BenchSpec(**kw))


# ---------------------------------------------------------------------------- the learner's state
def test_bench_state_records_route_and_install_and_keeps_the_decisions():
    """BenchPublisher's overrides record when a worker asked for its parent, reported one and how
    long it streamed, and return (and refuse) exactly what Publisher does."""
    state = bench_state(mode="chain", chunk_bytes=1024, uplink_budget_bps=1e6, worker_bps=1e6, timeout=10)
    try:
        w = state.register(name="w0", hardware="cpu", price_per_hour=0.0, inbound=False)
        data = os.urandom(4096)
        state.publisher.publish(0, data, keep=2)
        assert state.publisher.route(w.worker_id, 0) == (None, None, "full"), "the only worker: the learner"
        assert set(state.publisher.routed) == {(w.worker_id, 0)}
        assert state.publisher.report_failure(w.worker_id, 0, None, "stalled", "x") == (None, None, "full")
        assert state.publisher.reported[-1][:5] == (w.worker_id, 0, None, "stalled", "x")
        sha = hashlib.sha256(data).hexdigest()
        state.publisher.report_installed(w.worker_id, 0, sha, [(None, 4096, 0.25), (None, 0, 0.5)])
        assert state.publisher.streamed == {(w.worker_id, 0): 0.75}
        assert w.worker_id in state.publisher.bcast.installs.installed_at[0]
        with pytest.raises(Exception, match="future_version"):
            state.publisher.report_installed(w.worker_id, 5, sha, [])
    finally:
        state.close()


# ---------------------------------------------------------------------------- the CLI
BASE = ["--workers", "3", "--snapshot-mb", "1", "--uplink-mbps", "16"]


GOOD = {"--workers": "2", "--snapshot-mb": "1", "--uplink-mbps": "8", "--worker-mbps": "4"}


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--workers", "0"),
        ("--snapshot-mb", "-1"),
        ("--uplink-mbps", "0"),
        ("--worker-mbps", "0"),
        ("--mode", "ring"),
        ("--chunk-mb", "0"),
        ("--timeout", "0"),
        ("--pace", "1.5"),
        ("--throttle", "2"),
        ("--slow-relay-fraction", "-0.5"),
    ],
)
def test_bad_flags_exit_2(flag, value, capsys):
    args = [x for k, v in (GOOD | {flag: value}).items() for x in (k, v)]
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err and "error: " + flag in err


def test_missing_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--workers", "2"])
    assert e.value.code == 2 and "--snapshot-mb" in capsys.readouterr().err


# ---------------------------------------------------------------------------- real runs
def _run(extra: list[str], capsys) -> tuple[dict, str]:
    code = main([*BASE, "--worker-mbps", "8", "--chunk-mb", "0.0625", "--timeout", "20", "--json", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out), err


def test_small_run_on_loopback_token_buckets(capsys):
    """Three worker processes on 127.0.0.1, 1 MB at 8 Mbit/s each (M/Bw = 1 s), B0 = 16 Mbit/s:
    two chains. Every worker installs; the report has every key; T_bcast is not below what the
    token buckets allow (their bursts let at most a few percent through early)."""
    s, err = _run(["--loopback"], capsys)
    assert "network namespaces unavailable (--loopback): using in-process token buckets" in err
    assert KEYS <= s.keys()
    assert s["backend"] == "token-bucket" and s["ok"]
    assert s["installed"] == 3 and s["n_chains"] == 2
    assert sorted(len(c) for c in s["chains"]) == [1, 2]
    assert s["lower_bound_s"] == pytest.approx(1.0)
    assert 0.85 <= s["ratio_q90"] <= s["ratio_q100"] < 10
    assert s["t_bcast_q90_s"] <= s["t_bcast_q100_s"]


def test_small_run_in_shaped_namespaces(shaped_network, capsys):
    """The same in network namespaces: TBF on every worker link, HTB on the learner's uplink; no
    namespace or link is left behind."""
    s, err = _run([], capsys)
    assert "unavailable" not in err
    assert s["backend"] == "netns" and s["ok"] and s["installed"] == 3
    assert 0.85 <= s["ratio_q90"] < 10
    mine = re.compile(rf"{PREFIX}{os.getpid()}[a-z]*-")
    assert [name for name in leftovers() if mine.match(name)] == []
