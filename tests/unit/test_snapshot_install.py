"""A worker installs a received snapshot tensor by tensor from its verified chunks (no joined copy,
no whole state dict); the vLLM extension consumes weights lazily; a LoRA install on vLLM sends only
the layers it changed (and those vLLM fuses with them)."""

from __future__ import annotations

import asyncio
import copy
import logging

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import save

from echo2.broadcast.chunks import SnapshotBytes, make_manifest, public_key_hex, split
from echo2.broadcast.relay import ChunkStore
from echo2.records import LORA_A, LORA_B, Snapshot
from echo2.rollout.broadcast_client import BroadcastClient, Receiving
from echo2.rollout.safetensors_view import SafetensorsView
from echo2.rollout.vllm_engine import VLLMEngine
from echo2.rollout.vllm_ext import (
    PARTIAL_NOISE,
    WeightInstaller,
    layers_to_send,
    tied_aliases,
    with_tied_aliases,
)
from echo2.rollout.worker import Worker
from echo2.rollout.worker_config import WorkerConfig
from echo2.wire.protocol import Route

LLAMA_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
"""vllm/model_executor/models/llama.py (and qwen3.py) `packed_modules_mapping`."""


def state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.w": torch.randn(64, 32, generator=gen) for i in range(4)}


def received(data: bytes, chunk_size: int = 1024) -> tuple[ChunkStore, int]:
    key = Ed25519PrivateKey.generate()
    manifest, chunks = make_manifest(3, data, chunk_size, key)
    store = ChunkStore()
    store.add_manifest(manifest.model_copy())
    for i, c in enumerate(chunks):
        assert store.put(3, i, c)
    return store, 3


def test_fetch_hands_over_the_stores_verified_chunks_not_a_joined_copy():
    import hashlib

    data = save(state())
    store, version = received(data)

    class Coordinator:  # the route is asked for; nothing is missing, so nothing is streamed
        async def route(self, req):
            return Route(version=req.version, parent_id=None, url=None)

    key = public_key_hex(Ed25519PrivateKey.generate())
    client = BroadcastClient(Coordinator(), store, Receiving(), worker_id="w1", public_key=key)
    got = asyncio.run(client.fetch(version))
    assert isinstance(got, SnapshotBytes) and len(got) == len(data)
    held = store.chunks[version]
    assert len(got._chunks) == len(held) and all(c is held[i] for i, c in enumerate(got._chunks))
    assert client.digests[version] == hashlib.sha256(data).hexdigest() == got.sha256()
    assert bytes(got) == data == store.assemble(version)
    store.clear()  # the store drops the version (a newer epoch): what was handed over stays readable
    assert got.read(0, 16) == data[:16]


class RecordingEngine:
    """Records the type each install received, the bytes read before it ran, and whether each
    tensor lookup read exactly that tensor's bytes."""

    def __init__(self, reads: list[tuple[int, int]]) -> None:
        self.version, self.reads, self.seen = -1, reads, []

    def install(self, snapshot: Snapshot) -> None:
        read_before = sum(e - s for s, e in self.reads)
        exact = []
        for name in snapshot.state:
            n = len(self.reads)
            tensor = snapshot.state[name]
            exact.append(sum(e - s for s, e in self.reads[n:]) == tensor.numel() * tensor.element_size())
        self.seen.append((type(snapshot.state), read_before, exact))
        self.version = snapshot.version


def test_a_worker_installs_a_full_snapshot_tensor_by_tensor_from_its_chunks():
    data = save(state())
    header = 8 + int.from_bytes(data[:8], "little")
    reads: list[tuple[int, int]] = []

    class Spy(SnapshotBytes):
        def read(self, start, end):
            reads.append((start, end))
            return super().read(start, end)

    worker = Worker(WorkerConfig(url="http://127.0.0.1:1", token="t", name="w"))
    worker.engine = engine = RecordingEngine(reads)
    worker.engine_ready.set()
    asyncio.run(worker.install_snapshot(5, Spy(split(data, 1000), 1000)))
    ((kind, read_before, exact),) = engine.seen
    assert kind is SafetensorsView and engine.version == 5, "a lazy mapping, not a loaded dict"
    assert read_before == header, "only the header was read before the engine asked for tensors"
    assert exact == [True] * 4, "each lookup read exactly that tensor's bytes"


def test_a_worker_stages_an_install_while_generation_holds_the_engine():
    events: list[tuple[str, bool]] = []
    worker = Worker(WorkerConfig(url="http://127.0.0.1:1", token="t", name="w"))

    class Engine:  # the server engine's two steps
        version = -1

        def stage(self, snapshot):
            events.append(("stage", worker.engine_lock.locked()))

        def install(self, snapshot):
            events.append(("install", worker.engine_lock.locked()))
            self.version = snapshot.version

    worker.engine = Engine()
    worker.engine_ready.set()

    async def main():
        async with worker.engine_lock:  # a generation in flight
            task = asyncio.create_task(worker.install_snapshot(3, SnapshotBytes.of(save(state()))))
            for _ in range(500):
                if events:
                    break
                await asyncio.sleep(0.01)
            assert events == [("stage", True)], "staged while the generation held the engine"
        await asyncio.wait_for(task, 10)

    asyncio.run(main())
    assert events == [("stage", True), ("install", True)] and worker.engine.version == 3


