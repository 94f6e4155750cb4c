"""The schema of a run's configuration: one pydantic model per section, and the rules that tie
fields together (the kappa rule is shared with `echo2 plan` and the simulator). The workload
sections (`[model]`, `[task]`) are in workload.py, the control plane's (`[coordinator]`, `[scheduler]`,
`[broadcast]`) in fleet.py; the section base and `ConfigError` in base.py.

Knows no files and no command line (files.py reads and writes them). Imports no torch. A user
mistake raises `ConfigError` whose message names the dotted key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from echo2.config.base import _Section
from echo2.config.fleet import BroadcastConfig, CoordinatorConfig, SchedulerConfig
from echo2.config.workload import ArithmeticTaskConfig, GGUFModelConfig, ModelConfig, TaskConfig


def publish_every(kappa: int | None, staleness: int) -> int:
    """kappa, the publish period in learner steps: as given, else max(1, S - 1) (paper 3.3)."""
    return kappa if kappa is not None else max(1, staleness - 1)


def check_kappa(kappa: int | None, staleness: int, *, key: str = "learner.kappa") -> None:
    """kappa may not exceed max(1, S - 1), the default: with kappa >= 2 the staleness bound is
    kappa + ceil((1 - 1/kappa) T_bcast / T_train) (Appendix B.3), more than kappa whenever a
    broadcast takes any time, so kappa = S would let records go stale. `key` names the option in
    the message (`echo2 plan` says --kappa)."""
    if kappa is not None and kappa > max(1, staleness - 1):
        raise ValueError(f"{key}: {kappa} > max(1, S - 1) = {max(1, staleness - 1)} with S = {staleness}")


# ---------------------------------------------------------------------------- rollout
class VLLMConfig(_Section):
    """`[rollout.vllm]`: the vLLM engine's memory and length (rollout/vllm_args.py computes each
    unset one; docs/config.md and docs/gpu.md give the arithmetic)."""

    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """Share of the GPU's memory vLLM may use (weights, KV cache, activations); it must be free when
    the engine starts. None: 0.85 alone on the card; beside the learner, weights + KV + ~4 GiB
    overhead. Ignored on the CPU."""
    kv_cache_gib: float | None = Field(None, gt=0)
    """KV-cache size, GiB. None: ECHO2_VLLM_KV_CACHE_GIB if set, else 1 on the CPU, vLLM's own
    within gpu_memory_utilization alone on a GPU, and 20 (or what fits in half the card) beside the
    learner. One sequence of max_model_len tokens must fit."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest sequence (prompt + response) the engine accepts. None: max_prompt_tokens +
    max_new_tokens, the longest a rollout makes; a larger value only reserves more."""


class ServerConfig(_Section):
    """`[rollout.server]`: the inference server a worker drives with `--engine server`
    (rollout/server_engine.py, docs/engines.md): one it starts itself (`launch = true`) or one the
    operator runs (`url`, or `echo2 worker --server-url`)."""

    backend: Literal["vllm", "sglang"] = "vllm"
    """The server's kind: "vllm" (vllm serve 0.32, dev-mode routes) or "sglang" (its pause /
    update_weights_from_disk / continue routes; contract-tested only, docs/engines.md)."""
    url: str | None = None
    """A running server: http://127.0.0.1:PORT or unix:/path/to.sock. A host that is not this
    machine's loopback needs the API key in the environment variable `api_key_env` (the dev-mode
    routes can call any method of the server's workers). None: launch = true starts one."""
    launch: bool = False
    """Start `vllm serve` (the vllm backend only) for this worker, on a Unix socket of its own,
    with the flags echo2 needs; stopped, by its pid, when the worker exits."""
    api_key_env: str = "ECHO2_SERVER_API_KEY"
    """Environment variable holding the server's API key (sent as a bearer token); required for a
    url whose host is not loopback. The key itself is never in a config file."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Ranks a launched server splits the model over (--tensor-parallel-size); installs go by file
    path, so every rank loads its own shard."""
    start_timeout_s: float = Field(900.0, gt=0)
    """Seconds a launched server has to answer /health before the worker gives up."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Seconds one generation request may take."""
    install_timeout_s: float = Field(600.0, gt=0)
    """Seconds one snapshot install (pause, load, resume) may take."""
    python: str | None = None
    """The Python a launched server runs under (echo2 must import there: the server loads echo2's
    worker extension and logits processor). None: the worker's own."""

    @model_validator(mode="after")
    def _one_source(self) -> ServerConfig:
        if self.launch and self.url is not None:
            raise ValueError("rollout.server.launch: true with rollout.server.url set: pick one")
        if self.launch and self.backend != "vllm":
            raise ValueError(f"rollout.server.launch: echo2 starts vllm serve only, not {self.backend}")
        return self


