"""`echo2 plan --memory CONFIG.toml --gpu NAME [--gpus N] [--arch KEY]`: the memory plan of a config.

Reads what planning/memory.py (pure) needs: the config, resolved as the learner resolves it on a CUDA device
(learning/device.py `resolved_learner`), and the model's architecture (the model directory's
config.json, else the built-in table entry its path names, else --arch). Prints the table or
`--json`. A user mistake is a ConfigError naming the flag or key (exit 2). Exit 1 when the learner
(as configured) or a dedicated worker does not fit. Imports no torch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from echo2.config import Config, ConfigError, load_config, parse_overrides
from echo2.planning import memory as memplan
from echo2.planning.memory import GPU, TIGHT, GiB

CUDA_MICRO_BATCH_TOKENS = 16384
"""learner.micro_batch_tokens = None on CUDA (learning/device.py MICRO_BATCH_TOKENS["cuda"])."""


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The `plan` subcommand's memory flags (cli.py)."""
    parser.add_argument(
        "--memory",
        metavar="CONFIG.toml",
        default=None,
        help="print the GPU memory plan of this config instead (learner, vLLM worker, both on one GPU); "
        "any config field can be overridden: --learner.micro_batch_tokens=32768",
    )
    parser.add_argument(
        "--gpu",
        default=None,
        metavar="NAME",
        help=f"with --memory: the GPU type ({', '.join(memplan.GPUS)}) or a size such as 48GiB",
    )
    parser.add_argument(
        "--gpus", type=int, default=1, metavar="N", help="with --memory: learner GPUs (FSDP2 shards over N)"
    )
    parser.add_argument(
        "--arch",
        default=None,
        metavar="KEY",
        help=f"with --memory: a built-in architecture ({', '.join(memplan.ARCHS)}) instead of the model's config.json",
    )


def run(args: argparse.Namespace, extra: list[str]) -> int:
    if not args.gpu:
        raise ConfigError("--gpu: required with --memory (" + ", ".join(memplan.GPUS) + ", or a size)")
    try:
        gpu = memplan.gpu_named(args.gpu)
    except ValueError as e:
        raise ConfigError(f"--gpu: {e}") from None
    if args.gpus < 1:
        raise ConfigError(f"--gpus: must be >= 1 (got {args.gpus})")
    config = load_config(args.memory, parse_overrides(extra))
    arch, wl = architecture(config, args.arch), workload(config)
    plan = memplan.plan_memory(arch, wl, gpu, gpus=args.gpus)
    args_ = engine_args(config, plan, gpu)
    if args.gpus == 1 and (kv := _kv_beside_learner(args_["colocated"], plan, gpu)) is not None:
        plan = memplan.plan_memory(arch, wl, gpu, gpus=1, colocated_kv=kv)
    plan["echo2_vllm_args"] = args_
    plan["fits"] = plan["learner"]["fits"] and plan["worker"]["fits"]
    print(json.dumps(plan, indent=2) if args.json else render(plan))
    return 0 if plan["fits"] else 1


def engine_args(config: Config, plan: dict, gpu: GPU) -> dict:
    """The vLLM arguments echo2's engine would be built with on this GPU, alone on the card and beside
    the learner (rollout/vllm_args.py `llm_kwargs`, pure), or the refusal it would stop with."""
    from echo2.rollout import vllm_args

    out = {}
    for where, shared in (("worker", False), ("colocated", True)):
        try:
            out[where] = vllm_args.llm_kwargs(
                config.rollout,
                device_kind="cuda",
                total_bytes=gpu.bytes,
                weight_bytes=plan["worker"]["weights"],
                kv_per_token=plan["worker"]["kv_bytes_per_token"],
                shared=shared,
            )
        except ConfigError as e:  # shown in the plan: it is what `echo2 run` would refuse with
            out[where] = {"refused": str(e)}
    return out


def _kv_beside_learner(kwargs: dict, plan: dict, gpu: GPU) -> int | None:
    """The KV cache those arguments give an engine beside the learner: a fixed size, else what vLLM
    keeps of its share after weights and overhead (vllm/v1/worker/gpu_worker.py)."""
    if "kv_cache_memory_bytes" in kwargs:
        return kwargs["kv_cache_memory_bytes"]
    if "gpu_memory_utilization" in kwargs:
        w = plan["worker"]
        return max(0, int(kwargs["gpu_memory_utilization"] * gpu.bytes) - w["weights"] - w["overhead"])
    return None


