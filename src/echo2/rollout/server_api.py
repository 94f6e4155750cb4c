"""What the server engine says to an inference server and how it reads the answers, as pure functions
(no I/O): the `/v1/completions` bodies of a generation call, the samples in a reply, and which
server addresses need an API key.

The bodies follow vLLM 0.32's completion protocol (vllm/entrypoints/openai/completion/protocol.py
`CompletionRequest`): the prompt as token ids (echo2's tokenizer stays the only one), every
sampling field explicit (a server's generation_config never fills one in), `logprobs: 0` (the
sampled token's log-prob, in the server's --logprobs-mode), `return_token_ids`, EOS as the only
stop, and `cache_salt` per installed version, so no prefix cached under one version serves another
(prime-rl's and SkyRL's way). Under rollout.sampling = "gumbel" every sample is its own greedy
request carrying its keys in `vllm_xargs` (-> SamplingParams.extra_args, protocol.py l.379), which
echo2's logits processor reads in the server (rollout/vllm_sampling.py), exactly as in process.
"""

from __future__ import annotations

import ipaddress
import math
from typing import Any
from urllib.parse import urlsplit

from echo2.config import RolloutConfig
from echo2.rollout import vllm_args
from echo2.rollout.sampling import SamplingKeys

UNIX = "unix:"
"""A url of this form names a Unix socket (`unix:/path/to.sock`): local by construction."""


def cache_salt(version: int) -> str:
    """The prefix-cache salt of requests served by `version`'s weights."""
    return f"echo2-v{version}"


def completion_bodies(
    config: RolloutConfig,
    encoded: list[list[int]],
    *,
    n: int,
    greedy: bool,
    keys: SamplingKeys | None,
    eos_id: int,
    version: int,
) -> list[dict[str, Any]]:
    """The request bodies of one `generate_ids` call, in order: one per context (its n samples as
    `n`), or under "gumbel" one per sample (context i's n samples together), as `VLLMEngine`'s
    `sampling_params`. `keys` must be given for a non-greedy "gumbel" call."""
    common: dict[str, Any] = {
        "max_tokens": config.max_new_tokens,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
        "ignore_eos": True,  # stop at the tokenizer's EOS only, as the other engines do
        "stop_token_ids": [eos_id],
        "skip_special_tokens": False,
        "cache_salt": cache_salt(version),
        "stream": False,
    }
    if config.sampling == "gumbel":
        if greedy:
            extras = [{vllm_args.GREEDY_KEY: 1}] * (len(encoded) * n)
        else:
            if keys is None:
                raise ValueError("a gumbel call needs the lease's keys")
            if len(keys.groups) != len(encoded):
                raise ValueError(f"{len(keys.groups)} group ids for {len(encoded)} contexts")
            extras = vllm_args.gumbel_extra_args(keys, n=n, temperature=config.temperature, top_p=config.top_p)
        # greedy for the server: it takes the arg-max of the processor's row
        return [
            common | {"prompt": ids, "n": 1, "temperature": 0.0, "top_p": 1.0, "vllm_xargs": extra}
            for ids, extra in zip((ids for ids in encoded for _ in range(n)), extras, strict=True)
        ]
    temperature, top_p = (0.0, 1.0) if greedy else (config.temperature, config.top_p)
    return [common | {"prompt": ids, "n": n, "temperature": temperature, "top_p": top_p} for ids in encoded]


class BadReply(ValueError):
    """A server's reply that is not a well-formed answer to the request sent."""


def samples_of(reply: Any, *, prompt: list[int], n: int, max_tokens: int) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    """(response ids, log-probs) of each of a reply's `n` choices, in index order. BadReply unless
    the reply echoes the prompt ids sent, has exactly n choices, and each has as many finite,
    non-positive log-probs as token ids, at most `max_tokens` of them."""
    if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list):
        raise BadReply("no choices in the reply")
    choices = sorted(reply["choices"], key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
    if len(choices) != n:
        raise BadReply(f"{len(choices)} choices for n = {n}")
    out = []
    for c in choices:
        ids, lp = c.get("token_ids"), (c.get("logprobs") or {}).get("token_logprobs")
        if c.get("prompt_token_ids") not in (None, prompt):
            raise BadReply("the reply's prompt token ids are not the ones sent")
        if not isinstance(ids, list) or not isinstance(lp, list) or len(ids) != len(lp):
            raise BadReply("token ids and log-probs missing or of different lengths")
        if not 1 <= len(ids) <= max_tokens or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise BadReply(f"{len(ids)} response tokens (1 to {max_tokens} expected)")
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v <= 0 for v in lp):
            raise BadReply("a log-prob is not a finite number <= 0")
        out.append((tuple(ids), tuple(float(v) for v in lp)))
    return out


def is_local(url: str) -> bool:
    """True for a Unix socket or a loopback host (127.0.0.0/8, ::1, localhost)."""
    if url.startswith(UNIX):
        return True
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_url(url: str) -> str | None:
    """Why `url` is not a server address echo2 can use (None: it is)."""
    if url.startswith(UNIX):
        return None if len(url) > len(UNIX) else "unix: needs a socket path"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "not http(s)://HOST[:PORT] or unix:/path"
    return None
