"""Engines on a device in a dtype (HFEngine's placement, the learner's and a worker's engine from
echo2.rollout.engines), checked on the CPU through the meta device and bf16."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch

from echo2.config import Config, HFModelConfig, LearnerConfig, RolloutConfig, TinyModelConfig
from echo2.learning.engine import learner_engine
from echo2.rollout.engine import HFEngine
from echo2.rollout.engines import engine_dtype, hf_dtype


class _Handed(Exception):
    """Raised by a stand-in `generate` once it has seen its inputs."""


def _capture_generate(engine) -> dict:
    seen: dict = {}

    def generate(**kwargs):
        seen.update(kwargs)
        raise _Handed

    engine.model.generate = generate
    return seen


def test_hf_engine_moves_its_model_and_builds_inputs_on_its_device(tiny, rollout_cfg):
    model, tok = tiny
    engine = HFEngine(copy.deepcopy(model), tok, rollout_cfg, device="meta", dtype=torch.bfloat16)
    params = list(engine.model.parameters())
    assert {p.device.type for p in params} == {"meta"} and {p.dtype for p in params} == {torch.bfloat16}
    seen = _capture_generate(engine)
    with pytest.raises(_Handed):
        engine.generate_ids([[1, 2, 3], [4, 5]], n=1)
    assert seen["input_ids"].device.type == "meta" and seen["attention_mask"].device.type == "meta"


def test_hf_engine_in_bf16_returns_cpu_float_logprobs(tiny, rollout_cfg):
    model, tok = tiny
    engine = HFEngine(copy.deepcopy(model), tok, rollout_cfg, device="cpu", dtype=torch.bfloat16)
    torch.manual_seed(0)
    (group,) = engine.generate_ids([[1, 2, 3]], n=2)
    for sample in group:
        assert len(sample.logprobs) == len(sample.response_ids) > 0
        assert all(type(x) is float and x <= 0 for x in sample.logprobs)


def test_hf_engine_without_device_keeps_the_model_where_it_is(tiny, rollout_cfg):
    model, tok = tiny
    own = copy.deepcopy(model)
    engine = HFEngine(own, tok, rollout_cfg)
    assert engine.model is own and engine.device == torch.device("cpu")
    assert next(own.parameters()).dtype == torch.float32


def test_engine_dtype_is_the_snapshot_dtype_and_hf_keeps_fp32_on_the_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert engine_dtype(LearnerConfig(dtype="bf16"), cuda) == torch.bfloat16
    assert engine_dtype(LearnerConfig(dtype="fp32"), cuda) == torch.float32
    assert engine_dtype(LearnerConfig(dtype="bf16"), cpu) == torch.bfloat16  # vLLM on CPU: as before
    assert hf_dtype(LearnerConfig(dtype="bf16"), cuda) == torch.bfloat16
    assert hf_dtype(LearnerConfig(dtype="bf16"), cpu) == torch.float32


def _tiny_config(**rollout) -> Config:
    return Config(model=TinyModelConfig(), rollout=RolloutConfig(max_new_tokens=4, **rollout))


def test_learner_engine_is_an_hf_engine_on_the_learners_device(tiny):
    model, tok = tiny
    engine = learner_engine(
        _tiny_config(), model=model, tokenizer=tok, version=2, device=torch.device("meta")
    )
    assert isinstance(engine, HFEngine) and engine.version == 2
    assert engine.model is not model, "a copy: the learner's policy stays as it was"
    assert {p.device.type for p in engine.model.parameters()} == {"meta"}
    assert next(model.parameters()).device.type == "cpu"


def test_learner_engine_never_builds_vllm_under_torchrun(tiny, monkeypatch, caplog):
    """B2: an in-process vLLM on rank 0 would join echo2's NCCL world and hang; the learner
    evaluates with the HF engine on its own device instead, and says why."""
    model, tok = tiny
    monkeypatch.setenv("WORLD_SIZE", "2")

    def no_vllm(*args, **kwargs):
        raise AssertionError("vLLM built under torchrun")

    monkeypatch.setattr("echo2.rollout.vllm_engine.VLLMEngine", no_vllm)
    with caplog.at_level(logging.WARNING, logger="echo2.rollout.engines"):
        engine = learner_engine(
            _tiny_config(engine="vllm"), model=model, tokenizer=tok, version=0, device=torch.device("cpu")
        )
    assert isinstance(engine, HFEngine)
    assert "torchrun" in caplog.text and "hang" in caplog.text


# ---------------------------------------------------------------- vLLM: where it loads from, seeds
class FakeVLLM:
    """Stands in for VLLMEngine: records what it is started with and the weights' dtypes on disk."""

    made: list[FakeVLLM] = []

    def __init__(self, model_dir, tokenizer, config, **kwargs) -> None:
        from safetensors import safe_open

        self.model_dir, self.config, self.kwargs = Path(model_dir), config, kwargs
        self.version = kwargs["version"]
        self.disk_dtypes = set()
        for path in self.model_dir.glob("*.safetensors"):
            with safe_open(str(path), framework="pt") as f:
                self.disk_dtypes |= {f.get_slice(k).get_dtype() for k in f.keys()}
        FakeVLLM.made.append(self)


