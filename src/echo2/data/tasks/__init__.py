"""Built-in tasks; `make_task` picks one from the config's `task.type`."""

from __future__ import annotations

from echo2.config import ArithmeticTask as ArithmeticConfig
from echo2.config import MathTask as MathConfig
from echo2.data.tasks.base import Task


def make_task(config: ArithmeticConfig | MathConfig, *, seed: int) -> Task:
    if config.type == "arithmetic":
        from echo2.data.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(config, seed=seed)
    elif config.type == "math":
        from echo2.data.tasks.math import MathTask

        return MathTask(config, seed=seed)
    raise AssertionError(config.type)
