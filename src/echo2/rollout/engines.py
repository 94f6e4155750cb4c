"""Which engine generates where: the factory for the learner's in-process engine and a worker's.

`worker_engine` builds the engine `echo2 worker` generates with, from the model section alone (its
weights arrive as snapshots); the learner's own engine, built from its policy, is
learning/engine.py's `learner_engine`, from the same parts. Both put the engine on a device in the dtype snapshots
arrive in (`engine_dtype`). Under torchrun (WORLD_SIZE > 1) the learner never builds vLLM: vLLM's
in-process engine would find echo2's NCCL world initialised and build its groups over every rank
with `new_group`, which the other ranks never call, so rank 0 would hang (vllm/distributed/
parallel_state.py `init_distributed_environment`, `initialize_model_parallel`; docs/gpu.md).
"""

from __future__ import annotations

import logging
import os

import torch

from echo2.config import Config, ConfigError, LearnerConfig
from echo2.rollout.engine import Engine, HFEngine

logger = logging.getLogger(__name__)


def torchrun_world() -> int:
    """WORLD_SIZE as torchrun sets it (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def engine_dtype(config: LearnerConfig, device: torch.device) -> torch.dtype:
    """The dtype snapshots arrive in (learner.dtype; "auto": bf16 on a CUDA device that supports it,
    as the learner resolves it), which a GPU engine generates in. CPU engines keep fp32 for the HF
    engine (see `hf_dtype`)."""
    if config.dtype == "bf16":
        return torch.bfloat16
    if config.dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def hf_dtype(config: LearnerConfig, device: torch.device) -> torch.dtype:
    """The HF engine's dtype: the snapshot dtype on a GPU; fp32 on the CPU, as before (transformers'
    CPU kernels gain little from bf16, and CPU results stay what they were)."""
    return engine_dtype(config, device) if device.type == "cuda" else torch.float32


def vllm_dtype(config: LearnerConfig, device: torch.device) -> str:
    """vLLM's `dtype=`: the snapshot dtype, on any device (as before on the CPU)."""
    return str(engine_dtype(config, device)).removeprefix("torch.")


def worker_device() -> torch.device:
    """An `echo2 worker`'s device: the first visible GPU (CUDA_VISIBLE_DEVICES picks it), else the
    CPU; ConfigError (exit 2) with the reason when nvidia-smi lists a GPU torch cannot use (a CPU
    build of torch, a driver too old for it: gpu_env.py), rather than generating on the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    from echo2 import gpu_env

    gpu_env.check_device("auto", key="echo2 worker")
    return torch.device("cpu")


def with_engine(config: Config, engine: str | None) -> Config:
    """The run's config with rollout.engine replaced by a worker's own choice (None: unchanged)."""
    if engine is None or engine == config.rollout.engine:
        return config
    return config.model_copy(update={"rollout": config.rollout.model_copy(update={"engine": engine})})


def worker_engine(
    config: Config, *, tokenizer, engine: str | None, device: torch.device, server_url: str | None = None
) -> Engine:
    """An `echo2 worker`'s engine: `engine` ("hf", "vllm" or "server", with `server_url` standing in
    for rollout.server.url; None: the run's rollout.engine) on
    `device`, in the dtype snapshots arrive in. It starts from the model section's weights (version
    -1 until the first snapshot installs); vLLM loads them from model.path itself when it can."""
    from echo2.models import load_model
    from echo2.rollout.vllm_engine import check_available, make_engine, model_source

    config = with_engine(config, engine)
    rcfg = config.rollout
    if rcfg.engine == "server":  # an inference server (rollout/server_engine.py)
        from echo2.rollout.server_engine import start_server_engine

        return start_server_engine(
            config, tokenizer=tokenizer, url=server_url, device=device, dtype=vllm_dtype(config.learner, device)
        )
    if rcfg.engine == "hf":
        model = load_model(config.model, vocab_size=len(tokenizer), seed=config.run.seed)
        return HFEngine(
            model, tokenizer, rcfg, version=-1, device=device, dtype=hf_dtype(config.learner, device)
        )
    check_available(rcfg)
    adapters = config.learner.lora is not None  # LoRA runs publish adapter snapshots
    source = model_source(config.model)
    model = None
    if source is None or adapters:  # weights to write, or a base for adapters to merge into
        model = load_model(config.model, vocab_size=len(tokenizer), seed=config.run.seed)
    return make_engine(
        rcfg,
        model=model,
        tokenizer=tokenizer,
        version=-1,
        seed=config.run.seed,
        dtype=vllm_dtype(config.learner, device),
        adapters=adapters,
        model_dir=source,
        device_kind="cuda" if device.type == "cuda" else "cpu",
    )


def worker_settings(
    config: Config, *, engine: str | None, device: torch.device, server_url: str | None = None
) -> dict:
    """What `worker_engine` would start, without starting it (`echo2 worker --dry-run`): engine,
    device, dtype and, for vLLM, where it loads the model from and its `LLM(...)` arguments. A
    setting vLLM would refuse raises ConfigError here too."""
    config = with_engine(config, engine)
    rcfg = config.rollout
    out: dict = {"engine": rcfg.engine, "device": str(device)}
    if rcfg.engine == "server":
        return out | server_settings(config, device=device, server_url=server_url)
    if rcfg.engine == "hf":
        return out | {"dtype": str(hf_dtype(config.learner, device)).removeprefix("torch.")}
    from echo2.rollout import vllm_args
    from echo2.rollout.vllm_engine import check_available, engine_args, model_source

    check_available(rcfg)
    vllm_args.check_sampling(rcfg)
    dtype = vllm_dtype(config.learner, device)
    source = model_source(config.model)
    out |= {"dtype": dtype, "model": str(source) if source else "(written at start: no local directory)"}
    if source is not None:
        kind = "cuda" if device.type == "cuda" else "cpu"
        out["llm_kwargs"] = engine_args(
            rcfg, model_dir=source, dtype=dtype, device_kind=kind
        ) | vllm_args.sampling_kwargs(rcfg)  # logprobs_mode; "gumbel": the logits processor
    return out


def server_settings(config: Config, *, device: torch.device, server_url: str | None) -> dict:
    """`worker_settings` of the server engine: the server it attaches to, or the `vllm serve`
    command it would launch (ConfigError for a url it would refuse)."""
    from echo2.rollout import server_admin
    from echo2.rollout.server_launch import launch_command
    from echo2.rollout.vllm_engine import engine_args, model_source

    scfg = config.rollout.server
    url = server_url or scfg.url
    if url is not None:
        server_admin.api_key_for(url, scfg.api_key_env)
        return {"server": url, "backend": scfg.backend}
    if not scfg.launch:
        raise ConfigError(
            "rollout.server: no server to drive: set rollout.server.url (or echo2 worker --server-url), "
            "or rollout.server.launch = true"
        )
    dtype = vllm_dtype(config.learner, device)
    source = model_source(config.model)
    out = {"server": "launched", "backend": "vllm", "dtype": dtype}
    if source is not None:
        kind = "cuda" if device.type == "cuda" else "cpu"
        kwargs = engine_args(config.rollout, model_dir=source, dtype=dtype, device_kind=kind)
        argv, env = launch_command(config.rollout, model_dir=source, dtype=dtype, socket_path="{socket}",
                                   llm_kwargs=kwargs, seed=config.run.seed, python=scfg.python)  # fmt: skip
        out |= {"command": argv, "environment": env}
    return out
