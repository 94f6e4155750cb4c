"""Verifiable sampling with the vLLM engine (issue 22, case 4): SmolLM2-135M in vLLM (fp32, CPU or
GPU) samples by keyed Gumbel-max through echo2's logits processor (rollout/vllm_sampling.py); the
fp32 learner's check (learning/verify.py SamplingCheck) refuses none of its records, refuses one
with a token changed by hand, and the behaviour log-probs are the learner's at T, at any top_p.
Skipped where vllm is not installed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("vllm")

from echo2.config import ArithmeticTaskConfig, GGUFModelConfig, RolloutConfig  # noqa: E402
from echo2.data.tasks import make_task  # noqa: E402
from echo2.data.tasks.base import to_tensors  # noqa: E402
from echo2.learning.step import response_logits  # noqa: E402
from echo2.learning.verify import SamplingCheck  # noqa: E402
from echo2.models import load_model, load_tokenizer, token_logprobs  # noqa: E402
from echo2.rollout import sampling  # noqa: E402
from echo2.rollout.collect import collect  # noqa: E402
from echo2.rollout.sampling import SamplingKeys  # noqa: E402
from echo2.rollout.vllm_engine import VLLMEngine  # noqa: E402

SEED = 1234
LOGPROB_TOL = 5e-3
"""As tests/e2e/test_vllm_engine.py: |log ratio| per token, vLLM fp32 against the learner's fp32."""
MARGIN_TOL = 1e-3
"""Largest margin of an fp32 vLLM token against the fp32 learner (TOLERANCE is 0.5, for bf16)."""


def _config(**kw) -> RolloutConfig:
    cfg = RolloutConfig(group_size=4, max_new_tokens=8, temperature=0.8, sampling="gumbel", **kw)
    return cfg.model_copy(update={"engine": "vllm"})


@pytest.fixture(scope="module")
def smol():
    """(vLLM gumbel engine, fp32 HF model, tokenizer), one engine for the module."""
    mcfg = GGUFModelConfig()
    tok = load_tokenizer(mcfg)
    model = load_model(mcfg, vocab_size=len(tok), seed=0).eval()
    from echo2.models import gguf_model_dir

    engine = VLLMEngine(gguf_model_dir(mcfg.file, mcfg.cache_dir), tok, _config(), seed=0)
    return engine, model, tok


@pytest.fixture(scope="module")
def prompts():
    task = make_task(ArithmeticTaskConfig(), seed=0)
    return task, [task.train_prompt(i) for i in range(3)]


