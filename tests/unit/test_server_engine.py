"""The server engine against a recording stub of the server's routes (tests/server_stub.py): request
bodies, reply checks, the install sequence and what a failed install leaves, the address rules, and
the SGLang adapter's calls. The real `vllm serve` is in tests/e2e/test_server_engine_vllm.py."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch
from server_stub import Stub

from echo2.config import ConfigError, RolloutConfig, ServerConfig
from echo2.records import Snapshot
from echo2.rollout import server_api, vllm_args
from echo2.rollout.install_digest import combine
from echo2.rollout.sampling import SamplingKeys
from echo2.rollout.server_admin import Client, InstallFailed, SGLangAdmin, VLLMAdmin, api_key_for
from echo2.rollout.server_engine import ServerEngine

CFG = RolloutConfig(engine="server", max_new_tokens=4, temperature=0.8, sampling="multinomial")
GUMBEL = RolloutConfig(engine="server", max_new_tokens=4, temperature=0.8, sampling="gumbel")


class Tok:
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.fixture
def stub():
    s = Stub()
    url = s.start()
    yield s, url
    s.stop()


def engine_on(url: str, config=CFG, admin=VLLMAdmin, version=-1) -> ServerEngine:
    client = Client(url, api_key=None, timeout_s=10)
    return ServerEngine(Tok(), config, admin=admin(client, install_timeout_s=10), version=version)


def snapshot(version: int) -> Snapshot:
    return Snapshot(version=version, state={"model.norm.weight": torch.full((4,), float(version))})


def paths(stub: Stub) -> list[str]:
    return [p for p, _ in stub.calls if p not in ("/health", "/v1/completions")]


# ---------------------------------------------------------------------------- request bodies
def test_multinomial_bodies_are_explicit_and_salted_by_version():
    bodies = server_api.completion_bodies(CFG, [[5, 6], [7]], n=3, greedy=False, keys=None, eos_id=2, version=4)
    assert [b["prompt"] for b in bodies] == [[5, 6], [7]]
    for b in bodies:
        assert b["n"] == 3 and b["temperature"] == 0.8 and b["top_p"] == 1.0 and b["top_k"] == 0
        assert b["logprobs"] == 0 and b["return_token_ids"] and b["stop_token_ids"] == [2] and b["ignore_eos"]
        assert b["cache_salt"] == "echo2-v4" and b["repetition_penalty"] == 1.0 and b["min_p"] == 0.0
    greedy = server_api.completion_bodies(CFG, [[5]], n=1, greedy=True, keys=None, eos_id=2, version=0)
    assert greedy[0]["temperature"] == 0.0


def test_gumbel_bodies_are_one_greedy_request_per_sample_with_the_in_process_keys():
    keys = SamplingKeys(seed=11, groups=("a", "b"))
    bodies = server_api.completion_bodies(GUMBEL, [[5], [6]], n=2, greedy=False, keys=keys, eos_id=2, version=1)
    assert [b["prompt"] for b in bodies] == [[5], [5], [6], [6]]
    assert all(b["n"] == 1 and b["temperature"] == 0.0 for b in bodies)
    want = vllm_args.gumbel_extra_args(keys, n=2, temperature=0.8, top_p=1.0)
    assert [b["vllm_xargs"] for b in bodies] == want
    greedy = server_api.completion_bodies(GUMBEL, [[5]], n=1, greedy=True, keys=None, eos_id=2, version=1)
    assert greedy[0]["vllm_xargs"] == {vllm_args.GREEDY_KEY: 1}
    with pytest.raises(ValueError, match="keys"):
        server_api.completion_bodies(GUMBEL, [[5]], n=1, greedy=False, keys=None, eos_id=2, version=1)


@pytest.mark.parametrize(
    "choice, why",
    [
        ({"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}}, "different lengths"),
        ({"token_ids": [1], "logprobs": {"token_logprobs": [math.nan]}}, "finite"),
        ({"token_ids": [1], "logprobs": {"token_logprobs": [0.5]}}, "finite"),
        ({"token_ids": [1], "logprobs": {"token_logprobs": [-1.0]}, "prompt_token_ids": [9]}, "prompt"),
        ({"token_ids": [1] * 9, "logprobs": {"token_logprobs": [-1.0] * 9}}, "response tokens"),
        ({"token_ids": [], "logprobs": {"token_logprobs": []}}, "response tokens"),
    ],
)
def test_a_malformed_reply_is_refused(choice, why):
    with pytest.raises(server_api.BadReply, match=why):
        server_api.samples_of({"choices": [choice]}, prompt=[5], n=1, max_tokens=4)
    with pytest.raises(server_api.BadReply, match="choices"):
        server_api.samples_of({"choices": []}, prompt=[5], n=1, max_tokens=4)


# ---------------------------------------------------------------------------- addresses
def test_a_remote_url_needs_an_api_key(monkeypatch):
    monkeypatch.delenv("ECHO2_SERVER_API_KEY", raising=False)
    for url in ("http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:2", "unix:/tmp/s.sock"):
        assert api_key_for(url, "ECHO2_SERVER_API_KEY") is None
    with pytest.raises(ConfigError, match=r"^rollout.server.url: http://10.0.0.5:8000 is not this machine's loopback"):
        api_key_for("http://10.0.0.5:8000", "ECHO2_SERVER_API_KEY")
    with pytest.raises(ConfigError, match="rollout.server.url"):
        api_key_for("ftp://x", "ECHO2_SERVER_API_KEY")
    monkeypatch.setenv("ECHO2_SERVER_API_KEY", "k")
    assert api_key_for("http://10.0.0.5:8000", "ECHO2_SERVER_API_KEY") == "k"


def test_launch_and_url_together_are_refused():
    with pytest.raises(ValueError, match="rollout.server.launch"):
        ServerConfig(launch=True, url="http://127.0.0.1:1")


# ---------------------------------------------------------------------------- the vLLM adapter
def test_generation_goes_through_the_server_with_the_installed_version_salt(stub):
    s, url = stub
    engine = engine_on(url, version=3)
    out = engine.generate_ids([[5, 6], [9]], n=2)
    assert [[smp.response_ids for smp in g] for g in out] == [[(7, 8, 9), (8, 9, 10)], [(10, 11, 12), (11, 12, 13)]]
    assert all(smp.logprobs == (-0.5,) * 3 and smp.prompt_ids == (5, 6) for smp in out[0])
    sent = [b for p, b in s.calls if p == "/v1/completions"]
    assert {b["cache_salt"] for b in sent} == {"echo2-v3"}


def test_install_pauses_loads_proves_versions_and_resumes(stub):
    s, url = stub
    engine = engine_on(url)
    engine.install(snapshot(1))
    assert engine.version == 1 and s.version == "1" and not s.paused
    assert paths(s) == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/weight_info", "/resume"]
    pause = s.calls[0][1]
    assert pause == {"mode": "wait"}
    rpc = next(b for p, b in s.calls if p == "/collective_rpc")
    assert rpc["method"] == "echo2_install_file" and rpc["args"][2] is False
    assert len(rpc["args"][1]) == 64  # the file's digest: the stub took it again and compared
    written = Path(rpc["args"][0])
    assert not written.exists() and not written.parent.exists(), "the file goes once the server has read it"
    assert not engine.staged


def test_staging_writes_the_install_file_without_pausing_the_server(stub):
    s, url = stub
    engine = engine_on(url)
    engine.stage(snapshot(1))
    assert paths(s) == [], "staging talks to no route: the server goes on serving"
    staged = engine.staged[1]
    assert staged.path.is_file() and staged.partial is False
    engine.install(snapshot(1))
    rpc = next(b for p, b in s.calls if p == "/collective_rpc")
    assert rpc["args"][:2] == [str(staged.path), staged.digest], "the staged file and digest, not a second write"
    assert engine.version == 1 and not staged.folder.exists() and not engine.staged
    assert len(engine.install_s) == 1 and len(engine.stage_s) == 1


def test_a_newer_stage_or_close_drops_the_files_never_installed(stub):
    s, url = stub
    engine = engine_on(url)
    engine.stage(snapshot(2))
    old = engine.staged[2].folder
    engine.stage(snapshot(3))
    assert not old.exists() and set(engine.staged) == {3}
    newest = engine.staged[3].folder
    engine.close()
    assert not newest.exists() and not engine.staged


@pytest.mark.parametrize(
    "route, fault, served",
    [
        ("install", "untouched", 1),  # refused before any weight changed: still version 1
        ("install", "500", -1),  # failed mid-load: weights unknown
        ("install", "mismatch", -1),  # loaded, but a parameter is not the file's
        ("/update_weight_version", "500", -1),
        ("/pause", "500", 1),  # nothing started
    ],
)
def test_a_failed_install_leaves_what_the_server_serves_and_resumes(stub, route, fault, served):
    s, url = stub
    engine = engine_on(url)
    engine.install(snapshot(1))
    s.calls.clear()
    s.faults[route] = fault
    with pytest.raises(InstallFailed) as e:
        engine.install(snapshot(2))
    assert e.value.served == served and engine.version == served
    assert not s.paused, "resumed after the failure"
    if route != "/pause":
        assert paths(s)[-1] == "/resume"
    assert isinstance(e.value, OSError), "the broadcast client retries an OSError"
    s.faults.clear()  # the next install works, and the records carry it
    engine.install(snapshot(2))
    assert engine.version == 2
    engine.generate_ids([[5]], n=1)
    assert [b for p, b in s.calls if p == "/v1/completions"][-1]["cache_salt"] == "echo2-v2"


def test_the_install_file_holds_the_received_bytes_as_they_are(stub, tmp_path):
    from safetensors.torch import save

    from echo2.broadcast.chunks import SnapshotBytes
    from echo2.rollout.safetensors_view import SafetensorsView

    s, url = stub
    data = save({"model.norm.weight": torch.arange(4.0)})
    view = SafetensorsView(SnapshotBytes([data[:7], data[7:14], data[14:]][:2] + [data[14:]], 7))
    engine = engine_on(url)
    engine.install(Snapshot(version=5, state=view))
    rpc = next(b for p, b in s.calls if p == "/collective_rpc")
    assert rpc["args"][1] == combine(len(data), [hashlib.sha256(data).digest()])


@pytest.mark.parametrize(
    "settings, config, match",
    [
        ({"logprobs_mode": "raw_logprobs"}, CFG, "--logprobs-mode raw_logprobs"),
        ({"logprobs_mode": "processed_logits"}, GUMBEL, "--logits-processors"),
    ],
)
def test_an_attached_server_must_sample_as_the_run_says(stub, settings, config, match):
    s, url = stub
    s.settings |= settings
    admin = VLLMAdmin(Client(url, api_key=None, timeout_s=10), install_timeout_s=10)
    with pytest.raises(ConfigError, match=f"^rollout.server.url: .*{match}"):
        admin.check(config)
    s.settings |= {"logprobs_mode": "processed_logits", "logits_processors": [vllm_args.GUMBEL_PROCESSOR]}
    assert admin.check(GUMBEL)["model"] == "stub-model"
    s.faults["/collective_rpc"] = "500"  # a server without echo2's worker extension
    with pytest.raises(ConfigError, match="no echo2 worker extension"):
        admin.check(GUMBEL)


# ---------------------------------------------------------------------------- the SGLang adapter
def test_sglang_install_calls_its_three_routes_in_order(stub):
    s, url = stub
    engine = engine_on(url, admin=SGLangAdmin)
    engine.install(snapshot(1))
    assert paths(s) == ["/pause_generation", "/update_weights_from_disk", "/get_weight_version", "/continue_generation"]
    calls = dict(s.calls)
    assert calls["/pause_generation"] == {"mode": "abort"}
    body = calls["/update_weights_from_disk"]
    assert body["weight_version"] == "1" and body["flush_cache"] is True
    assert "v1" in Path(body["model_path"]).name, "a directory of version 1's safetensors file"
    assert engine.version == 1


@pytest.mark.parametrize("fault, served", [("refuse", 1), ("rollback", -1)])
def test_sglang_refusal_keeps_the_old_version_and_a_rollback_does_not(stub, fault, served):
    """400 {success: false}: refused before loading keeps version 1; "Rolling back" re-reads the new
    path in SGLang (model_runner.py), so the weights are unknown."""
    s, url = stub
    engine = engine_on(url, admin=SGLangAdmin)
    engine.install(snapshot(1))
    s.faults["/update_weights_from_disk"] = fault
    with pytest.raises(InstallFailed):
        engine.install(snapshot(2))
    assert engine.version == served and not s.paused
    assert paths(s)[-1] == "/continue_generation"
    with pytest.raises(ConfigError, match="rollout.server.backend"):
        SGLangAdmin(engine.client, install_timeout_s=1).check(GUMBEL)
