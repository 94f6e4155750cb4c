"""Verifiable sampling (rollout/sampling.py): the keyed noise, Gumbel-max's distribution, the
truncation order, the check, and the HF engine sampling that way."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from echo2.rollout import sampling
from echo2.rollout.sampling import SamplingKeys, record_key


def test_uniforms_are_keyed_deterministic_and_in_the_open_interval():
    records = torch.arange(64)
    u = sampling.uniforms(7, records, 3, 1000)
    assert u.dtype == torch.float64 and u.shape == (64, 1000)
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert torch.equal(u, sampling.uniforms(7, records, 3, 1000))  # same key, same bits
    for other in (
        sampling.uniforms(8, records, 3, 1000),
        sampling.uniforms(7, records + 1, 3, 1000),
        sampling.uniforms(7, records, 4, 1000),
    ):
        assert (other == u).float().mean() < 1e-3
    # a per-row seed tensor gives each row what its own int seed gives it
    seeds = torch.tensor([7, 9] * 32)
    mixed = sampling.uniforms(seeds, records, 3, 1000)
    assert torch.equal(mixed[::2], u[::2]) and torch.equal(
        mixed[1::2], sampling.uniforms(9, records, 3, 1000)[1::2]
    )


def test_uniforms_are_uniform():
    """20-bin chi-square over 400,000 draws (19 dof: p = 0.001 at 43.8)."""
    u = sampling.uniforms(11, torch.zeros(400, dtype=torch.long), torch.arange(400), 1000).flatten()
    counts = torch.histc(u.float(), bins=20, min=0, max=1).double()
    expected = u.numel() / 20
    assert float(((counts - expected) ** 2 / expected).sum()) < 43.8


def test_known_values_pin_the_hash():
    """The same bits on every device and release: a change of the hash breaks every lease's check."""
    h = (sampling.uniforms(42, torch.tensor([5]), 2, 4) * 2**32 - 0.5).long().tolist()
    assert h == [[3400107738, 2582256960, 251250859, 749767387]]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gumbel_max_draws_follow_the_softmax(temperature):
    """40,000 draws over 6 tokens: chi-square (5 dof) under 20.5 (p = 0.001); a uniform sampler gives
    thousands, so the test cannot pass one."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
    n = 40_000
    tokens = sampling.sample(
        logits.expand(n, -1), seed=5, records=torch.arange(n), positions=0, temperature=temperature
    )
    counts = torch.bincount(tokens, minlength=6).double()
    probs = (logits.double() / temperature).softmax(-1)
    assert _chi_square(counts, probs) < 20.5
    uniform = torch.full((6,), n / 6.0)
    assert _chi_square(uniform, probs) > 1000  # what a uniform sampler would score
    again = sampling.sample(
        logits.expand(n, -1), seed=5, records=torch.arange(n), positions=0, temperature=temperature
    )
    assert torch.equal(tokens, again)


def test_top_p_draws_follow_the_renormalised_nucleus():
    logits = torch.tensor([2.0, 1.5, 1.0, -1.0, -2.0, -3.0])
    probs = logits.double().softmax(-1)  # 0.48 0.29 0.18 ...: top_p 0.9 keeps the first three
    n = 30_000
    tokens = sampling.sample(
        logits.expand(n, -1), seed=1, records=torch.arange(n), positions=0, temperature=1.0, top_p=0.9
    )
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[3:].sum() == 0
    kept = probs[:3] / probs[:3].sum()
    assert _chi_square(counts[:3], kept) < 13.8  # 2 dof, p = 0.001


def test_truncation_is_temperature_then_top_k_then_top_p():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    # at T = 0.5 the top two carry 0.98 of the mass: top_p 0.9 keeps two (at T = 1 it would keep three)
    kept = torch.isfinite(sampling.truncate(logits, temperature=0.5, top_p=0.9))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(sampling.truncate(logits, temperature=1.0, top_p=0.9))
    assert kept.tolist() == [[True, True, True, False]]
    kept = torch.isfinite(sampling.truncate(logits, temperature=1.0, top_k=1, top_p=0.99))
    assert kept.tolist() == [[True, False, False, False]]


def test_truncation_matches_transformers_processors():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(0)
    logits = torch.randn(16, 500) * 3
    for temperature, top_k, top_p in [(0.7, 0, 0.9), (1.0, 50, 0.8), (1.3, 10, 1.0)]:
        hf = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            hf = TopKLogitsWarper(top_k)(None, hf)
        if top_p < 1:
            hf = TopPLogitsWarper(top_p)(None, hf)
        ours = sampling.truncate(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        assert torch.equal(torch.isfinite(hf), torch.isfinite(ours))


def test_check_passes_the_sampled_tokens_and_fails_others():
    torch.manual_seed(0)
    logits = torch.randn(8, 5, 300) * 2  # [B, K, V]
    records = torch.arange(8) * 1000
    tokens = torch.stack(
        [
            sampling.sample(logits[:, k], seed=3, records=records, positions=k, temperature=0.8)
            for k in range(5)
        ],
        dim=1,
    )
    ones = torch.ones(8, 5)
    verdict = sampling.check(logits, tokens, ones, seed=[3] * 8, records=records, temperature=0.8)
    assert bool(verdict.ok.all()) and float(verdict.margins.max()) == 0.0
    wrong_seed = sampling.check(logits, tokens, ones, seed=[4] * 8, records=records, temperature=0.8)
    assert not bool(wrong_seed.ok.any())
    chosen = tokens.clone()
    chosen[2, 3] = (tokens[2, 3] + 1) % 300  # one token changed
    verdict = sampling.check(logits, chosen, ones, seed=[3] * 8, records=records, temperature=0.8)
    assert verdict.ok.tolist() == [True, True, False, True, True, True, True, True]
    assert verdict.margins[2, 3] > 0 and float(verdict.margins[2, :3].max()) == 0.0
    # right-aligned rows (starts): the same tokens shifted right one column still pass
    shifted = torch.cat([torch.zeros(8, 1, 300), logits], dim=1)
    tok_shift = torch.cat([torch.zeros(8, 1, dtype=torch.long), tokens], dim=1)
    mask = torch.cat([torch.zeros(8, 1), ones], dim=1)
    verdict = sampling.check(
        shifted,
        tok_shift,
        mask,
        starts=torch.ones(8, dtype=torch.long),
        seed=[3] * 8,
        records=records,
        temperature=0.8,
    )
    assert bool(verdict.ok.all())


def test_a_token_outside_the_nucleus_fails_whatever_its_score():
    logits = torch.tensor([[[5.0, 4.0, -5.0, -6.0]]])
    verdict = sampling.check(
        logits,
        torch.tensor([[3]]),
        torch.ones(1, 1),
        seed=[1],
        records=torch.tensor([0]),
        temperature=1.0,
        top_p=0.9,
        tolerance=1e9,
    )
    assert math.isinf(float(verdict.margins[0, 0])) and not bool(verdict.ok[0])


def test_record_keys_are_stable_and_distinct():
    assert record_key("g1", 0) == record_key("g1", 0) and 0 <= record_key("g1", 0) < 2**63
    assert len({record_key(g, j) for g in ("a", "b", "ab") for j in range(8)}) == 24
    keys = SamplingKeys(seed=1, groups=("a", "b"))
    assert keys.records(2).tolist() == [
        record_key("a", 0),
        record_key("a", 1),
        record_key("b", 0),
        record_key("b", 1),
    ]


# ---------------------------------------------------------------------------- the HF engine
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_hf_engine_gumbel_samples_pass_the_check_and_repeat(tiny, top_p):
    from echo2.config import RolloutConfig
    from echo2.models import token_logprobs
    from echo2.rollout.engine import HFEngine

    model, tok = tiny
    cfg = RolloutConfig(group_size=3, max_new_tokens=6, temperature=0.9, top_p=top_p, sampling="gumbel")
    engine = HFEngine(copy.deepcopy(model), tok, cfg)
    encoded = [[1, 2, 3, 4], [5, 6, 7]]
    keys = SamplingKeys(seed=42, groups=("g0", "g1"))
    first = engine.generate_ids(encoded, n=3, keys=keys)
    assert first == engine.generate_ids(encoded, n=3, keys=keys)  # the key fixes the tokens
    other = engine.generate_ids(encoded, n=3, keys=SamplingKeys(seed=43, groups=("g0", "g1")))
    assert [[s.response_ids for s in g] for g in other] != [[s.response_ids for s in g] for g in first]
    for i, group in enumerate(first):
        assert len({s.response_ids for s in group}) > 1  # each sample has its own noise
        for j, s in enumerate(group):
            ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[:, len(s.prompt_ids) - 1 : -1]
            targets = torch.tensor([s.response_ids])
            verdict = sampling.check(
                logits,
                targets,
                torch.ones_like(targets),
                seed=[42],
                records=torch.tensor([record_key(keys.groups[i], j)]),
                temperature=0.9,
                top_p=top_p,
            )
            assert bool(verdict.ok.all()) and float(verdict.margins.max()) < 1e-4
            # the reported log-probs are still the raw logits' at T, not the noisy scores'
            lp = token_logprobs(logits, targets, temperature=0.9)[0]
            assert torch.allclose(lp, torch.tensor(s.logprobs), atol=1e-4)


def test_check_with_pruning_equals_the_whole_vocabulary():
    """The check computes noise only for tokens that could pass the chosen one (GUMBEL_MAX): its
    margins equal those over the whole vocabulary, for logits spread wider than GUMBEL_MAX."""
    torch.manual_seed(1)
    logits = torch.randn(4, 3, 2000) * 12
    records = torch.arange(4)
    tokens = torch.randint(0, 2000, (4, 3))
    tokens[0] = torch.stack(
        [
            sampling.sample(logits[:1, k], seed=2, records=records[:1], positions=k, temperature=0.8)
            for k in range(3)
        ],
        1,
    )[0]
    verdict = sampling.check(logits, tokens, torch.ones(4, 3), seed=[2] * 4, records=records, temperature=0.8)
    scores = torch.stack(
        [
            sampling.scores(logits[:, k], seed=2, records=records, positions=k, temperature=0.8)
            for k in range(3)
        ],
        1,
    )
    brute = (scores.max(-1).values - scores.gather(-1, tokens[..., None]).squeeze(-1)).clamp(min=0)
    assert torch.allclose(verdict.margins, brute)
    assert verdict.ok.tolist() == [True, False, False, False]


def test_gumbel_is_accepted_by_the_vllm_engine_and_lifts_its_top_p_limit():
    """vLLM samples by keyed Gumbel-max through echo2's processor (rollout/vllm_sampling.py), which
    reports the learner's log-probs at any T and top_p; vLLM's own sampler only at T = 1 with top_p < 1."""
    from pydantic import ValidationError

    from echo2.config import ConfigError, RolloutConfig
    from echo2.rollout import vllm_args

    config = RolloutConfig(engine="vllm", sampling="gumbel", temperature=0.8, top_p=0.9)
    vllm_args.check_sampling(config)
    with pytest.raises(ValidationError, match="rollout.top_p"):
        RolloutConfig(engine="vllm", sampling="multinomial", temperature=0.8, top_p=0.9)
    with pytest.raises(ConfigError, match="rollout.top_p"):
        vllm_args.check_sampling(RolloutConfig(temperature=0.8, top_p=0.9, sampling="multinomial"))
    assert RolloutConfig().sampling == "gumbel"  # verifiable by default (issue 41 item 2)


def test_the_check_tolerance_follows_the_snapshot_dtype_unless_set():
    """fp32 engines agree with the learner to 1e-4: 0.01 there; bf16 engines need 0.5."""
    from echo2.config import RolloutConfig
    from echo2.learning.verify import sampling_check

    def tol(dtype: str, **kw) -> float:
        return sampling_check(RolloutConfig(**kw), is_env=False, eos_id=1, snapshot_dtype=dtype).tolerance

    assert tol("fp32") == sampling.FP32_TOLERANCE == 0.01 and tol("bf16") == sampling.TOLERANCE == 0.5
    assert tol("fp32", sampling_tolerance=0.2) == 0.2 == tol("bf16", sampling_tolerance=0.2)
    assert sampling_check(RolloutConfig(sampling="multinomial"), is_env=False, eos_id=1) is None
