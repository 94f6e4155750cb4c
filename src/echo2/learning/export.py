"""Checkpoints as Hugging Face directories: `echo2 export RUN_DIR OUT_DIR [--adapter]`.

A full model's checkpoint (RUN_DIR/checkpoint) is itself a Hugging Face directory: the learner
writes the model's config.json, generation_config.json and the tokenizer's files beside
model.safetensors (`write_hf_files`), so `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load it as it is. A LoRA run's checkpoint holds the peft-wrapped
policy; the learner also writes the merged model to RUN_DIR/hf at the end of the run, and
`echo2 export` writes either the merged model or (`--adapter`) the peft adapter, whose
adapter_config.json names the base model's directory (for a tiny random base model, the base is
written to OUT_DIR/base). An export is written to a temporary sibling and renamed, so OUT_DIR is
complete or absent. The argument parser is light (argparse only); torch loads when it runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from echo2.config import ConfigError, build_config, read_toml


def add_parser(sub) -> None:
    e = sub.add_parser(
        "export",
        help="write a run's checkpoint as a Hugging Face directory (from_pretrained loads it)",
        description="Write the checkpoint of RUN_DIR (or a checkpoint directory) to OUT_DIR as a "
        "Hugging Face model directory with its tokenizer. LoRA runs: the merged model, or with "
        "--adapter the peft adapter.",
    )
    e.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, or its checkpoint/ directory")
    e.add_argument("out_dir", metavar="OUT_DIR", help="where to write (must not exist, or be empty)")
    e.add_argument("--adapter", action="store_true", help="LoRA runs: write the peft adapter, not merged")


def write_hf_files(model, tokenizer, out: Path) -> None:
    """config.json, generation_config.json and the tokenizer's files: with a model.safetensors
    saved from the same model, `out` is a Hugging Face directory."""
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def save_merged(model, tokenizer, out: Path) -> None:
    """A LoRA policy with its adapter merged into the base weights (the policy is left intact)."""
    import copy

    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def checkpoint_of(path: Path) -> Path:
    """RUN_DIR -> its checkpoint directory; a checkpoint directory as it is."""
    if (path / "state.json").is_file() and (path / "config.toml").is_file():
        return path
    from echo2.learning.checkpoint import checkpoint_dir

    return checkpoint_dir(path)


def _base_dir(config) -> str | None:
    """The on-disk directory of the base model an adapter applies to (None for a tiny model)."""
    if config.model.type == "hf":
        local = Path(config.model.path).expanduser()
        return str(local.resolve()) if local.is_dir() else config.model.path  # a hub id
    if config.model.type == "gguf":
        from echo2.models import gguf_model_dir

        return str(gguf_model_dir(config.model.file, config.model.cache_dir))
    return None


def export(run_dir: Path, out: Path, *, adapter: bool = False) -> Path:
    """Write the checkpoint of `run_dir` to `out` (see the module docstring); returns `out`."""
    ckpt = checkpoint_of(run_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not empty")
    config = build_config(read_toml(ckpt / "config.toml"))
    if adapter and config.learner.lora is None:
        raise ConfigError("--adapter: the run trained the whole model, not a LoRA adapter")

    from safetensors.torch import load_model as load_weights

    from echo2.learning.lora import apply_lora
    from echo2.models import load_model, load_tokenizer

    tokenizer = load_tokenizer(config.model)
    model = load_model(config.model, vocab_size=len(tokenizer), seed=config.run.seed)
    if config.learner.lora is not None:
        model = apply_lora(model, config.learner.lora)
    load_weights(model, str(ckpt / "model.safetensors"))
    model.eval()

    tmp = out.with_name(out.name + ".tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if config.learner.lora is None:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        elif not adapter:
            save_merged(model, tokenizer, tmp)
        else:
            base = _base_dir(config)
            if base is None:  # a tiny random base exists nowhere else: ship it
                import copy

                copy.deepcopy(model).unload().save_pretrained(tmp / "base", safe_serialization=True)
                tokenizer.save_pretrained(tmp / "base")
                base = str((out / "base").resolve())
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            cfg_path = tmp / "adapter_config.json"
            cfg = json.loads(cfg_path.read_text())
            cfg["base_model_name_or_path"] = base
            cfg_path.write_text(json.dumps(cfg, indent=2))
        if out.exists():
            out.rmdir()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def run(args: argparse.Namespace) -> int:
    out = export(Path(args.run_dir), Path(args.out_dir), adapter=args.adapter)
    print(out)
    return 0