def workload(config: Config) -> memplan.Workload:
    """The plan's inputs from a config, "auto"/None resolved as on a CUDA device."""
    lcfg, rcfg = config.learner, config.rollout
    vllm = getattr(rcfg, "vllm", None)  # [rollout.vllm] (gpu_memory_utilization, kv_cache_gib)
    return memplan.Workload(
        max_prompt_tokens=rcfg.max_prompt_tokens,
        max_new_tokens=rcfg.max_new_tokens,
        group_size=rcfg.group_size,
        micro_batch_tokens=lcfg.micro_batch_tokens or CUDA_MICRO_BATCH_TOKENS,
        bf16=lcfg.dtype != "fp32",  # "auto" is bf16 on every GPU in memplan.GPUS (Ampere or newer)
        gradient_checkpointing=lcfg.gradient_checkpointing is not False,  # None: on for CUDA
        lora_rank=lcfg.lora.rank if lcfg.lora else None,
        lora_targets=tuple(lcfg.lora.target_modules) if lcfg.lora else (),
        reference_model=lcfg.kl_beta > 0,
        kv_cache_gib=getattr(vllm, "kv_cache_gib", None),
        gpu_memory_utilization=getattr(vllm, "gpu_memory_utilization", None),
    )


def architecture(config: Config, arch: str | None) -> memplan.Arch:
    """--arch, else the model directory's config.json, else the built-in entry the path names."""
    if arch:
        if arch.lower() not in memplan.ARCHS:
            raise ConfigError(f"--arch: unknown {arch!r} (one of {', '.join(memplan.ARCHS)})")
        return memplan.ARCHS[arch.lower()]
    model = config.model
    hint = f"pass --arch ({', '.join(memplan.ARCHS)})"
    if model.type != "hf":
        raise ConfigError(f"model.type: the memory plan needs an hf model or --arch; {hint}")
    path = Path(model.path).expanduser()
    if (path / "config.json").is_file():
        try:
            cfg = json.loads((path / "config.json").read_text())
            return memplan.arch_from_hf_config(cfg, name=path.name, source=str(path / "config.json"))
        except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
            raise ConfigError(f"model.path: {path / 'config.json'}: {e}") from None
    key = memplan.arch_matching(model.path)
    if key is None:
        raise ConfigError(
            f"model.path: {model.path}: no config.json there and no built-in architecture named; {hint}"
        )
    return memplan.ARCHS[key]


def _row(label: str, n: float, note: str = "") -> str:
    return f"  {label:<44}{n / GiB:9.2f}" + (f"  {note}" if note else "")


def _verdict(fits: bool, headroom: int, gpu: GPU) -> str:
    if not fits:
        return f"DOES NOT FIT: {-headroom / GiB:.2f} GiB over"
    return f"fits{' (tight)' if headroom < TIGHT * gpu.bytes else ''}: {headroom / GiB:.2f} GiB headroom"


