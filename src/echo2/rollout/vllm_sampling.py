"""Keyed Gumbel-max sampling inside vLLM (rollout.sampling = "gumbel" with the vllm engine): a V1
logits processor that makes vLLM pick, for every request carrying echo2's keys, exactly the token
`sampling.sample` picks, and report its behaviour log-prob log_softmax(logits / T) at that token.

How it fits vLLM 0.32's V1 sampler (vllm/v1/sample/sampler.py `Sampler.forward`, `sample`):
- a processor that is not argmax-invariant runs in `apply_logits_processors`, on the float32 logits
  as the model gave them (before temperature, top-k/top-p and any sampling);
- echo2's requests are greedy for vLLM (temperature 0; SamplingParams then forces top_p 1, top_k 0
  and n 1), so vLLM takes the arg-max of the processor's row (`greedy_sample`) and, when every
  request of the batch is greedy, returns that row itself as "processed_logits" (`sample`:
  `processed_logprobs = logits`);
- so the processor writes -inf everywhere but at the keyed arg-max, where it writes that token's
  log_softmax(logits / T) (float64, then float32): the token vLLM picks is the one the learner's
  check (`sampling.check`) expects, and the log-prob it returns is the learner's, at any T and top_p
  (the truncation is the processor's, `sampling.scores`; log-probs are not renormalised over it).
- A greedy request of such an engine (evaluation) is marked too: its row becomes log_softmax(logits)
  (same arg-max), so its "processed logits" are its log-probs at T = 1, as `HFEngine` reports them.

The response position of a request's next token is the length of its output token list (vLLM
appends each sampled token to the list the BatchUpdate handed over, or a -1 placeholder under async
scheduling: vllm/v1/worker/gpu_model_runner.py) plus the request's offset (a multi-turn reply).
`LLM(logits_processors=[vllm_args.GUMBEL_PROCESSOR])` names this class by module path, so vLLM's
engine-core process imports it. A prompt's n samples are n requests, each with its own record key (children of an n > 1 request
share one `extra_args`: vllm/v1/engine/parallel_sampling.py); prefix caching shares the prompt.

Only vLLM's V1 model runner takes this interface; the V2 GPU runner has another one
(vllm/v1/worker/gpu/sample/logits_processor/), so the engine sets VLLM_USE_V2_MODEL_RUNNER=0.
"""

from __future__ import annotations

import math

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from echo2.rollout import sampling, vllm_args

KEY, GREEDY, extra_args = vllm_args.GUMBEL_KEY, vllm_args.GREEDY_KEY, vllm_args.gumbel_extra_args
"""Defined in rollout/vllm_args.py (no vllm import: the server engine builds them too)."""


class GumbelLogitsProcessor(LogitsProcessor):
    """Per persistent-batch index: the request's keys and its (live) output token list."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[tuple | None, list[int]]] = {}

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        args = params.extra_args or {}
        if KEY not in args and GREEDY not in args:
            return
        if params.temperature != 0 or params.n != 1:
            raise ValueError(f"{KEY}: a keyed request must be greedy for vLLM (temperature 0, n 1)")
        if KEY in args:
            value = args[KEY]
            if not (isinstance(value, (list, tuple)) and len(value) == 5):
                raise ValueError(f"{KEY}: [seed, record, offset, temperature, top_p], got {value!r}")
            seed, record, offset, temperature, top_p = value
            if not (0 <= seed < 2**63 and 0 <= record < 2**63 and offset >= 0):
                raise ValueError(f"{KEY}: seed and record must be 63-bit, offset >= 0: {value!r}")
            if not (temperature > 0 and 0 < top_p <= 1):
                raise ValueError(f"{KEY}: temperature > 0 and top_p in (0, 1]: {value!r}")

    def is_argmax_invariant(self) -> bool:
        return False  # it picks the token: applied before greedy sampling

    @staticmethod
    def _new(params: SamplingParams, _prompt: list[int] | None, output: list[int]):
        args = params.extra_args or {}
        if KEY in args:
            return tuple(args[KEY]), output
        if GREEDY in args:
            return None, output
        return None  # not ours: left alone

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._new)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        groups: dict[tuple[float, float], list[tuple[int, int, int, int]]] = {}
        greedy: list[int] = []
        for index, (keys, output) in self.rows.items():
            if keys is None:
                greedy.append(index)
                continue
            seed, record, offset, temperature, top_p = keys
            groups.setdefault((temperature, top_p), []).append((index, seed, record, offset + len(output)))
        if greedy:
            rows = torch.tensor(greedy, device=logits.device)
            logits[rows] = logits[rows].log_softmax(dim=-1)
        for (temperature, top_p), members in groups.items():
            index, seed, record, position = (
                torch.tensor(col, dtype=torch.long, device=logits.device)
                for col in zip(*members, strict=True)
            )
            raw = logits[index]
            tokens = sampling.sample(
                raw, seed=seed, records=record, positions=position, temperature=temperature, top_p=top_p
            )
            logprob = (raw.double() / temperature).log_softmax(dim=-1).gather(1, tokens[:, None])
            out = torch.full_like(raw, -math.inf)
            out.scatter_(1, tokens[:, None], logprob.to(raw.dtype))
            logits[index] = out
        return logits
