"""rollout.sampling = "gumbel" with the vllm engine, without starting vLLM: the LLM arguments
(rollout/vllm_args.py) and the logits processor's rows (rollout/vllm_sampling.py, skipped where vllm
is not installed). The engine end to end: tests/e2e/test_vllm_gumbel.py."""

from __future__ import annotations

import math

import pytest
import torch

from echo2.config import ConfigError, RolloutConfig
from echo2.rollout import sampling, vllm_args
from echo2.rollout.sampling import SamplingKeys


def test_gumbel_takes_the_processor_and_processed_logits_at_any_temperature_and_top_p():
    cfg = RolloutConfig(sampling="gumbel", temperature=0.7, top_p=0.9)
    vllm_args.check_sampling(cfg)  # the processor truncates and reports the log-probs itself
    assert vllm_args.sampling_kwargs(cfg) == {
        "logprobs_mode": "processed_logits",
        "logits_processors": [vllm_args.GUMBEL_PROCESSOR],
    }
    assert vllm_args.sampling_kwargs(RolloutConfig(sampling="multinomial")) == {"logprobs_mode": "processed_logprobs"}
    with pytest.raises(ConfigError, match="rollout.top_p"):  # vLLM's own sampler: still refused
        vllm_args.check_sampling(RolloutConfig(temperature=0.7, top_p=0.9, sampling="multinomial"))


def _processor():
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from echo2.rollout import vllm_sampling

    proc = vllm_sampling.GumbelLogitsProcessor(None, torch.device("cpu"), False)
    assert not proc.is_argmax_invariant()
    return proc, vllm_sampling, SamplingParams, BatchUpdate, MoveDirectionality


def test_the_processor_leaves_the_keyed_argmax_holding_its_logprob():
    proc, vs, SamplingParams, BatchUpdate, Move = _processor()
    keys = SamplingKeys(seed=5, groups=("g",), samples=(3,), offsets=(4,))
    (extra,) = vs.extra_args(keys, n=1, temperature=0.8, top_p=0.9)
    keyed = SamplingParams(temperature=0.0, extra_args=extra)
    greedy = SamplingParams(temperature=0.0, extra_args={vs.GREEDY: 1})
    plain = SamplingParams(temperature=1.0)
    for p in (keyed, greedy, plain):
        vs.GumbelLogitsProcessor.validate_params(p)
    with pytest.raises(ValueError, match="greedy"):
        vs.GumbelLogitsProcessor.validate_params(SamplingParams(temperature=1.0, extra_args=extra))

    output = [11, 12]  # the request's live output list: the next token is response position 4 + 2
    proc.update_state(
        BatchUpdate(
            batch_size=3,
            removed=[],
            moved=[],
            added=[(0, plain, None, []), (1, keyed, None, output), (2, greedy, None, [])],
        )
    )
    torch.manual_seed(0)
    logits = torch.randn(3, 500) * 3
    raw = logits.clone()
    out = proc.apply(logits)
    assert torch.equal(out[0], raw[0])  # not ours
    tok = sampling.sample(
        raw[1:2], seed=5, records=keys.records(1), positions=6, temperature=0.8, top_p=0.9
    ).item()
    assert out[1].argmax().item() == tok and torch.isinf(out[1]).sum() == 499
    assert math.isclose(out[1, tok].item(), (raw[1].double() / 0.8).log_softmax(-1)[tok].item(), abs_tol=1e-6)
    assert torch.allclose(out[2], raw[2].log_softmax(-1))  # greedy: its log-probs at T = 1

    # the keyed request moves to index 0, the others leave; its position follows its output list
    output.append(13)
    proc.update_state(
        BatchUpdate(batch_size=1, removed=[0, 2], moved=[(1, 0, Move.UNIDIRECTIONAL)], added=[])
    )
    out = proc.apply(raw[1:2].clone())
    tok = sampling.sample(
        raw[1:2], seed=5, records=keys.records(1), positions=7, temperature=0.8, top_p=0.9
    ).item()
    assert out[0].argmax().item() == tok and set(proc.rows) == {0}