@pytest.fixture
def fake_vllm(monkeypatch):
    FakeVLLM.made = []
    monkeypatch.setattr("echo2.rollout.vllm_engine.VLLMEngine", FakeVLLM)
    monkeypatch.setattr("echo2.rollout.vllm_engine.check_available", lambda config: None)
    return FakeVLLM


@pytest.fixture
def hf_dir(tiny, tmp_path) -> Path:
    """The tiny model as a local Hugging Face directory (model.type = "hf")."""
    model, tok = tiny
    model.save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def _hf_config(path: Path, *, engine: str = "vllm", dtype: str = "fp32") -> Config:
    return Config(
        model=HFModelConfig(path=str(path)),
        rollout=RolloutConfig(engine=engine, max_new_tokens=4),
        learner=LearnerConfig(dtype=dtype),
    )


def test_vllm_loads_an_hf_directory_itself_with_no_temporary_copy(tiny, hf_dir, fake_vllm, monkeypatch):
    """P2: no save_pretrained of the learner's fp32 model into /tmp for a local HF directory."""
    model, tok = tiny

    def no_copy(*args, **kwargs):
        raise AssertionError("a temporary model directory was written")

    monkeypatch.setattr("tempfile.mkdtemp", no_copy)
    config = _hf_config(hf_dir, dtype="bf16")
    learner_engine(config, model=model, tokenizer=tok, version=0, device=torch.device("cpu"))
    (made,) = fake_vllm.made
    assert made.model_dir == hf_dir and made.kwargs["dtype"] == "bfloat16"
    assert made.kwargs["base_model"] is None and not made.kwargs["shared"]


def test_a_temporary_directory_is_written_in_the_snapshot_dtype(tiny, hf_dir, fake_vllm):
    """A resumed full fine-tune (version > 0) differs from model.path: its weights are written,
    in bf16 when snapshots are bf16 (half an fp32 copy)."""
    model, tok = tiny
    learner_engine(
        _hf_config(hf_dir, dtype="bf16"), model=model, tokenizer=tok, version=3, device=torch.device("cpu")
    )
    (made,) = fake_vllm.made
    assert made.model_dir != hf_dir and made.disk_dtypes == {"BF16"}
    assert not made.model_dir.exists(), "dropped once vLLM has loaded it"
    assert next(model.parameters()).dtype == torch.float32, "the learner's policy is left alone"


def test_a_worker_picks_its_own_engine_and_loads_no_hf_model_for_vllm(tiny, hf_dir, fake_vllm, monkeypatch):
    from echo2.rollout.engines import worker_engine

    _, tok = tiny
    monkeypatch.setattr("echo2.models.load_model", lambda *a, **k: pytest.fail("an HF model was loaded"))
    engine = worker_engine(
        _hf_config(hf_dir, engine="hf"), tokenizer=tok, engine="vllm", device=torch.device("cpu")
    )
    assert isinstance(engine, FakeVLLM) and engine.version == -1 and engine.model_dir == hf_dir
    assert engine.config.engine == "vllm"


def test_the_worker_flag_reaches_the_engine_it_builds(tiny, fake_vllm):
    """`echo2 worker --engine vllm` against a run whose rollout.engine is hf (Worker._build)."""
    from echo2.rollout.worker import Worker
    from echo2.rollout.worker_config import WorkerConfig

    worker = Worker.__new__(Worker)
    worker.config = WorkerConfig(url="http://x:1", token="t", name="w", engine="vllm")
    worker.run_config = _tiny_config()
    worker._build()
    assert isinstance(worker.engine, FakeVLLM)
    worker.config = WorkerConfig(url="http://x:1", token="t", name="w")
    worker._build()
    assert isinstance(worker.engine, HFEngine) and worker.engine.device == torch.device("cpu")


