"""The multi-process learner: FSDP2 sharding, each rank's share of a step, and rank 0's orders.

Owns torch.distributed. Under `torchrun --nproc-per-node N` every process runs the same entry point;
`start` joins the process group (gloo on CPU, nccl on CUDA). Rank 0 runs the learner loop: it alone
serves the coordinator, writes metrics and checkpoints and publishes snapshots. Every other rank runs
`build.follow`, which builds the same learner and `obey`s rank 0's orders (train on
these groups, join a gather of the full state dict or the LoRA adapter, stop) and writes nothing.
Sharding never puts a whole model on a rank's device, and only rank 0 reads the weights (`shard`). Within a step the micro-batches are dealt
out round-robin; a rank with fewer runs a zero-weighted copy, so every rank issues the same
collectives. FSDP sums (not averages) the gradients, because each micro-batch loss is already
divided by the step's token count: the update equals the single-process one.

With one process (no torchrun) every function is the identity or a no-op, so the single-process
learner runs the same code. Knows nothing of rollouts, tasks or the coordinator, and imports no
other learning module (device.py, step.py, build.py and learning/lora.py build on it).
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

FOLLOWER_PATIENCE = datetime.timedelta(hours=6)
_joined = False  # this process joined torchrun's process group (start)


class Order(StrEnum):
    TRAIN = "train"  # payload: the step's groups
    GATHER = "gather"  # gather the full state dict onto rank 0
    SAVE = "save"  # gather full model and optimizer state for a checkpoint
    STOP = "stop"


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def start(device: torch.device) -> int:
    """Join torchrun's process group if there is one (WORLD_SIZE > 1), on this rank's learner device
    (device.resolve_device); this process's rank."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # Followers wait in a broadcast while rank 0 evaluates or waits for workers' rollouts, which
        # can outlast the default 10-30 min collective timeout.
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=FOLLOWER_PATIENCE)
        global _joined
        _joined = True
        logger.info("rank %d of %d joined (%s)", rank(), world_size(), dist.get_backend())
    return rank()


def stop() -> None:
    if world_size() > 1:
        if rank() == 0:
            lead(Order.STOP)
        dist.destroy_process_group()


def leave(code: int) -> None:
    """End a torchrun rank now, without interpreter finalization: flush the logs and the standard
    streams, then `os._exit(code)`. Nothing in a process that never joined a process group (one
    process, the tests, the Python API), so the caller goes on to return `code` as usual.

    Why: gloo's backend has no `shutdown` (ProcessGroupGloo.hpp does not override c10d's no-op
    `Backend::shutdown`, torch 2.13), so `destroy_process_group` only drops Python's references;
    the group's worker threads live on while anything (FSDP2's DeviceMesh) still holds it. A worker
    drops its finished work (`workInProgress_`) after the caller has returned, and releasing the
    last reference to a tensor that Python created takes the GIL. If that happens while the
    interpreter is finalizing, CPython ends the thread inside a noexcept destructor and the rank
    aborts ("terminate called without an active exception", SIGABRT) after a run that finished
    (seen once in CI on tests/e2e/test_fsdp.py's two-rank run; pytorch/pytorch#179291, an atexit
    destroy, was abandoned, and destroying would not stop the threads anyway). Everything a run
    writes is closed by then: metrics, checkpoints, the tracker, summary.json."""
    if not _joined:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shard(model: torch.nn.Module, *, param_dtype: torch.dtype | None = None) -> None:
    """FSDP2 in place, every rank holding rank 0's weights: each decoder layer (HF's
    `_no_split_modules`), then the root, which holds the (possibly tied) embeddings and head.

    No rank ever holds the whole model on its device, and ranks > 0 need not hold it anywhere: their
    `model` may be built on the meta device. Rank 0 keeps a reference to its full weights and moves
    its model to meta; every rank shards the meta model (fully_shard leaves meta tensors on meta,
    torch/distributed/fsdp/_fully_shard/_fsdp_init.py `_move_states_to_device`), allocates its
    shards with `to_empty` on the process group's device, and rank 0's weights are broadcast one
    tensor at a time into them (`set_model_state_dict(..., broadcast_from_rank0=True)`,
    torch/distributed/checkpoint/state_dict.py `_load_model_state_dict` -> _state_dict_utils.py
    `_broadcast_state_dict`, which copies each rank's slice into its local shard). The shape is
    torchtitan's meta init + to_empty + load, and accelerate's `fsdp2_prepare_model` with
    cpu_ram_efficient_loading. What the state dict does not carry is put back by hand: tied
    parameters (re-pointed after each move) and non-persistent buffers (rotary `inv_freq`), sent
    from rank 0.

    `param_dtype` (bf16): parameters are all-gathered in it and gradients reduce-scattered in fp32
    (`MixedPrecisionPolicy`, torch/distributed/fsdp/_fully_shard/_fsdp_api.py; torchtitan's
    default); the sharded parameters and the optimizer stay fp32. Gradients are summed across
    ranks, not averaged."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from echo2.models import tied_names

    tied = tied_names(model)
    full = model.state_dict() if rank() == 0 else {}  # rank 0's weights, kept alive past .to("meta")
    buffers = _non_persistent_buffers(model) if rank() == 0 else None
    model.to("meta")  # a no-op on ranks > 0 built on meta
    _tie(model, tied)

    reduce_dtype = torch.float32 if param_dtype is not None else None
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    layer_types = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layer_types:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM

    model.to_empty(device=_comm_device())  # this rank's shards only, uninitialised
    _tie(model, tied)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    del full
    _put_buffers(model, buffers)


def _tie(model: torch.nn.Module, tied: dict[str, str]) -> None:
    """Point every tied alias (models.tied_names: alias -> the name kept) at the kept parameter."""
    for alias, kept in tied.items():
        owner, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(kept))


def _non_persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Buffers that state_dict leaves out (rotary inv_freq), as CPU copies."""
    out = {}
    for owner_name, owner in model.named_modules():
        for name in owner._non_persistent_buffers_set:
            buf = owner._buffers.get(name)
            if buf is not None:
                out[f"{owner_name}.{name}" if owner_name else name] = buf.detach().to("cpu", copy=True)
    return out


