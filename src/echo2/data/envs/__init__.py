"""Multi-turn environments (paper Appendix F): the `Environment` seam and `EnvTask` (base.py), the
built-in environments (poker.py), and `make_env_task`, which reads `task.env`.

`task.env = "NAME:VARIANT?key=value&..."` names an environment; option values are read as TOML
(numbers, booleans) or else kept as strings. A bad name or option raises `ConfigError` naming
`task.env`. A new built-in environment is a module here and a branch below.
"""

from __future__ import annotations

import tomllib
from urllib.parse import parse_qsl

from echo2.config import ConfigError, EnvTaskConfig
from echo2.data.envs.base import EnvTask, is_env_task

__all__ = ["EnvTask", "is_env_task", "make_env_task", "parse_env_spec", "response_limit"]


def response_limit(config) -> int:
    """The most response tokens a record of this run may hold (the coordinator refuses more): an
    episode's response is every token after its first context, bounded by task.max_tokens."""
    if config.task.type == "env":
        return config.task.max_tokens
    return config.rollout.max_new_tokens


def parse_env_spec(spec: str) -> tuple[str, str, dict]:
    """ "poker:heads_up?opponent=random&stack_bb=20" -> ("poker", "heads_up", {...})."""
    head, _, query = spec.partition("?")
    name, _, variant = head.partition(":")
    options = {}
    for key, raw in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        try:
            options[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            options[key] = raw
    return name, variant, options


def make_env_task(config: EnvTaskConfig, *, seed: int) -> EnvTask:
    try:
        name, variant, options = parse_env_spec(config.env)
        if name == "poker":
            from echo2.data.envs.poker import make_poker

            factory = make_poker(variant, options, malformed_penalty=config.malformed_penalty)
        else:
            raise ValueError(f"unknown environment {name!r} (known: poker)")
    except ValueError as e:
        raise ConfigError(f"task.env: {e}") from None
    return EnvTask(factory, config, seed=seed)
