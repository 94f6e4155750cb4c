"""Verifiable sampling: Gumbel-max with keyed, counter-based noise that the learner can regenerate.

An engine samples token t at response position k of record r as the arg-max, over the truncated
set (temperature, then top-k, then top-p: the order of transformers' and vLLM's own processors),
of logits / T + g, where g = -log(-log u) and u is a keyed hash of (seed, record, position, token id)
(Gumbel-max: the arg-max follows softmax(logits / T) over the set). The seed is the lease's (the
coordinator's one noise seed, coordinator/leases.py: `Leases.noise_seed`), the record key is derived
from the leased group's id and the sample's index in its group (`record_key`), so a worker cannot
choose its noise, nor draw it again by leasing the prompt again. The learner, which recomputes the
logits anyway, recomputes the scores and checks that every sampled token is the arg-max within
`TOLERANCE` (`check`): a chosen response (a payload, hindsight-optimal play) fails at the first
token where it departs from what the noise picks.

Noise: a 32-bit integer hash (lowbias32 rounds) evaluated with int64 torch ops, every product kept
below 2^63 (`_mul32`) and every result masked to 32 bits, so there is no signed overflow and the
uniforms are bit-identical on every device. u = (h + 1/2) / 2^32 in (0, 1), and g is computed in
float64: in float32, u's largest values round to 1 (g = inf) and the largest Gumbels, the ones
that decide the arg-max, keep only ~7 digits and differ between CPU and CUDA `log` by ulps; in
float64 they differ by ~1e-16, far below any logit disagreement. Scores are float64 too.

Pure: torch only. Knows nothing of models, engines, records or the network.

Shapes: B rows (records, or sequences being generated), V vocabulary, K response positions.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF
DOMAIN = 0x3C6EF372
"""Starting state of the hash (a constant so that an all-zero key does not hash to zero)."""
TOLERANCE = 0.5
"""Largest margin (arg-max score - the sampled token's score, in units of logits / T) a sampled
token may have and still count as the arg-max: the engine's and the learner's logits differ (bf16
vs fp32), never the noise. A bf16 HF engine's margins against the fp32 learner reached 0.33 over
15,209 tokens; at 0.5, a worker can pick another token than the arg-max at 24% of positions (at 1.0,
43%): docs/security.md, verifiable sampling, with the commands."""
FP32_TOLERANCE = 0.01
"""`TOLERANCE` for engines that run fp32 snapshots: fp32 engines' margins against the fp32 learner
stay under 1e-4 (HF and vLLM on SmolLM2-135M: 0; docs/security.md), and 0.01 leaves a worker
another token at few positions (bench/gumbel_steering.py)."""


def default_tolerance(snapshot_dtype: str) -> float:
    """The check's tolerance when rollout.sampling_tolerance is unset: engines run the snapshots'
    dtype (learner.dtype, resolved: "fp32" or "bf16")."""
    return FP32_TOLERANCE if snapshot_dtype == "fp32" else TOLERANCE


SEED_KEY = "lease_seed"
"""Record metadata key of the lease's sampling seed: written by the coordinator when it accepts the
record (coordinator/leases.py), overwriting whatever the worker sent."""
SAMPLE_KEY = "sample"
"""Record metadata key of the record's index in its group (0 .. n-1, each once per group): with the
group id, its record key."""
MASS_SLACK = 1e-3
"""A sampled token is inside the top-p set when the probability of the tokens above it is below
top_p + MASS_SLACK (the engine's and the learner's sets may disagree at the boundary)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingKeys:
    """Where a generation call's noise comes from: the lease's seed and each context's group id
    (sample j of context i is keyed by `record_key(groups[i], j)`). A multi-turn episode's call
    (rollout/episodes.py, n = 1) names each context's sample index in its group (`samples`) and
    the response position its first generated token takes in the record (`offsets`: the replies
    and env tokens before it), so a reply is keyed as the learner sees it in the whole record."""

    seed: int
    groups: tuple[str, ...]
    samples: tuple[int, ...] = ()
    """Each context's index in its group (empty: context i's n samples are 0 .. n-1)."""
    offsets: tuple[int, ...] = ()
    """Each context's first generated token's response position (empty: 0)."""

    def records(self, n: int) -> torch.Tensor:
        """Record keys [len(groups) * n], in the engines' row order (context i's n samples together)."""
        if self.samples:
            if n != 1 or len(self.samples) != len(self.groups):
                raise ValueError("keys with sample indices key one sample per context")
            return torch.tensor(
                [record_key(g, j) for g, j in zip(self.groups, self.samples, strict=True)], dtype=torch.long
            )
        return torch.tensor([record_key(g, j) for g in self.groups for j in range(n)], dtype=torch.long)

    def starts(self, n: int) -> torch.Tensor:
        """Response position [len(groups) * n] of each row's first generated token."""
        if not self.offsets:
            return torch.zeros(len(self.groups) * n, dtype=torch.long)
        if len(self.offsets) != len(self.groups):
            raise ValueError(f"{len(self.offsets)} offsets for {len(self.groups)} contexts")
        return torch.tensor(self.offsets, dtype=torch.long).repeat_interleave(n)


def record_key(group_id: str, sample: int) -> int:
    """A 63-bit key for sample `sample` of group `group_id` (stable across processes and machines)."""
    digest = hashlib.blake2b(f"{group_id}\x00{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32): c split in 16-bit halves, so no product reaches 2^49."""
    lo, hi = c & 0xFFFF, c >> 16
    high = (x * hi).bitwise_and_(0xFFFF).mul_(1 << 16)
    return high.add_(x * lo).bitwise_and_(MASK32)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """x >> n for x >= 0, as a floor division: torch's int64 `>>` is ~10x slower on the CPU."""
    return torch.div(x, 1 << n, rounding_mode="floor")


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (a bijection on 32-bit words with strong avalanche)."""
    x = x ^ _shr(x, 16)
    x = _mul32(x, 0x7FEB352D)
    x.bitwise_xor_(_shr(x, 15))
    x = _mul32(x, 0x846CA68B)
    return x.bitwise_xor_(_shr(x, 16))


def _absorb(h: torch.Tensor, word: torch.Tensor | int) -> torch.Tensor:
    """Mix one 64-bit word (non-negative) into the state, low half then high half."""
    h = _mix(h ^ (word & MASK32))
    return _mix(h ^ (_shr(word, 32) & MASK32))


def row_state(seed: torch.Tensor | int, records: torch.Tensor, positions: torch.Tensor | int) -> torch.Tensor:
    """The hash state [B] after (seed [B] or one int, records [B], positions [B] or one int), on
    `records`' device. Seeds and record keys are non-negative 63-bit integers."""
    device = records.device
    if isinstance(seed, int) and not 0 <= seed < 2**63:
        raise ValueError(f"seed {seed} is not a non-negative 63-bit integer")
    h = torch.full(records.shape, DOMAIN, dtype=torch.long, device=device)
    h = _absorb(h, torch.as_tensor(seed, dtype=torch.long, device=device))
    h = _absorb(h, records.long())
    return _absorb(h, torch.as_tensor(positions, dtype=torch.long, device=device))


def token_uniforms(state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """u in (0, 1), float64, of `tokens` under `state` (broadcast together): one round, the state
    is already mixed; bit-identical on every device."""
    x = _mix(state ^ tokens)
    return x.double().add_(0.5).mul_(2.0**-32)


def uniforms(
    seed: torch.Tensor | int, records: torch.Tensor, positions: torch.Tensor | int, vocab_size: int
) -> torch.Tensor:
    """u [B, V] float64 in (0, 1), keyed by (seed, records [B], positions, token id)."""
    h = row_state(seed, records, positions)
    return token_uniforms(h[:, None], torch.arange(vocab_size, dtype=torch.long, device=h.device)[None, :])


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    return u.log_().neg_().log_().neg_()


def gumbels(
    seed: torch.Tensor | int, records: torch.Tensor, positions: torch.Tensor | int, vocab_size: int
) -> torch.Tensor:
    """g = -log(-log u) [B, V] float64."""
    return _gumbel(uniforms(seed, records, positions, vocab_size))


GUMBEL_MAX = -math.log(-math.log((MASK32 + 0.5) * 2.0**-32))
"""The largest g the noise can take (u's largest value): about 22.87."""


def truncate(logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits / T [B, V] float64 with -inf outside the kept set: top-k (ties at the k-th value
    kept, as vLLM does; 0 = off), then top-p (a token is kept while the probability of the tokens
    sorted above it is below top_p, as transformers' and vLLM's `cumsum <= 1 - p` removal; at least
    one is kept)."""
    scaled = logits.double() / temperature
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    if top_p < 1.0:
        scaled = scaled.masked_fill(~_nucleus(scaled, top_p), -math.inf)
    return scaled


def _nucleus(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """[B, V] bool: the tokens the probability above which (in descending order) is < top_p."""
    return _nuclei(scaled, top_p)[0]


def _nuclei(scaled: torch.Tensor, *top_ps: float) -> list[torch.Tensor]:
    """`_nucleus` of each of `top_ps`, from one sort (the check's cost at top_p < 1)."""
    sorted_, order = scaled.sort(dim=-1, descending=True)
    probs = sorted_.softmax(dim=-1)
    above = probs.cumsum(dim=-1) - probs
    out = []
    for top_p in top_ps:
        keep_sorted = above < top_p
        keep_sorted[..., 0] = True
        out.append(torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted))
    return out


def scores(
    logits: torch.Tensor,
    *,
    seed: torch.Tensor | int,
    records: torch.Tensor,
    positions: torch.Tensor | int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Truncated logits / T + keyed Gumbel noise [B, V] float64; the sample is its arg-max."""
    g = gumbels(seed, records.to(logits.device), positions, logits.shape[-1])
    return truncate(logits, temperature=temperature, top_k=top_k, top_p=top_p) + g


def sample(logits: torch.Tensor, **keys) -> torch.Tensor:
    """Token ids [B]: the arg-max of `scores(logits, **keys)`."""
    return scores(logits, **keys).argmax(dim=-1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    margins: torch.Tensor
    """[B, K] float64: arg-max score - the sampled token's score (0 for the arg-max itself; inf for a
    token outside the truncated set; 0 where the mask is 0)."""
    ok: torch.Tensor
    """[B] bool: every checked token's margin is within the tolerance."""


@torch.no_grad()
def check(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    *,
    starts: torch.Tensor | None = None,
    seed: torch.Tensor | list[int],
    records: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    tolerance: float = TOLERANCE,
    mass_slack: float = MASS_SLACK,
) -> Verdict:
    """Were `tokens` [B, K] sampled with this noise from these `logits` [B, K, V] (recomputed: the
    logits that predict each token)? Column k of row b is response position k - starts[b] (`starts`
    [B]: where each row's response begins, 0 by default), keyed by (seed[b], records[b], that
    position); only positions where `mask` [B, K] is nonzero are checked. A token outside the truncated set
    (top-p measured with `mass_slack`) fails whatever its score."""
    num_rows, num_pos, vocab = logits.shape
    device = logits.device
    seeds = torch.as_tensor(seed, dtype=torch.long, device=device)
    records, tokens = records.to(device).long(), tokens.to(device).long()
    starts = torch.zeros(num_rows, dtype=torch.long) if starts is None else starts.long()
    starts = starts.to(device)
    margins = torch.zeros(num_rows, num_pos, dtype=torch.float64, device=device)
    checked = mask.to(device) != 0
    for k in range(num_pos):
        rows = checked[:, k].nonzero().flatten()
        if rows.numel() == 0:
            continue
        loose = truncate(logits[rows, k], temperature=temperature, top_k=top_k)  # [b, V]
        inside = torch.isfinite(loose)
        strict = loose
        if top_p < 1.0:
            wide, kept = _nuclei(loose, min(1.0, top_p + mass_slack), top_p)
            inside &= wide
            strict = loose.masked_fill(~kept, -math.inf)
        state = row_state(seeds[rows], records[rows], k - starts[rows])  # [b]
        tok = tokens[rows, k]
        valid = (tok >= 0) & (tok < vocab)
        tok = tok.clamp(0, vocab - 1)
        valid &= inside.gather(1, tok[:, None]).squeeze(1)
        chosen = loose.gather(1, tok[:, None]).squeeze(1) + _gumbel(token_uniforms(state, tok))
        # Only a token whose score could pass the chosen one's needs its noise: strict + GUMBEL_MAX
        # >= chosen (exact: no other token's score can exceed the chosen one's).
        floor = torch.where(torch.isfinite(chosen), chosen - GUMBEL_MAX - 1e-9, math.inf)
        row, cand = (strict >= floor[:, None]).nonzero(as_tuple=True)
        score = strict[row, cand] + _gumbel(token_uniforms(state[row], cand))
        best = torch.full_like(chosen, -math.inf).scatter_reduce(0, row, score, reduce="amax")
        margin = (best - chosen).clamp(min=0).nan_to_num(nan=math.inf)
        margins[rows, k] = torch.where(
            valid & torch.isfinite(chosen), margin, torch.full_like(margin, math.inf)
        )
    return Verdict(margins=margins, ok=(margins <= tolerance).all(dim=1))