def test_vllm_gets_one_seed_per_prompt_from_torch_on_a_gpu(tiny):
    """B5, as handed to vLLM: on "cuda" every prompt carries a seed drawn from torch's generator
    (vLLM seeds its n samples seed + index); on the CPU none (its sampler uses torch's generator)."""
    pytest.importorskip("vllm")
    from echo2.rollout.vllm_engine import VLLMEngine

    _, tok = tiny
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.config, engine.eos_id, engine.device_kind = (
        RolloutConfig(top_p=0.95, sampling="multinomial"),
        tok.eos_token_id,
        "cuda",
    )

    class Handed(Exception):
        pass

    seen = []

    class FakeLLM:
        def generate(self, prompts, params, use_tqdm):
            seen.append([p.seed for p in params])
            assert len(params) == len(prompts) and {p.n for p in params} == {3} and params[0].top_p == 0.95
            raise Handed

    engine.llm = FakeLLM()
    for _ in range(2):
        torch.manual_seed(7)
        with pytest.raises(Handed):
            engine.generate_ids([[1, 2], [3], [4, 5, 6]], n=3)
    assert seen[0] == seen[1] and len(set(seen[0])) == 3 and None not in seen[0]
    engine.device_kind = "cpu"
    with pytest.raises(Handed):
        engine.generate_ids([[1, 2]], n=3)
    assert seen[-1] == [None]
    assert [p.seed for p in engine.sampling_params(2, n=1, greedy=True)] == [None, None]


# ---------------------------------------------------------------- echo2 worker --engine / --dry-run
WORKER = ["worker", "--coordinator", "http://127.0.0.1:9", "--token", "t"]


def test_worker_dry_run_prints_the_engine_settings_without_connecting(hf_dir, tmp_path, monkeypatch, capsys):
    """On a GPU machine (faked: cuda:0 of an H200), a vLLM worker for an hf model: vLLM loads
    model.path itself, in the snapshot dtype, with a 0.85 share of the card."""
    import json

    from echo2.cli import main

    pytest.importorskip("vllm")
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\ntype = "hf"\npath = "{hf_dir}"\n[learner]\ndtype = "bf16"\n')
    monkeypatch.setattr("echo2.rollout.engines.worker_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr("torch.cuda.mem_get_info", lambda device=None: (140 * 2**30, 141 * 2**30))
    assert main([*WORKER, "--engine", "vllm", "--dry-run", "--config", str(config)]) == 0
    settings = json.loads(capsys.readouterr().out)
    assert settings["engine"] == "vllm" and settings["device"] == "cuda:0" and settings["dtype"] == "bfloat16"
    assert settings["model"] == str(hf_dir)
    assert settings["llm_kwargs"] == {
        "max_model_len": 256 + 32,
        "gpu_memory_utilization": 0.85,
        "enforce_eager": False,
        "logprobs_mode": "processed_logits",  # verifiable sampling by default: echo2's processor
        "logits_processors": ["echo2.rollout.vllm_sampling:GumbelLogitsProcessor"],
    }


def test_a_worker_beside_a_gpu_torch_cannot_use_refuses_to_start(monkeypatch, capsys):
    """Not silently on the CPU: exit 2 with gpu_env's one-line reason."""
    from echo2 import gpu_env
    from echo2.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_env, "probe", lambda: None)
    monkeypatch.setattr(
        gpu_env, "refusal", lambda facts, requested: "auto requested, but torch is a CPU build"
    )
    assert main([*WORKER, "--engine", "vllm", "--dry-run"]) == 2
    assert "echo2 worker: auto requested, but torch is a CPU build" in capsys.readouterr().err


def test_worker_dry_run_of_the_hf_engine_and_without_a_config(tmp_path, capsys):
    import json

    from echo2.cli import main

    assert main([*WORKER, "--engine", "hf", "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["engine"] == "hf"
    from support import TINY

    assert main([*WORKER, "--dry-run", "--config", TINY]) == 0
    assert json.loads(capsys.readouterr().out) == {"engine": "hf", "device": "cpu", "dtype": "float32"}


def test_worker_flags_are_checked_and_the_engine_flag_reaches_the_worker(monkeypatch, capsys):
    from echo2.cli import main

    assert main([*WORKER, "--config", "x.toml"]) == 2
    assert "--config: only with --dry-run" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):  # argparse: exit 2 naming --engine's choices
        main([*WORKER, "--engine", "sglang", "--dry-run"])
    assert "--engine: invalid choice" in capsys.readouterr().err
    seen = []

    class FakeWorker:
        def __init__(self, config):
            seen.append(config)
            self.counts = {}

        async def run(self, stop):
            return None

    monkeypatch.setattr("echo2.rollout.worker.Worker", FakeWorker)
    assert main([*WORKER, "--engine", "vllm"]) == 0
    assert seen[0].engine == "vllm"
