"""What a new user meets on day one, on the tiny model: tracking (TensorBoard, W&B offline,
samples.jsonl), checkpoints that from_pretrained loads, fresh run directories, and runtime
mistakes as one line with exit 2 and no run directory left behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support import TINY

from echo2 import preflight
from echo2.cli import main

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
TOY = ["--task.type=custom", "--task.factory=toy_task:Vowels"]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("echo2: config error: ") and "\n" not in err, err
    return err


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """Two steps on the toy task (rewards vary) with TensorBoard and W&B (offline)."""
    run_dir = tmp_path_factory.mktemp("tracked") / "run"
    old = os.environ.get("WANDB_MODE")
    os.environ["WANDB_MODE"] = "offline"
    sys.path.insert(0, str(HERE))
    try:
        code = main(
            [
                "run",
                TINY,
                *TOY,
                f"--run.dir={run_dir}",
                "--learner.steps=2",
                "--learner.lr=1e-3",
                "--run.eval_size=0",
                '--run.report_to=["tensorboard", "wandb"]',
                "-q",
            ]
        )
    finally:
        sys.path.remove(str(HERE))
        if old is None:
            os.environ.pop("WANDB_MODE", None)
        else:
            os.environ["WANDB_MODE"] = old
    assert code == 0
    return run_dir


def test_tensorboard_wandb_and_samples(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((tracked_run / "tensorboard").glob("events.out.tfevents.*"))
    assert events, "TensorBoard event file"
    acc = EventAccumulator(str(tracked_run / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [0, 1]
    assert "train/loss" in acc.Tags()["scalars"] and "reward/zero_std_fraction" in acc.Tags()["scalars"]
    offline = list((tracked_run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0, "a W&B offline run directory"
    assert list(offline[0].parent.glob("files/media/table/samples_*.table.json")), "the samples table"
    samples = [json.loads(line) for line in (tracked_run / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {0, 1} and len(samples) == 2 * 4
    for s in samples:
        assert set(s) == {"step", "prompt", "completion", "reward", "version", "worker"}
        assert s["prompt"].strip() and isinstance(s["completion"], str) and s["worker"] == "learner"


def _greedy(model, ids: torch.Tensor) -> list[int]:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def test_checkpoint_and_export_load_with_from_pretrained(tracked_run, tmp_path, capsys):
    """The checkpoint as it is, and `echo2 export`, generate the learner's greedy tokens."""
    from safetensors.torch import load_model as load_weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from echo2.config import build_config, read_toml
    from echo2.models import load_model, load_tokenizer

    config = build_config(read_toml(tracked_run / "config.toml"))
    tokenizer = load_tokenizer(config.model)
    learner = load_model(config.model, vocab_size=len(tokenizer), seed=config.run.seed)
    load_weights(learner, str(tracked_run / "checkpoint" / "model.safetensors"))  # what the learner saved
    learner.eval()
    ids = tokenizer("Count the vowels: banana", return_tensors="pt").input_ids
    expected = _greedy(learner, ids)

    assert main(["export", str(tracked_run), str(tmp_path / "hf")]) == 0
    for where in (tracked_run / "checkpoint", tmp_path / "hf"):
        model = AutoModelForCausalLM.from_pretrained(where).eval()
        tok = AutoTokenizer.from_pretrained(where)
        assert tok("Count the vowels: banana", return_tensors="pt").input_ids.tolist() == ids.tolist()
        assert _greedy(model, ids) == expected, where
    capsys.readouterr()
    assert main(["export", str(tracked_run), str(tmp_path / "hf")]) == 2, "an export never overwrites"
    assert "exists and is not empty" in one_line_error(capsys)
    assert main(["export", str(tracked_run), str(tmp_path / "a"), "--adapter"]) == 2
    assert "--adapter" in one_line_error(capsys) and not (tmp_path / "a").exists()


def test_runs_never_collide(tmp_path, monkeypatch, capsys):
    """Without an explicit run.dir a second run gets a fresh directory; an explicit one is refused."""
    monkeypatch.chdir(tmp_path)
    common = ["--learner.steps=1", "--run.eval_size=0", "-q"]
    assert main(["run", TINY, *common]) == 0
    assert main(["run", TINY, *common]) == 0
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["tiny-seed0", "tiny-seed0-2"]
    for d in ("tiny-seed0", "tiny-seed0-2"):
        assert (tmp_path / "runs" / d / "checkpoint" / "state.json").is_file()
    capsys.readouterr()
    assert main(["run", TINY, "--run.dir=runs/tiny-seed0", *common]) == 2
    assert "already holds a run; use --resume runs/tiny-seed0" in one_line_error(capsys)