class RolloutConfig(_Section):
    engine: Literal["hf", "vllm", "server"] = "hf"
    """Generation engine: "hf" (transformers generate), "vllm" (in process; needs the `vllm` extra)
    or "server" (workers only: an inference server, `[rollout.server]`)."""
    prompts_per_step: int = Field(8, ge=1)
    """Groups (distinct prompts) per learner step."""
    group_size: int = Field(8, ge=2)
    """Samples per prompt (n); GRPO needs at least 2 to normalise within a group."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the learner evaluates log-probs at the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass, in (0, 1]."""
    sampling: Literal["multinomial", "gumbel"] = "gumbel"
    """How engines draw tokens. "gumbel" (the default): verifiable sampling (rollout/sampling.py):
    the arg-max of the truncated logits / T plus Gumbel noise keyed by the lease's seed (issued by
    the coordinator), the record and the position, which the learner regenerates to refuse, with a
    strike, a record whose tokens were not sampled that way. "multinomial": the engine's own sampler,
    unchecked: a worker's chosen tokens are trained (SGLang servers, which have no echo2 processor,
    need it)."""
    sampling_tolerance: float | None = Field(None, gt=0)
    """"gumbel": the largest margin (arg-max score - the sampled token's score, in logits / T) a
    sampled token may have at the learner and still count as drawn: room for the engine's logits to
    differ from the fp32 learner's. A worker may pick any token within it (docs/security.md). None:
    by the snapshot dtype engines run in, 0.5 for bf16 (bf16 engines reached 0.43), 0.01 for fp32
    (fp32 engines: under 1e-4) (rollout/sampling.py `default_tolerance`)."""
    sampling_strike_margin: float | None = Field(None, gt=0)
    """"gumbel": a record whose worst margin is over the tolerance but at most this is left out of
    the step without a strike (honest bf16 engines reach such margins now and then); over it, the
    record is refused and its worker struck. None: twice the tolerance (learning/verify.py
    `STRIKE_FACTOR`). Values under the tolerance count as the tolerance."""
    max_new_tokens: int = Field(32, ge=1)
    """Responses are cut at this length (or at EOS)."""
    max_prompt_tokens: int = Field(256, ge=1)
    """Prompts longer than this are rejected by the task with an error naming the row."""
    lag: int = Field(0, ge=0)
    """Experiments, in-process loop only (no workers): generate every batch with the snapshot
    exactly `lag` versions older than the learner (version 0 until `lag` steps exist); needs
    learner.staleness >= lag. 0: the usual loop."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """The vLLM engine's GPU memory share, KV cache and maximum length (used by rollout.engine =
    "vllm" and by `echo2 worker --engine vllm`; a launched server takes them too)."""
    server: ServerConfig = Field(default_factory=ServerConfig)
    """The inference server of `echo2 worker --engine server`."""

    @model_validator(mode="after")
    def _vllm_sampling(self) -> RolloutConfig:
        if (
            self.engine in ("vllm", "server")
            and self.sampling == "multinomial"
            and self.top_p < 1
            and self.temperature != 1
        ):
            # vLLM's own sampler returns raw log-probs (no temperature) or processed ones (renormalised
            # over the nucleus): at T = 1 the raw ones are the learner's (rollout/vllm_args.py
            # logprobs_mode). Under "gumbel" echo2's processor reports them itself (vllm_sampling.py).
            raise ValueError(
                f"rollout.top_p: the vllm engine samples top_p = {self.top_p} < 1 only at "
                f"rollout.temperature = 1.0 (got {self.temperature})"
            )
        length = self.max_prompt_tokens + self.max_new_tokens
        if self.vllm.max_model_len is not None and self.vllm.max_model_len < length:
            raise ValueError(
                f"rollout.vllm.max_model_len: {self.vllm.max_model_len} < rollout.max_prompt_tokens + "
                f"rollout.max_new_tokens = {length} (a response would be cut short)"
            )
        return self


# ---------------------------------------------------------------------------- learner
class LoraConfig(_Section):
    rank: int = Field(8, ge=1)
    """r: each adapter is B @ A (A: r x in, B: out x r), its output scaled by alpha / rank."""
    alpha: float = Field(16.0, gt=0)
    """Numerator of the adapter scale alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Adapter input dropout in training; above 0 the ratio of an unchanged policy is noisy."""
    target_modules: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], min_length=1)  # fmt: skip
    """Linear layers (names or dotted suffixes) given an adapter; each must exist in the model."""


class LearnerConfig(_Section):
    steps: int = Field(30, ge=1)
    """Optimizer steps in the run."""
    lr: float = Field(2e-6, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    staleness: int = Field(0, ge=0)
    """S: consume only records generated by a policy at most S versions old."""
    kappa: int | None = Field(None, ge=1)
    """Publish a snapshot every kappa steps; default max(1, S - 1), also its largest value."""
    clip_eps_low: float = Field(0.2, ge=0, lt=1)
    """Lower clip of the importance ratio: 1 - eps_low."""
    clip_eps_high: float = Field(0.28, ge=0)
    """Upper clip of the importance ratio: 1 + eps_high."""
    correction: Literal["clip", "dual_clip", "tis", "decoupled"] = "clip"
    """Off-policy correction of the policy loss (formulas in docs/config.md): "clip" (PPO clipped
    ratio), "dual_clip" (also bounds the loss of a negative advantage at dual_clip_delta),
    "tis" (truncated importance sampling, cap is_cap), "decoupled" (AReaL decoupled PPO)."""
    dual_clip_delta: float = Field(4.0, gt=1)
    """dual_clip: the loss of a token with advantage A < 0 is at most -delta * A (paper: 4)."""
    is_cap: float = Field(2.0, ge=1)
    """tis and decoupled: cap C of the truncated importance weight (pi/mu, or pi_prox/mu)."""
    ratio_cap: float | None = Field(1.28, ge=1)
    """The largest importance ratio pi/mu a worker's behaviour log-prob can give one token: every
    correction takes mu as at least the learner's own pi / ratio_cap, so a worker's log-probs can
    lower its tokens' weight but never raise one past ratio_cap (forged log-probs inside the check's
    bounds steering a step, docs/security.md). None: uncapped (before issue 41)."""
    kl_beta: float = Field(0.0, ge=0)
    """Weight of the KL penalty to a frozen reference; 0 loads no reference model."""
    scale_adv_by_std: bool = True
    """Divide group-centred rewards by the group std (GRPO); false keeps only the centring."""
    adv_eps: float = Field(1e-6, gt=0)
    """Added to the group std before dividing."""
    micro_batch_tokens: int | None = Field(None, ge=16)
    """Token budget (padded sequence length x rows) of one forward/backward micro-batch. None: 4096
    on the CPU, 16384 on a GPU (resolved at the learner's start, echo2.learning.device.resolved)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the learner trains: "auto" is cuda when torch sees a GPU, else cpu. "cuda" without a GPU
    is refused at start. Under torchrun each rank uses cuda:LOCAL_RANK."""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute dtype. "bf16": fp32 master weights and fp32 AdamW state, forward and backward under
    bf16 autocast (FSDP2 gathers bf16 parameters, reduces fp32 gradients); snapshots are published in
    bf16 (half the bytes each chain carries). "auto": bf16 on a GPU that supports it, else fp32."""
    gradient_checkpointing: bool | None = None
    """Recompute each decoder layer's activations in the backward pass: less memory, ~30% more time.
    None: on for a GPU, off for the CPU."""
    lora: LoraConfig | None = None
    """Train only a LoRA adapter (peft); snapshots then carry only the adapter. None: full."""
    max_logratio: float | None = Field(1.0, gt=0)
    """Leave out of a step a record whose |mean log-ratio| (learner vs behaviour log-probs over its
    loss tokens) exceeds this, times 1 + its staleness; its worker gets a strike. None: no check."""

    @model_validator(mode="after")
    def _kappa_bound(self) -> LearnerConfig:
        check_kappa(self.kappa, self.staleness)
        return self

    @property
    def publish_every(self) -> int:
        return publish_every(self.kappa, self.staleness)


# ---------------------------------------------------------------------------- run
class RunConfig(_Section):
    dir: str = "runs/{name}-seed{seed}"
    """Run directory; `{name}` and `{seed}` are filled in."""
    name: str = "echo2"
    """Name used in the run directory."""
    seed: int = 0
    """Seeds prompts, sampling and initialisation."""
    eval_size: int = Field(100, ge=0)
    """Held-out problems scored greedily before and after training (0 skips evaluation)."""
    eval_batch_size: int = Field(50, ge=1)
    """Prompts per greedy generation batch during evaluation."""
    eval_every: int = Field(0, ge=0)
    """Also measure held-out accuracy every N steps (metrics `eval/accuracy`); 0: only before and
    after training."""
    checkpoint_every: int = Field(10, ge=0)
    """Save a checkpoint every N steps (0: only at the end). Records accepted since the last one
    are not lost to a crash (RUN_DIR/accepted.jsonl is replayed on resume); the training steps
    since then are redone."""
    threads: int | None = Field(None, ge=1)
    """torch intra-op threads; default: all cores."""
    report_to: list[Literal["tensorboard", "wandb"]] = []
    """Experiment trackers beside metrics.jsonl: "tensorboard" (RUN_DIR/tensorboard), "wandb"
    (RUN_DIR/wandb; offline unless WANDB_MODE or an API key says otherwise). Extra `track`."""
    samples_per_step: int = Field(4, ge=0)
    """Completions per step written to RUN_DIR/samples.jsonl and to the trackers as a table."""
    wandb_project: str = "echo2"
    """W&B project of the run (report_to = ["wandb"])."""


class Config(_Section):
    model: ModelConfig = Field(default_factory=GGUFModelConfig)
    task: TaskConfig = Field(default_factory=ArithmeticTaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    coordinator: CoordinatorConfig = Field(default_factory=CoordinatorConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    broadcast: BroadcastConfig = Field(default_factory=BroadcastConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _lag_admitted(self) -> Config:
        if self.rollout.lag > self.learner.staleness:
            raise ValueError(
                f"rollout.lag: {self.rollout.lag} > learner.staleness = {self.learner.staleness} "
                "(the buffer would reject every batch)"
            )
        return self

    def run_dir(self) -> Path:
        return Path(self.run.dir.format(name=self.run.name, seed=self.run.seed))