def render(plan: dict) -> str:
    """The table `echo2 plan --memory` prints (GiB = 2^30 bytes)."""
    m, g, wl, ln, w, c = (plan[k] for k in ("model", "gpu", "workload", "learner", "worker", "colocated"))
    gpu = GPU(name=g["name"], bytes=g["bytes"], source=g["source"])
    peaks = ("peak_with_checkpointing", "peak_without_checkpointing")
    fit = {k: _verdict(ln[k] <= gpu.bytes, gpu.bytes - ln[k], gpu) for k in peaks}
    row_len = wl["max_prompt_tokens"] + wl["max_new_tokens"]
    out = [
        f"{m['name']}: {ln['params'] / 1e9:.2f} B parameters ({m['source']})",
        f"GPU: {plan['gpus']} x {g['name']}, {g['gib']:.1f} GiB each ({g['source']})",
        f"row: {wl['max_prompt_tokens']} prompt + {wl['max_new_tokens']} new tokens; micro-batch "
        f"{wl['micro_batch_tokens']} tokens -> {ln['micro_batch_rows']} row(s) of {row_len}",
        "",
        f"{'learner, per GPU (FSDP2 over ' + str(plan['gpus']) + ')':<46}{'GiB':>9}",
        _row("weights (fp32 master, 4 B/param)", ln["weights"]),
        _row("gradients (fp32, 4 B/param)", ln["gradients"]),
        _row("AdamW m and v (fp32, 8 B/param)", ln["adamw"]),
    ]
    if ln["reference_model"]:
        out.append(_row("reference model (kl_beta > 0, fp32)", ln["reference_model"]))
    out += [
        _row("bf16 weight copy, checkpointing on", ln["bf16_weight_copy_with_checkpointing"]),
        _row("bf16 weight copy, checkpointing off", ln["bf16_weight_copy_without_checkpointing"]),
        _row("activations, checkpointing on", ln["activations_with_checkpointing"]),
        _row("activations, checkpointing off", ln["activations_without_checkpointing"]),
        _row(
            f"logits head ({ln['micro_batch_rows']} x {wl['max_new_tokens'] + 1} x {m['vocab_size']})",
            ln["logits_head"],
        ),
        _row("CUDA context", ln["cuda_context"]),
        _row("peak, checkpointing on", ln["peak_with_checkpointing"], fit["peak_with_checkpointing"]),
        _row("peak, checkpointing off", ln["peak_without_checkpointing"], fit["peak_without_checkpointing"]),
        f"  as configured (checkpointing {'on' if ln['gradient_checkpointing'] else 'off'}): "
        + _verdict(ln["fits"], ln["headroom"], gpu),
        "",
        f"rollout worker (vLLM alone on one {g['name']})",
        _row(f"weights ({w['dtype_bytes']} B/param)", w["weights"]),
        _row("KV cache per token (KiB)", w["kv_bytes_per_token"] * GiB / 1024),
        _row(f"KV per sequence ({row_len} tokens)", w["kv_per_sequence"]),
        _row(f"KV per GRPO group ({wl['group_size']} sequences)", w["kv_per_group"]),
        _row(
            "activations, sampler, CUDA graphs, context",
            w["overhead"],
            f"{w['max_num_batched_tokens']} tokens, {w['max_num_seqs']} sequences",
        ),
        _row(
            f"KV cache at gpu_memory_utilization {w['gpu_memory_utilization']:.2f}",
            w["kv_cache"],
            f"{w['sequences_in_kv']} sequences, {w['groups_in_kv']} group(s): "
            + ("fits" if w["fits"] else "DOES NOT FIT (less than one sequence)"),
        ),
    ]
    if c is None:
        return "\n".join(
            [*out, "", "colocated: not applicable (under torchrun the learner builds no vLLM engine)"]
        )
    out += [
        "",
        f"colocated (learner + vLLM on one {g['name']})",
        _row("learner peak (as configured)", c["learner_peak"]),
        _row(f"engine: weights + {c['kv_cache'] / GiB:.2f} GiB KV + overhead", c["engine"]),
        _row("total", c["total"], _verdict(c["fits"], c["headroom"], gpu)),
        f"  vLLM share {c['gpu_memory_utilization']:.3f} of the card (free when it starts); KV holds "
        f"{c['sequences_in_kv']} sequences, {c['groups_in_kv']} group(s); it could grow to "
        f"{c['kv_cache_at_most'] / GiB:.2f} GiB"
        if c["fits"]
        else "  no share of the card is left for vLLM beside this learner",
    ]
    return "\n".join([*out, *_echo2_args(plan.get("echo2_vllm_args"))])


def _echo2_args(args: dict | None) -> list[str]:
    if not args:
        return []
    out = ["", "echo2's vLLM arguments on this GPU (rollout/vllm_args.py)"]
    for where, kw in args.items():
        shown = kw.get("refused") or ", ".join(
            f"{k}={v / GiB:.2f} GiB" if k == "kv_cache_memory_bytes" else f"{k}={v}" for k, v in kw.items()
        )
        out.append(f"  {'beside the learner' if where == 'colocated' else 'alone on the card'}: {shown}")
    return out
