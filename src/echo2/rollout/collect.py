"""The rollout step shared by the in-process source (learning/sources/local.py) and the workers (rollout/worker.py).

Generates n samples per prompt with an engine, scores each on this side with the task's reward, and
packs them into version-tagged trajectory records. Also scores held-out accuracy greedily.
"""

from __future__ import annotations

from echo2.data.tasks.base import Prompt, Task
from echo2.records import Trajectory
from echo2.rollout.engine import Engine, default_keys
from echo2.rollout.sampling import SAMPLE_KEY, SEED_KEY, SamplingKeys


def rollout_seed(run_seed: int, first_index: int) -> int:
    """Sampling seed of a batch of prompts: a function of the run seed and the first prompt index,
    so in-process and remote rollouts of the same prompts under the same weights sample alike."""
    return run_seed * 1_000_003 + first_index


def collect(
    engine: Engine, task: Task, prompts: list[Prompt], *, n: int, sampling_seed: int | None = None
) -> list[list[Trajectory]]:
    """One group of n scored records per prompt, tagged with the engine's installed version. An
    environment task plays n whole episodes per prompt instead (rollout/episodes.py).
    `sampling_seed`: the lease's, keying the noise under rollout.sampling = "gumbel" (None: one
    from torch's generator; an episode's replies are keyed by their positions in its record,
    rollout/episodes.py). Each record carries its index in its group (`SAMPLE_KEY`), which with
    its group id keys its noise, and the seed (`SEED_KEY`; the coordinator replaces it with its
    lease's, rollout/sampling.py)."""
    if (
        sampling_seed is None
        and getattr(engine, "config", None) is not None
        and engine.config.sampling == "gumbel"
    ):
        sampling_seed = default_keys([]).seed  # no lease (the in-process loop): torch's generator
    if getattr(task, "is_env", False):
        from echo2.rollout.episodes import collect_episodes

        return collect_episodes(engine, task, prompts, n=n, config=engine.config, sampling_seed=sampling_seed)
    version = engine.version
    groups = []
    if sampling_seed is None:
        generated = engine.generate(prompts, n=n)
    else:
        keys = SamplingKeys(seed=sampling_seed, groups=tuple(p.group_id for p in prompts))
        generated = engine.generate(prompts, n=n, keys=keys)
    sampled = {} if sampling_seed is None else {SEED_KEY: sampling_seed}  # a coordinator overwrites it
    for prompt, samples in zip(prompts, generated, strict=True):
        group = []
        for j, s in enumerate(samples):
            score = task.score(prompt, s.text)
            group.append(
                Trajectory(
                    group_id=prompt.group_id,
                    prompt_ids=s.prompt_ids,
                    response_ids=s.response_ids,
                    behaviour_logprobs=s.logprobs,
                    loss_mask=task.loss_mask(s.response_ids),
                    reward=score.reward,
                    version=version,
                    metadata={
                        "correct": score.correct,
                        "parsed": score.parsed,
                        "answer": prompt.answer,
                        SAMPLE_KEY: j,
                        **sampled,
                    },
                )
            )
        groups.append(group)
    return groups


def evaluate(engine: Engine, task: Task, prompts: list[Prompt], *, batch_size: int) -> dict[str, float]:
    """Greedy accuracy and mean response length on held-out prompts (an environment task: greedy
    episodes, rollout/episodes.py)."""
    if getattr(task, "is_env", False):
        from echo2.rollout.episodes import evaluate_episodes

        return evaluate_episodes(engine, task, prompts, batch_size=batch_size, config=engine.config)
    correct, lengths = 0, 0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        for prompt, (sample,) in zip(chunk, engine.generate(chunk, n=1, greedy=True), strict=True):
            correct += task.score(prompt, sample.text).correct
            lengths += len(sample.response_ids)
    count = max(1, len(prompts))
    return {
        "eval/accuracy": correct / count,
        "eval/response_tokens": lengths / count,
        "eval/count": len(prompts),
    }
