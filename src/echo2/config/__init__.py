"""Run configuration: one TOML file, validated by pydantic, overridable by `--section.key=value`.

schema.py owns the learner's, rollout's and run's sections and the rules between fields; the
model and task sections are in workload.py, the coordinator's, scheduler's and broadcast's in
fleet.py. files.py reads TOML files and command-line overrides and writes the resolved config. Imports no torch, so `echo2 run --dry-run`
and `--help` stay instant. A user mistake raises `ConfigError` whose message names the dotted key;
the CLI turns it into exit status 2 before anything starts.
"""

from echo2.config.base import ConfigError
from echo2.config.files import (
    build_config,
    dump_toml,
    load_config,
    parse_overrides,
    read_toml,
    set_dotted,
    validation_message,
)
from echo2.config.fleet import (
    SLOW_RELAY_FRACTION,
    BroadcastConfig,
    CoordinatorConfig,
    SchedulerConfig,
    SkyPilotConfig,
    SkyPilotWorkerConfig,
)
from echo2.config.schema import (
    Config,
    LearnerConfig,
    LoraConfig,
    RolloutConfig,
    RunConfig,
    ServerConfig,
    VLLMConfig,
    check_kappa,
    publish_every,
)
from echo2.config.workload import (
    ArithmeticTaskConfig,
    CustomTaskConfig,
    EnvTaskConfig,
    GGUFModelConfig,
    HFModelConfig,
    MathTaskConfig,
    ModelConfig,
    TaskConfig,
    TinyModelConfig,
)

__all__ = [
    "SLOW_RELAY_FRACTION",
    "ArithmeticTaskConfig",
    "BroadcastConfig",
    "Config",
    "ConfigError",
    "CoordinatorConfig",
    "CustomTaskConfig",
    "EnvTaskConfig",
    "GGUFModelConfig",
    "HFModelConfig",
    "LearnerConfig",
    "LoraConfig",
    "MathTaskConfig",
    "ModelConfig",
    "RolloutConfig",
    "ServerConfig",
    "RunConfig",
    "SchedulerConfig",
    "SkyPilotConfig",
    "SkyPilotWorkerConfig",
    "TaskConfig",
    "TinyModelConfig",
    "VLLMConfig",
    "build_config",
    "check_kappa",
    "dump_toml",
    "load_config",
    "parse_overrides",
    "publish_every",
    "read_toml",
    "set_dotted",
    "validation_message",
]