def test_zero_reward_variance_warns(tmp_path, caplog):
    """Arithmetic on a random model: every reward is 0, so no group has a gradient; after 5 such steps
    in a row (tracking.WARN_AFTER), say so."""
    assert main(["run", TINY, f"--run.dir={tmp_path / 'r'}", "--learner.steps=5", "--run.eval_size=0"]) == 0
    row = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["reward/zero_std_fraction"] == 1.0
    assert any("every group's rewards are equal" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- runtime mistakes: exit 2, one line
@pytest.mark.parametrize(
    ("path", "offline", "expected"),
    [
        ("models/no-such-model", False, "model.path: models/no-such-model: no such directory"),
        ("./no-such-model", False, "no-such-model: no such directory"),
        ("nobody-xyz/no-such-model-xyz", True, "not in the hub cache (HF_HUB_OFFLINE is set"),
        ("nobody-xyz/no-such-model-xyz", False, "the hub (http://127.0.0.1:9) cannot be reached"),
    ],
)
def test_a_model_that_cannot_be_had_fails_fast(tmp_path, monkeypatch, capsys, path, offline, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()  # a folder of models: models/X means a local directory
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a hub that refuses connections
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    assert main(["run", TINY, "--model.type=hf", f"--model.path={path}", "-q"]) == 2
    assert expected in one_line_error(capsys)
    assert time.monotonic() - start < 10, "no hub retries"
    assert [p.name for p in tmp_path.iterdir()] == ["models"], "no run directory"


def test_a_port_in_use_exits_2_and_leaves_no_run_dir(tmp_path, monkeypatch, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run_dir = tmp_path / "run"
        args = ["learner", TINY, f"--run.dir={run_dir}", f"--coordinator.port={port}", "-q"]
        assert main(args) == 2  # found before the model loads
        assert f"coordinator.port: cannot listen on 127.0.0.1:{port}: address already in use" in (
            one_line_error(capsys)
        )
        assert not run_dir.exists()
        # the same when the port is taken only after that check: the coordinator's own bind
        monkeypatch.setattr("echo2.cli.check_port", lambda host, port: None)
        assert main(args) == 2
        assert "address already in use" in one_line_error(capsys)
        assert not run_dir.exists(), "config.toml and the signing key were removed again"


def test_command_line_mistakes(capsys):
    assert main(["worker", "--coordinator", "localhost:8765", "--token", "t"]) == 2
    assert "--coordinator: not an http:// or https:// URL: 'localhost:8765'" in one_line_error(capsys)
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("echo2 0.")
    pool = str(ROOT / "configs" / "pool-example.toml")
    plan = ["plan", "--t-train", "100", "--t-bcast", "1", "--staleness", "2", "--pool", pool]
    assert main([*plan, "--batch", "8"]) == 0
    assert main([*plan, "--batch", "800"]) == 1, "no pool of this kind reaches the throughput"
    assert main([*plan, "--batch", "8", "--t-bcast", "200"]) == 1, "kappa * T_train <= T_bcast"


def test_plot_runs_names_a_missing_run(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "plot_runs.py"), str(tmp_path / "nope"), "--out", "x.png"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert f"{tmp_path / 'nope'}: no metrics.jsonl" in out.stderr


def test_task_module_and_data_files_relative_to_the_config(tmp_path, monkeypatch):
    """A config in its own folder names a task module and a data file beside it: no PYTHONPATH."""
    folder = tmp_path / "project"
    (folder / "data").mkdir(parents=True)
    (folder / "mytask.py").write_text((HERE / "toy_task.py").read_text())
    (folder / "data" / "train.jsonl").write_text(
        "".join(json.dumps({"question": f"{i} + 1", "answer": str(i + 1)}) + "\n" for i in range(6))
    )
    base = (ROOT / "configs" / "tiny.toml").read_text()
    (folder / "custom.toml").write_text(
        base.replace("[rollout]", '[task]\ntype = "custom"\nfactory = "mytask:Vowels"\n\n[rollout]')
    )
    (folder / "math.toml").write_text(
        base.replace("[rollout]", '[task]\ntype = "math"\ntrain_file = "data/train.jsonl"\n\n[rollout]')
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    common = ["--learner.steps=1", "--run.eval_size=0", "-q"]
    assert main(["run", str(folder / "custom.toml"), "--run.dir=custom", *common]) == 0
    assert main(["run", str(folder / "math.toml"), "--run.dir=math", *common]) == 0
    saved = (elsewhere / "math" / "config.toml").read_text()
    assert str(folder / "data" / "train.jsonl") in saved, "the resolved path is what the run keeps"


def test_workers_stop_with_exit_0_and_the_token_is_never_echoed(tmp_path, monkeypatch):
    """`echo2 learner` with $ECHO2_TOKEN and one `echo2 worker`: the learner never prints the token,
    and once the run is over the worker is told so and exits 0 within seconds."""
    token = "env-token-never-printed"
    env = {**os.environ, "ECHO2_TOKEN": token, "PYTHONPATH": str(HERE) + os.pathsep + str(ROOT / "src")}
    run_dir = tmp_path / "run"
    cli = [sys.executable, "-m", "echo2.cli"]
    args = ["learner", TINY, *TOY, f"--run.dir={run_dir}", "--learner.steps=2", "--run.eval_size=0"]
    args += ["--coordinator.heartbeat_interval=0.5", "--coordinator.heartbeat_timeout=5", "-q"]
    learner = subprocess.Popen(
        [*cli, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    worker = None
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "coordinator.url").exists():
            assert time.monotonic() < deadline and learner.poll() is None, "the learner did not start"
            time.sleep(0.2)
        url = (run_dir / "coordinator.url").read_text().strip()
        worker = subprocess.Popen(
            [*cli, "worker", "--coordinator", url, "--name", "w", "--threads", "1"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = learner.communicate(timeout=300)
        assert learner.returncode == 0, err[-2000:]
        finished = time.monotonic()
        _, werr = worker.communicate(timeout=60)
        assert worker.returncode == 0, werr[-2000:]
        assert time.monotonic() - finished < 30, "told the run is over, not retrying for minutes"
        assert "the run is over (run_finished)" in werr
    finally:
        for proc in (learner, worker):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert token not in out + err
    assert f"coordinator: {url}  token: from $ECHO2_TOKEN" in out
    assert not (run_dir / "coordinator.token").exists()


def test_with_local_workers_the_token_is_in_a_private_file(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("ECHO2_TOKEN", raising=False)
    run_dir = tmp_path / "run"
    args = [
        "run",
        TINY,
        f"--run.dir={run_dir}",
        "--workers=1",
        "--learner.steps=1",
        "--run.eval_size=0",
        "-q",
    ]
    assert main(args) == 0
    token_file = run_dir / "coordinator.token"
    assert (token_file.stat().st_mode & 0o777) == 0o600
    out = capsys.readouterr().out
    assert f"token: in {token_file}" in out and token_file.read_text().strip() not in out
    assert preflight.holds_run(run_dir)


def test_lora_run_exports_merged_and_as_a_peft_adapter(tmp_path, capsys):
    """A LoRA run leaves RUN_DIR/hf (merged); `echo2 export --adapter` writes a peft adapter over a
    base shipped beside it (the tiny base exists nowhere else); both generate the learner's tokens."""
    from safetensors.torch import load_model as load_weights
    from transformers import AutoModelForCausalLM

    from echo2.config import build_config, read_toml
    from echo2.learning.lora import apply_lora
    from echo2.models import load_model, load_tokenizer

    run_dir = tmp_path / "lora"
    sys.path.insert(0, str(HERE))
    try:
        args = ["run", TINY, *TOY, f"--run.dir={run_dir}", "--learner.steps=2", "--learner.lr=5e-2"]
        assert main([*args, "--learner.lora.rank=4", "--run.eval_size=0", "-q"]) == 0
    finally:
        sys.path.remove(str(HERE))
    config = build_config(read_toml(run_dir / "config.toml"))
    tokenizer = load_tokenizer(config.model)
    base = load_model(config.model, vocab_size=len(tokenizer), seed=config.run.seed).eval()
    ids = tokenizer("Count the vowels: banana", return_tensors="pt").input_ids
    learner = apply_lora(
        load_model(config.model, vocab_size=len(tokenizer), seed=config.run.seed), config.learner.lora
    )
    load_weights(learner, str(run_dir / "checkpoint" / "model.safetensors"))
    expected = _greedy(learner.eval(), ids)

    assert main(["export", str(run_dir), str(tmp_path / "adapter"), "--adapter"]) == 0
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    for where in (run_dir / "hf", tmp_path / "adapter"):
        model = AutoModelForCausalLM.from_pretrained(where).eval()
        assert _greedy(model, ids) == expected, where
    logits = learner(ids).logits
    assert not torch.allclose(logits, base(ids).logits), "the adapter changed the policy"
