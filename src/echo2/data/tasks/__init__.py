"""Built-in tasks; `make_task` picks one from the config's `task.type`."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from echo2.config import ArithmeticTaskConfig, ConfigError, CustomTaskConfig, EnvTaskConfig, MathTaskConfig
from echo2.data.tasks.base import Task


def make_task(
    config: ArithmeticTaskConfig | MathTaskConfig | CustomTaskConfig | EnvTaskConfig, *, seed: int
) -> Task:
    if config.type == "arithmetic":
        from echo2.data.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(config, seed=seed)
    elif config.type == "math":
        from echo2.data.tasks.math import MathTask

        return MathTask(config, seed=seed)
    elif config.type == "custom":
        module, _, name = config.factory.partition(":")
        for folder in reversed(config.pythonpath):  # the config file's directory, then the environment
            if Path(folder).is_dir() and folder not in sys.path:
                sys.path.insert(0, folder)
        try:
            factory = importlib.import_module(module)
            for part in name.split("."):
                factory = getattr(factory, part)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"task.factory: cannot load {config.factory!r}: {e}") from None
        return factory(seed=seed, **config.options)
    elif config.type == "env":
        from echo2.data.envs import make_env_task

        return make_env_task(config, seed=seed)
    raise AssertionError(config.type)
