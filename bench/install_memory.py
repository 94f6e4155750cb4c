"""Peak resident memory of a worker installing one received snapshot: the old path against the new.

A worker holds a received snapshot as its verified chunks (its relay serves them), and its engine
holds the model. Each measurement runs in a fresh process: it loads the engine's model (the HF
engine, CPU), reads the snapshot into chunks as the `ChunkStore` keeps them, resets the kernel's
high-water mark (`/proc/self/clear_refs` 5), installs, and reads the peak (`VmHWM`).

- old (commit 97ea5ef): the learner sends the tied LM head as a second copy; the broadcast client
  joins the chunks into one `bytes` (`ChunkStore.assemble`), kept until the install is reported;
  the worker parses it whole (`safetensors.torch.load`) and the engine `load_state_dict`s it.
- new: the tied head is left out; the client hands over the chunks (`SnapshotBytes`); the engine
  copies tensor by tensor from them (`SafetensorsView`, `models.install_state`).

"overhead" is the peak above what the process held just before the install (model + chunks).

    python bench/install_memory.py --json docs/bench/install_memory.json             # fp32 snapshot
    python bench/install_memory.py --dtype bf16 --json docs/bench/install_memory_bf16.json
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import write_json

VARIANTS = ("old", "new")


def status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def child(variant: str, blob: Path, threads: int, chunk_bytes: int) -> dict:
    """One install in this (fresh) process; what it measured."""
    import torch

    torch.set_num_threads(threads)
    from echo2.config import GGUFModelConfig
    from echo2.models import load_model, load_tokenizer
    from echo2.records import Snapshot
    from echo2.rollout.engine import HFEngine

    mcfg = GGUFModelConfig()
    tok = load_tokenizer(mcfg)
    engine = HFEngine(load_model(mcfg, vocab_size=len(tok), seed=0), tok, config=None)
    with torch.no_grad():  # weights in memory of their own, as after a first install (not pages
        for p in engine.model.parameters():  # of the loaded file, copied when first written)
            p.data = p.data.clone()
    with blob.open("rb") as f:  # the chunks a ChunkStore holds once every one is verified
        chunks = list(iter(lambda: f.read(chunk_bytes), b""))
    gc.collect()
    before = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    if variant == "old":
        from safetensors.torch import load

        data = b"".join(chunks)  # ChunkStore.assemble, held by BroadcastClient.follow until reported
        state = load(data)  # worker.install_snapshot
        engine.model.load_state_dict(state)  # HFEngine.install
        del state, data
    else:
        from echo2.broadcast.chunks import SnapshotBytes
        from echo2.rollout.safetensors_view import SafetensorsView

        view = SafetensorsView(SnapshotBytes(chunks, chunk_bytes))
        engine.install(Snapshot(version=1, state=view))
        assert engine.model.lm_head.weight is engine.model.get_input_embeddings().weight
    peak = status_kib("VmHWM")
    return {"variant": variant, "before_kib": before, "peak_kib": peak, "overhead_kib": peak - before}


def write_blobs(dtype: str, where: Path) -> dict:
    """The snapshot of SmolLM2-135M as each path publishes it; their sizes."""
    import torch

    from echo2.config import GGUFModelConfig, LearnerConfig
    from echo2.learning.device import DTYPES, snapshot_state
    from echo2.learning.sources.remote import serialise
    from echo2.models import load_model, load_tokenizer
    from echo2.records import Snapshot

    mcfg = GGUFModelConfig()
    tok = load_tokenizer(mcfg)
    model = load_model(mcfg, vocab_size=len(tok), seed=0)
    target = DTYPES[dtype]
    old = {k: v.detach().to("cpu", dtype=target, copy=True) for k, v in model.state_dict().items()}
    from safetensors.torch import save

    (where / "old.safetensors").write_bytes(save(old))  # the 97ea5ef learner: every key, cloned
    new = serialise(Snapshot(version=1, state=snapshot_state(model, LearnerConfig(dtype=dtype))))
    (where / "new.safetensors").write_bytes(new)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "old_bytes": (where / "old.safetensors").stat().st_size,
        "new_bytes": len(new),
        "engine_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--dtype", choices=["fp32", "bf16"], default="fp32", help="the snapshot's (learner.dtype)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk-mb", type=float, default=None, help="default: broadcast.chunk_mb")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--blob", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    from echo2.config import BroadcastConfig

    chunk_bytes = BroadcastConfig(
        **({} if args.chunk_mb is None else {"chunk_mb": args.chunk_mb})
    ).chunk_bytes
    if args.child:
        print(json.dumps(child(args.child, args.blob, args.threads, chunk_bytes)))
        return
    with tempfile.TemporaryDirectory(prefix="echo2-install-memory-") as tmp:
        result = {"model": "SmolLM2-135M-Instruct (GGUF)", "dtype": args.dtype, "chunk_bytes": chunk_bytes}
        result |= write_blobs(args.dtype, Path(tmp))
        runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for variant in VARIANTS:  # alternated, so drift on a shared machine hits both
                cmd = [sys.executable, __file__, "--child", variant, "--blob", f"{tmp}/{variant}.safetensors"]
                cmd += ["--threads", str(args.threads)]
                if args.chunk_mb is not None:
                    cmd += ["--chunk-mb", str(args.chunk_mb)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                runs[variant].append(json.loads(out.strip().splitlines()[-1]))
    mib = 1024
    result["runs"] = runs
    result["median_mib"] = {
        v: {k: statistics.median(r[f"{k}_kib"] for r in rs) / mib for k in ("before", "peak", "overhead")}
        for v, rs in runs.items()
    }
    print(
        f"snapshot {args.dtype}: old {result['old_bytes'] / 2**20:.1f} MiB, "
        f"new {result['new_bytes'] / 2**20:.1f} MiB"
    )
    for v, m in result["median_mib"].items():
        print(
            f"{v}: before {m['before']:.0f} MiB, peak {m['peak']:.0f} MiB, overhead {m['overhead']:.0f} MiB"
        )
    write_json(args.json, result)


if __name__ == "__main__":
    main()
