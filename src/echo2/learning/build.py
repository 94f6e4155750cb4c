"""The learner on every rank: tokenizer, policy (with its LoRA adapter), reference model and
optimizer, loaded and then placed on the learner's device.

Two steps, because rank 0 builds its rollout engine from the CPU policy in between (loop.run):
`load` reads everything a config can get wrong before the run directory is touched, and `place`
puts it on the device (device.place: moved whole on one process, sharded by FSDP2 under torchrun).
`follow` (ranks > 0) calls the same two, so every rank builds the same policy: with the
same LoRA adapter, reference and gradient checkpointing as rank 0.

Under torchrun only rank 0 reads the weights. Ranks > 0 build the same architecture on the meta
device (no memory, no weights read) and receive rank 0's weights straight into their shards when
placed (distributed.shard), so no rank ever holds a second full copy on its CPU or device. Knows
nothing of rollouts, tasks or the coordinator.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from echo2.config import Config
from echo2.learning import distributed
from echo2.learning.checkpoint import LearnerState, load_checkpoint
from echo2.learning.device import place as place_on_device
from echo2.learning.device import resolved_learner
from echo2.learning.lora import adapter_state, apply_lora, is_lora
from echo2.learning.step import make_optimizer, train_step
from echo2.learning.verify import StepCheck, sampling_check
from echo2.models import load_model, load_tokenizer


@dataclasses.dataclass(slots=True, kw_only=True)
class Learner:
    """What `load` builds and `place` moves. Before `place`: the policy in fp32 on the CPU (on the
    meta device on ranks > 0 under torchrun); after: on the learner's device, with its optimizer."""

    tokenizer: Any
    model: Any
    ref_model: Any | None
    """The frozen reference of the KL penalty (learner.kl_beta > 0): the policy as loaded."""
    optimizer: torch.optim.Optimizer | None
    """None until placed, unless a checkpoint's state was loaded into it (resume)."""
    state: LearnerState = dataclasses.field(default_factory=LearnerState)
    source_state: dict[str, Any] | None = None
    """The rollout source's state from the checkpoint (resume), else None."""


def load(config: Config, *, resume_from: Path | None = None) -> Learner:
    """Tokenizer, policy (+ LoRA), reference and, on resume, the checkpoint's weights, optimizer
    state and counters. A config mistake raises ConfigError here, before anything is written."""
    lcfg = config.learner
    tokenizer = load_tokenizer(config.model)
    model = _policy(config, vocab_size=len(tokenizer), empty=distributed.rank() > 0)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if lcfg.kl_beta > 0 else None
    learner = Learner(tokenizer=tokenizer, model=model, ref_model=ref_model, optimizer=None)
    if resume_from is not None:  # refused under torchrun (device.check_start)
        learner.optimizer = make_optimizer(model, lcfg)
        learner.state, learner.source_state = load_checkpoint(
            resume_from, model=model, optimizer=learner.optimizer
        )
    return learner


def place(learner: Learner, config: Config) -> Learner:
    """The learner on its device (sharded under torchrun, a collective every rank calls), with an
    optimizer over the placed parameters."""
    learner.model, learner.optimizer, learner.ref_model = place_on_device(
        learner.model, learner.optimizer, learner.ref_model, config.learner, make_optimizer=make_optimizer
    )
    return learner


def step_check(config: Config, *, checks: bool, learner_version: int | None, eos_id: int | None) -> StepCheck:
    """A step's check of the records' log-probs and sampling (a fresh one each step), the same on
    every rank: `checks` (the source's `checks_logprobs`: False for emulated workers) and the version
    the step trains from come from rank 0's TRAIN order."""
    lcfg = config.learner
    return StepCheck(
        max_logratio=lcfg.max_logratio if checks else None,
        learner_version=learner_version,
        staleness=lcfg.staleness,
        sampling=sampling_check(
            config.rollout,
            is_env=config.task.type == "env",
            eos_id=eos_id,
            snapshot_dtype=resolved_learner(lcfg).dtype,
        )
        if checks
        else None,
    )


def train_order(groups, *, staleness: list[int] | None, checks: bool, version: int | None) -> dict[str, Any]:
    """Rank 0's TRAIN payload: what a follower needs to take exactly rank 0's step (the same
    records, the same `fresh` rows, the same check)."""
    return {"groups": groups, "staleness": staleness, "checks": checks, "version": version}


def follow(config: Config) -> dict[str, Any]:
    """A rank > 0: build the same learner as rank 0 (its policy on the meta device, filled from rank
    0's weights as it is sharded) and obey rank 0's orders until told to stop (distributed.obey)."""
    lcfg = config.learner
    torch.set_num_threads(config.run.threads or os.cpu_count() or 1)
    learner = place(load(config), config)

    def train(order: dict[str, Any]) -> None:
        train_step(
            learner.model,
            learner.optimizer,
            order["groups"],
            lcfg,
            pad_id=learner.tokenizer.pad_token_id,
            temperature=config.rollout.temperature,
            ref_model=learner.ref_model,
            staleness=order["staleness"],
            check=step_check(
                config,
                checks=order["checks"],
                learner_version=order["version"],
                eos_id=learner.tokenizer.eos_token_id,
            ),
            grouping=getattr(config.task, "grouping", "state"),  # never a record's metadata
        )

    # what rank 0's make_snapshot gathers
    gather = adapter_state if is_lora(learner.model) else distributed.full_state
    steps = distributed.obey(learner.model, learner.optimizer, train=train, gather=gather)
    return {"steps": steps, "eval_before": None, "eval_after": None}


def _policy(config: Config, *, vocab_size: int, empty: bool):
    """The policy, LoRA-wrapped when learner.lora is set; `empty`: on the meta device, weights unread."""
    if not empty:
        model = load_model(config.model, vocab_size=vocab_size, seed=config.run.seed)
        return apply_lora(model, config.learner.lora) if config.learner.lora is not None else model
    with torch.device("meta"):  # every tensor created here is meta, peft's adapters included
        model = _architecture(config, vocab_size=vocab_size)
        return apply_lora(model, config.learner.lora) if config.learner.lora is not None else model


def _architecture(config: Config, *, vocab_size: int):
    """The policy's module tree as `load_model` builds it, from its config alone (call under
    `torch.device("meta")`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from echo2.models import _hf_source, gguf_model_dir

    mcfg = config.model
    if mcfg.type == "tiny":  # built from a config already: nothing is read
        return load_model(mcfg, vocab_size=vocab_size, seed=config.run.seed)
    src = _hf_source(mcfg.path) if mcfg.type == "hf" else str(gguf_model_dir(mcfg.file, mcfg.cache_dir))
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.float32)