def test_an_adapter_snapshot_reaches_the_engine_as_a_dict():
    adapter = {
        "model.layers.0.q_proj" + LORA_A: torch.ones(2, 8),
        "model.layers.0.q_proj" + LORA_B: torch.ones(8, 2),
    }
    got = []

    class Engine:
        version = -1

        def install(self, snapshot):
            got.append(snapshot.state)

    worker = Worker(WorkerConfig(url="http://127.0.0.1:1", token="t", name="w"))
    worker.engine = Engine()
    worker.engine_ready.set()
    asyncio.run(worker.install_snapshot(1, SnapshotBytes.of(save(adapter))))
    assert type(got[0]) is dict and set(got[0]) == set(adapter)


def test_the_extension_consumes_weights_lazily_and_quiets_only_a_partial_install(caplog):
    pulled = []

    class FakeWorker(WeightInstaller):
        def get_model(self):
            return torch.nn.Linear(1, 1)

        def reload_weights(self, weights_iterator):
            for name, _ in weights_iterator:
                pulled.append(name)
                for logger_name, message in PARTIAL_NOISE.items():
                    logging.getLogger(logger_name).warning(message, name)

    def lazy():
        for i in range(3):
            pulled.append(f"made {i}")
            yield f"w{i}", torch.zeros(1)

    caplog.set_level(logging.WARNING)
    assert FakeWorker().echo2_install_weights(lazy(), partial=True) == 3
    assert pulled == ["made 0", "w0", "made 1", "w1", "made 2", "w2"], "one pair made per pair loaded"
    assert not caplog.records, "vLLM's warnings about layers not given are expected in a partial install"
    assert FakeWorker().echo2_install_weights({"w": torch.zeros(1)}) == 1
    assert len(caplog.records) == 2, "a full install keeps them"


def test_a_tied_alias_follows_its_weight_as_the_same_tensor():
    """A vLLM reload takes the tie apart before its loader looks for aliases, so the alias left
    out of the snapshot is handed over again (vllm_ext.py `with_tied_aliases`)."""
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(4, 2)
    model.head = torch.nn.Linear(2, 4, bias=False)
    model.head.weight = model.embed.weight
    aliases = tied_aliases(model)
    assert aliases == {"embed.weight": ["head.weight"]}
    e, n = torch.zeros(4, 2), torch.ones(1)
    out = list(with_tied_aliases([("embed.weight", e), ("norm", n)], aliases))
    assert [name for name, _ in out] == ["embed.weight", "head.weight", "norm"] and out[1][1] is e
    sent_anyway = [("embed.weight", e), ("head.weight", torch.ones(4, 2)), ("norm", n)]
    assert [name for name, _ in with_tied_aliases(sent_anyway, aliases)] == [
        "embed.weight",
        "head.weight",
        "norm",
    ]


def test_layers_to_send_adds_the_layers_vllm_fuses():
    adapted = [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.mlp.down_proj",
        "model.layers.1.mlp.up_proj",
    ]
    assert layers_to_send(adapted, LLAMA_PACKED) == {
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.mlp.down_proj",
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
    }
    assert layers_to_send(["q_proj"], {}) == {"q_proj"}


class RecordingLLM:
    def __init__(self) -> None:
        self.sent: list[tuple[list[str], dict]] = []

    def collective_rpc(self, method, args=(), kwargs=None):
        if method == "echo2_packed_modules":
            return [LLAMA_PACKED]
        assert method == "echo2_install_weights"
        (weights,) = args
        self.sent.append(([name for name, _ in weights], kwargs or {}))
        return [len(self.sent[-1][0])]

    def reset_prefix_cache(self):
        pass


def test_a_lora_install_on_vllm_sends_only_the_adapted_layers(tiny):
    """The merged weights of the adapted layers (with the layers vLLM fuses them with), not the
    whole base model; the next adapter, on fewer layers, also resends the ones going back to base."""
    model, _ = tiny
    engine = object.__new__(VLLMEngine)  # no vLLM started: its `llm` records what it is handed
    engine.llm, engine.base_model, engine.lora_base, engine.version = (
        RecordingLLM(),
        copy.deepcopy(model),
        {},
        0,
    )
    rank = 2

    def adapter(names):
        out = {}
        for name in names:
            o, i = model.get_submodule(name).weight.shape
            out[name + LORA_A], out[name + LORA_B] = torch.ones(rank, i), torch.ones(o, rank)
        return out

    q0, down1 = "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"
    engine.install(Snapshot(version=1, state=adapter([q0, down1])))
    names, kwargs = engine.llm.sent[-1]
    qkv0 = {f"model.layers.0.self_attn.{m}_proj.weight" for m in "qkv"}
    assert set(names) == qkv0 | {down1 + ".weight"} and kwargs == {"partial": True}
    engine.install(Snapshot(version=2, state=adapter([q0])))
    assert set(engine.llm.sent[-1][0]) == qkv0 | {down1 + ".weight"}, "down_proj goes back to its base"
    base = model.get_submodule(down1).weight
    assert torch.equal(engine.base_model.get_submodule(down1).weight, base)
    merged = engine.base_model.get_submodule(q0).weight
    assert torch.allclose(merged, model.get_submodule(q0).weight + rank)


def test_a_full_install_on_vllm_hands_over_an_iterator_over_the_snapshot(tiny):
    model, _ = tiny
    engine = object.__new__(VLLMEngine)
    engine.llm, engine.base_model, engine.lora_base, engine.version = RecordingLLM(), None, {}, 0
    view = SafetensorsView(save({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}))
    engine.install(Snapshot(version=4, state=view))
    names, kwargs = engine.llm.sent[-1]
    assert names == list(view) and kwargs == {"partial": False} and engine.version == 4