def _check(model, tok, cfg, groups, *, episodes: bool = False) -> tuple[SamplingCheck, list[str]]:
    """The learner's check over `groups` (one call per group, as the step batches them)."""
    check = SamplingCheck(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        group_size=cfg.group_size,
        max_new_tokens=cfg.max_new_tokens,
        eos_id=tok.eos_token_id,
        episodes=episodes,
    )
    refused = []
    for group in groups:
        batch = to_tensors(group, pad_id=tok.pad_token_id, advantages=[0.0] * len(group))
        with torch.no_grad():
            logits = response_logits(model, batch)
        bad = check.unsampled(logits, batch.targets, group, check.bad_keys([group]))
        refused += [r.record_id for r, b in zip(group, bad.tolist(), strict=True) if b]
        # the behaviour log-probs are the learner's at T (no renormalisation over the top-p set)
        lp = token_logprobs(logits, batch.targets, temperature=cfg.temperature)
        diff = ((lp - batch.behaviour_logprobs) * batch.loss_mask).abs().max().item()
        assert diff < LOGPROB_TOL, diff
    return check, refused


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_vllm_gumbel_records_pass_the_learners_check_and_a_changed_token_is_refused(smol, prompts, top_p):
    engine, model, tok = smol
    task, ps = prompts
    engine.config = cfg = _config(top_p=top_p)  # T and top_p travel in each request's keys
    groups = collect(engine, task, ps, n=cfg.group_size, sampling_seed=SEED)
    assert all(r.metadata[sampling.SEED_KEY] == SEED for g in groups for r in g)
    assert all(len({r.response_ids for r in g}) > 1 for g in groups), "each sample has its own noise"
    check, refused = _check(model, tok, cfg, groups)
    assert refused == []
    assert check.tokens == sum(len(r.response_ids) for g in groups for r in g) and check.tokens > 30
    assert check.margin_max < MARGIN_TOL

    victim = next(r for r in groups[0] if len(r.response_ids) > 2)
    ids = list(victim.response_ids)
    ids[1] = (ids[1] + 1) % model.config.vocab_size  # one token changed by hand
    forged = dataclasses.replace(victim, response_ids=tuple(ids))
    forged_groups = [[forged if r is victim else r for r in groups[0]]]
    check = SamplingCheck(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        group_size=cfg.group_size,
        max_new_tokens=cfg.max_new_tokens,
        eos_id=tok.eos_token_id,
    )
    batch = to_tensors(forged_groups[0], pad_id=tok.pad_token_id, advantages=[0.0] * len(forged_groups[0]))
    with torch.no_grad():
        logits = response_logits(model, batch)
    bad = check.unsampled(logits, batch.targets, forged_groups[0], set())
    assert [r.record_id for r, b in zip(forged_groups[0], bad.tolist(), strict=True) if b] == [
        forged.record_id
    ]


def test_the_same_keys_give_the_same_tokens(smol, prompts):
    engine, _, _ = smol
    _, ps = prompts
    engine.config = _config()
    keys = SamplingKeys(seed=SEED, groups=tuple(p.group_id for p in ps[:2]))
    torch.manual_seed(0)
    first = engine.generate(ps[:2], n=3, keys=keys)
    torch.manual_seed(1)  # torch's generator plays no part
    assert engine.generate(ps[:2], n=3, keys=keys) == first
    other = engine.generate(ps[:2], n=3, keys=SamplingKeys(seed=SEED + 1, groups=keys.groups))
    assert [[s.response_ids for s in g] for g in other] != [[s.response_ids for s in g] for g in first]


def test_keys_with_sample_indices_and_offsets_match_the_reference_sampler(smol):
    """A multi-turn reply (rollout/episodes.py: n = 1, the sample's index, the response position of
    its first token): each token is `sampling.sample` of the fp32 logits at offset + k."""
    engine, model, tok = smol
    engine.config = cfg = _config()
    encoded = [[1, 22, 333, 4444], [5, 66, 777]]
    keys = SamplingKeys(seed=SEED, groups=("a", "b"), samples=(2, 0), offsets=(7, 3))
    out = engine.generate_ids(encoded, n=1, keys=keys)
    for ids, (s,), record, offset in zip(encoded, out, keys.records(1), keys.offsets, strict=True):
        full = torch.tensor([ids + list(s.response_ids)])
        with torch.no_grad():
            logits = model(input_ids=full).logits[0, len(ids) - 1 : -1]
        expected = sampling.sample(
            logits,
            seed=SEED,
            records=record.repeat(len(s.response_ids)),
            positions=torch.arange(len(s.response_ids)) + offset,
            temperature=cfg.temperature,
        )
        assert list(s.response_ids) == expected.tolist()


def test_greedy_calls_report_temperature_one_logprobs(smol, prompts):
    engine, model, tok = smol
    _, ps = prompts
    engine.config = _config()
    (s,), *_ = engine.generate(ps[:1], n=1, greedy=True)
    full = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
    with torch.no_grad():
        logits = model(input_ids=full).logits[:, len(s.prompt_ids) - 1 : -1]
    targets = torch.tensor([s.response_ids])
    assert torch.equal(logits.argmax(-1), targets)
    assert torch.allclose(token_logprobs(logits, targets)[0], torch.tensor(s.logprobs), atol=LOGPROB_TOL)