def _put_buffers(model: torch.nn.Module, buffers: dict[str, torch.Tensor] | None) -> None:
    """Rank 0's non-persistent buffers on every rank, on the communication device."""
    message = [buffers]
    dist.broadcast_object_list(message, src=0, device=_comm_device())
    device = _comm_device()
    for full_name, value in (message[0] or {}).items():
        owner, _, name = full_name.rpartition(".")
        model.get_submodule(owner).register_buffer(name, value.to(device), persistent=False)


def share(batches: Iterable[list[int]], records) -> Iterator[tuple[list[int], bool]]:
    """This rank's micro-batches as (rows, live); a dead one is run with weight 0 only so that every
    rank runs as many forward/backward passes (and so collectives) as the others."""
    if world_size() == 1:
        yield from ((rows, True) for rows in batches)
        return
    plan = [rows for rows in batches if any(any(records[i].loss_mask) for i in rows)]
    mine = plan[rank() :: world_size()]
    yield from ((rows, True) for rows in mine)
    rounds = -(-len(plan) // world_size())
    for _ in range(rounds - len(mine)):
        yield plan[0], False


def _comm_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )


def sum_stats(totals: dict[str, float]) -> dict[str, float]:
    """Per-rank sums of a step's statistics, summed over ranks (each rank holds its share)."""
    if world_size() == 1:
        return totals
    values = torch.tensor(list(totals.values()), dtype=torch.float64, device=_comm_device())
    dist.all_reduce(values)
    return dict(zip(totals, values.tolist(), strict=True))


def scalar(value) -> float:
    """A float from a tensor that may be a replicated DTensor (clip_grad_norm_ under FSDP2)."""
    full = getattr(value, "full_tensor", None)
    return float(full() if full else value)


def lead(order: Order, payload: Any = None) -> None:
    """Rank 0 tells the followers what to do next; nothing with one process."""
    if world_size() > 1:
        assert rank() == 0, "only rank 0 gives orders"
        dist.broadcast_object_list([order.value, payload], src=0, device=_comm_device())


def is_sharded(model) -> bool:
    """Whether `model` is an FSDP2 module (torchrun), so that reading its weights is a collective."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state(model) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict; under FSDP2 a collective ordered by rank 0, on CPU, and
    empty on other ranks."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if rank() == 0:
        lead(Order.GATHER)
    return get_model_state_dict(model, options=_full_options())


class _Full:
    """Stands in for a module or optimizer where only `state_dict()` is read (checkpoint.py)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


def for_checkpoint(model, optimizer) -> tuple[Any, Any]:
    """(model, optimizer) as checkpoint.py saves them: themselves on one process; under FSDP2 their
    full states gathered on rank 0 (optimizer state keyed by parameter name)."""
    if not is_sharded(model):
        return model, optimizer
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if rank() == 0:
        lead(Order.SAVE)
    opts = _full_options()
    return _Full(get_model_state_dict(model, options=opts)), _Full(
        get_optimizer_state_dict(model, optimizer, options=opts)
    )


def obey(model, optimizer, *, train: Callable[[Any], None], gather: Callable[[Any], Any]) -> int:
    """A rank > 0: obey rank 0's orders until told to stop (train on these groups with `train`, join
    a gather of what rank 0's snapshot takes with `gather`, join a checkpoint's gather); the number
    of steps trained. The caller builds the learner (build.follow), so this module needs no other."""
    steps = 0
    while True:
        message: list[Any] = [None, None]
        dist.broadcast_object_list(message, src=0, device=_comm_device())
        order, payload = Order(message[0]), message[1]
        if order is Order.TRAIN:
            train(payload)
            steps += 1
        elif order is Order.GATHER:
            gather(model)
        elif order is Order.SAVE:
            for_checkpoint(model, optimizer)
        else:
            break
    logger.info("rank %d stopped after %d steps", rank(), steps)
    dist.destroy_process_group()
    return steps
