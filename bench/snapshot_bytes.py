"""Snapshot bytes, full against LoRA adapter, and the cost of installing an adapter two ways.

Bytes are those of the serialised snapshot the broadcast carries (`echo2.learning.sources.remote.serialise`).
Install: "merged" is what `HFEngine.install` does (weight = base + B @ A for every adapted layer, so
generation runs on plain weights); "peft" keeps a peft model on the engine and copies A and B into its
adapter layers (cheaper to install, but every forward pass then runs the adapter's extra matmuls);
"full" loads a whole state dict. The forward column is one forward pass over a batch, per variant.

    python bench/snapshot_bytes.py                      # SmolLM2-135M-Instruct (the quickstart model)
    python bench/snapshot_bytes.py --model tiny --rank 8
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from common import write_json

from echo2.config import GGUFModelConfig, LearnerConfig, LoraConfig, TinyModelConfig
from echo2.learning.loop import make_snapshot
from echo2.learning.lora import ADAPTER, apply_lora, engine_copy, lora_layers
from echo2.learning.sources.remote import serialise
from echo2.models import load_model, load_tokenizer
from echo2.records import LORA_A, LORA_B


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["gguf", "tiny"], default="gguf")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    mcfg = GGUFModelConfig() if args.model == "gguf" else TinyModelConfig()
    tok = load_tokenizer(mcfg)
    base = load_model(mcfg, vocab_size=len(tok), seed=0)
    full = make_snapshot(base, 1, LearnerConfig())
    policy = apply_lora(copy.deepcopy(base), LoraConfig(rank=args.rank))
    with torch.no_grad():  # as after training: B no longer zero
        for _, layer in lora_layers(policy):
            layer.lora_B[ADAPTER].weight.normal_(std=1e-3)
    adapter = make_snapshot(policy, 1, LearnerConfig())
    full_bytes, adapter_bytes = len(serialise(full)), len(serialise(adapter))

    merged = engine_copy(policy).eval()  # the HF engine's model: base weights, adapter merged in
    from echo2.rollout.engine import HFEngine

    engine = HFEngine(merged, tok, config=None)  # install only; generation config not needed
    kept = copy.deepcopy(policy).eval()  # the alternative: a peft model on the engine
    kept_layers = dict(lora_layers(kept))

    @torch.no_grad()
    def install_peft() -> None:
        for name, layer in kept_layers.items():
            layer.lora_A[ADAPTER].weight.copy_(adapter.state[name + LORA_A])
            layer.lora_B[ADAPTER].weight.copy_(adapter.state[name + LORA_B] / layer.scaling[ADAPTER])

    target = copy.deepcopy(base)
    batch = torch.randint(0, len(tok), (8, 64))

    @torch.no_grad()
    def forward(model) -> None:
        model(input_ids=batch, use_cache=False)

    result = {
        "model": args.model,
        "rank": args.rank,
        "params": sum(p.numel() for p in base.parameters()),
        "adapter_params": sum(v.numel() for v in adapter.state.values()),
        "full_bytes": full_bytes,
        "adapter_bytes": adapter_bytes,
        "ratio": full_bytes / adapter_bytes,
        "install_s": {
            "full": timed(lambda: target.load_state_dict(full.state), args.repeats),
            "merged": timed(lambda: engine.install(adapter), args.repeats),
            "peft": timed(install_peft, args.repeats),
        },
        "forward_s": {
            "merged": timed(lambda: forward(merged), args.repeats),
            "peft": timed(lambda: forward(kept), args.repeats),
        },
        "threads": torch.get_num_threads(),
    }
    print(
        f"{args.model} rank {args.rank}: full {full_bytes / 2**20:.1f} MiB, adapter "
        f"{adapter_bytes / 2**20:.2f} MiB ({result['ratio']:.0f}x smaller)"
    )
    print("install s:", {k: round(v, 4) for k, v in result["install_s"].items()})
    print("forward s (8 x 64 tokens):", {k: round(v, 4) for k, v in result["forward_s"].items()})
    write_json(args.json, result)


if __name__ == "__main__":
    main()
