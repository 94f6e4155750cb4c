"""model.chat_template_kwargs: passed to every chat-template call, so a Qwen3-shaped template's
`enable_thinking = false` reaches the prompt ids, and the learner's referee and a worker (each
loading its own tokenizer from the model section) encode a leased prompt to the same ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from echo2.config import ConfigError, TinyModelConfig
from echo2.config.files import build_config, dump_toml
from echo2.data.tasks import make_task
from echo2.data.tasks.base import Prompt
from echo2.models import load_tokenizer
from echo2.rollout.engine import encode_prompt, encode_prompts

DAPO_SAMPLE = Path(__file__).parents[2] / "configs" / "data" / "dapo-math-sample.jsonl"

# Shaped like Qwen3's template (its generation-prompt branch, verbatim in structure).
QWEN3_SHAPED = r"""{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

PROMPT = Prompt(group_id="g", messages=({"role": "user", "content": "What is 2 + 2?"},), answer="4")


def qwen3_tokenizer(**kwargs):
    tok = load_tokenizer(TinyModelConfig(chat_template_kwargs=kwargs))
    tok.chat_template = QWEN3_SHAPED
    return tok


def test_enable_thinking_false_reaches_the_prompt_ids():
    plain, off = qwen3_tokenizer(), qwen3_tokenizer(enable_thinking=False)
    with_kwarg, without = encode_prompt(off, PROMPT), encode_prompt(plain, PROMPT)
    assert with_kwarg != without
    think = plain("<think>\n\n</think>\n\n", add_special_tokens=False).input_ids
    assert with_kwarg == without + think, "the empty think block opens the reply, nothing else changes"
    assert encode_prompt(qwen3_tokenizer(enable_thinking=True), PROMPT) == without


def test_a_tokenizer_without_a_template_ignores_them():
    tok = qwen3_tokenizer(enable_thinking=False)
    tok.chat_template = None
    assert encode_prompt(tok, PROMPT) == tok("What is 2 + 2?\n", add_special_tokens=False).input_ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tokenize": True}, "model.chat_template_kwargs.tokenize: a name apply_chat_template takes itself"),
        ({"messages": "x"}, "model.chat_template_kwargs.messages: a name apply_chat_template takes itself"),
        ({"not a name": 1}, "model.chat_template_kwargs.not a name: not a name"),
        ({"enable_thinking": [1]}, "model.chat_template_kwargs.enable_thinking"),
    ],
)
def test_bad_kwargs_name_the_key(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        build_config({"model": {"type": "tiny", "chat_template_kwargs": kwargs}})


def test_the_kwargs_keep_their_types_through_config_toml():
    kwargs = {"enable_thinking": False, "style": "short", "depth": 2, "temperature_hint": 0.5}
    config = build_config({"model": {"type": "tiny", "chat_template_kwargs": kwargs}})
    import tomllib

    again = build_config(tomllib.loads(dump_toml(config)))
    assert again.model.chat_template_kwargs == kwargs
    assert type(again.model.chat_template_kwargs["enable_thinking"]) is bool


@pytest.fixture
def qwen3_model_dir(tmp_path):
    """A tokenizer directory whose saved chat template is Qwen3-shaped (what `hf download` gives)."""
    tok = load_tokenizer(TinyModelConfig())
    tok.chat_template = QWEN3_SHAPED
    tok.save_pretrained(tmp_path / "qwen3ish")
    (tmp_path / "qwen3ish" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return tmp_path / "qwen3ish"


def test_worker_and_referee_encode_a_leased_prompt_alike(qwen3_model_dir):
    """The learner's referee and a worker each load their own tokenizer from the run config (the
    worker from the registration's copy of it); both must give the ids with the think block."""
    from echo2.learning.verify import TaskReferee

    tree = {
        "model": {
            "type": "hf",
            "path": str(qwen3_model_dir),
            "chat_template_kwargs": {"enable_thinking": False},
        },
        "task": {
            "type": "math",
            "train_file": str(DAPO_SAMPLE),
            "messages_field": "prompt",
            "answer_field": "reward_model.ground_truth",
            "system_prompt": "",
        },
        "rollout": {"max_prompt_tokens": 1024},
    }
    learner = build_config(tree)
    worker = build_config(learner.model_dump(mode="json"))  # what a worker builds at registration
    referee = TaskReferee(make_task(learner.task, seed=0), load_tokenizer(learner.model))
    worker_tok, worker_task = load_tokenizer(worker.model), make_task(worker.task, seed=0)
    leased = [worker_task.train_prompt(i) for i in range(8)]
    worker_ids = encode_prompts(worker_tok, leased, max_tokens=worker.rollout.max_prompt_tokens)
    think = worker_tok("<think>\n\n</think>\n\n", add_special_tokens=False).input_ids
    for i, ids in enumerate(worker_ids):
        prompt, referee_ids = referee._prompt(i)
        assert prompt == leased[i] and tuple(ids) == referee_ids
        assert ids[-len(think) :] == think
    plain = load_tokenizer(worker.model.model_copy(update={"chat_template_kwargs": {}}))
    assert encode_prompt(plain, leased[0]) != worker_ids[0], "a tokenizer without them would disagree"


def test_multi_turn_episodes_render_turns_with_them():
    """Env episodes render later turns through the chat template too (rollout/episodes.py): each
    new assistant header gets the same empty think block as the first."""
    from echo2.rollout.episodes import ChatTokens

    off = ChatTokens(qwen3_tokenizer(enable_thinking=False))
    on = ChatTokens(qwen3_tokenizer())
    message = {"role": "user", "content": "Turn 2"}
    with_kwarg = off.next_user(message, ended_with_eos=False)
    without = on.next_user(message, ended_with_eos=False)
    think = on.tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False).input_ids
    assert with_kwarg == without + think
