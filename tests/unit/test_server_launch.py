"""A launched server's life (rollout/server_launch.py, server_guard.py) with the stub server as the
process: it is health-checked and stopped with its whole process group; a server that dies ends
generation with ServerDied; a worker killed without cleaning up leaves no server behind; the flags
a launch passes to `vllm serve`; and `echo2 worker --engine server` refusing a remote url."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from echo2.config import RolloutConfig
from echo2.rollout import vllm_args
from echo2.rollout.server_admin import Client, VLLMAdmin
from echo2.rollout.server_engine import ServerEngine
from echo2.rollout.server_launch import LaunchedServer, ServerDied, ServerStartError, launch_command

STUB = [sys.executable, str(Path(__file__).parents[1] / "server_stub.py"), "--uds", "{socket}"]
TINY = str(Path(__file__).parents[2] / "configs" / "tiny.toml")


def group_gone(pgid: int, within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def admin_of(server: LaunchedServer) -> VLLMAdmin:
    return VLLMAdmin(Client(server.url, api_key=None, timeout_s=10), install_timeout_s=10)


class Tok:
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return ""


def test_a_launched_server_is_health_checked_and_stopped_with_its_group(tmp_path):
    server = LaunchedServer.start(STUB, {}, workdir=tmp_path)
    try:
        server.wait_healthy(admin_of(server).health, timeout_s=60)
        assert server.alive()
    finally:
        server.stop()
    assert group_gone(server.pid)
    server.stop()  # idempotent


def test_a_server_that_dies_stops_generation_with_one_line(tmp_path):
    server = LaunchedServer.start(STUB, {}, workdir=tmp_path)
    admin = admin_of(server)
    server.wait_healthy(admin.health, timeout_s=60)
    engine = ServerEngine(Tok(), RolloutConfig(engine="server"), admin=admin, version=0, launched=server)
    assert engine.generate_ids([[5]], n=1)[0][0].response_ids
    os.killpg(server.pid, signal.SIGKILL)
    server.process.wait(timeout=10)
    with pytest.raises(ServerDied, match=r"^the inference server \(pid \d+\) exited with status -9"):
        engine.generate_ids([[5]], n=1)
    engine.close()
    assert group_gone(server.pid)


def test_a_server_that_never_answers_is_stopped_and_named(tmp_path):
    server = LaunchedServer.start([sys.executable, "-c", "import time; time.sleep(60)"], {}, workdir=tmp_path)
    with pytest.raises(ServerStartError, match="rollout.server.start_timeout_s = 1 s"):
        server.wait_healthy(lambda: False, timeout_s=1)
    assert group_gone(server.pid)


def test_a_worker_killed_without_cleanup_leaves_no_server(tmp_path):
    """The guard sees its parent gone (re-parented) and ends the server."""
    code = (
        "import os, signal, sys\n"
        "from echo2.rollout.server_launch import LaunchedServer\n"
        f"s = LaunchedServer.start({STUB!r}, {{}}, workdir={str(tmp_path)!r})\n"
        "print(s.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -9
    assert group_gone(int(out.stdout.split()[0]))


def test_launch_flags_follow_the_run_sampling():
    kwargs = {"max_model_len": 288, "kv_cache_memory_bytes": 2**28, "enforce_eager": True}
    cfg = RolloutConfig(engine="server", sampling="gumbel")
    argv, env = launch_command(cfg, model_dir="/m", dtype="float32", socket_path="/s", llm_kwargs=kwargs, seed=3, threads=2)
    text = " ".join(argv)
    for part in (
        "-m vllm.entrypoints.openai.api_server", "--model /m", "--uds /s", "--generation-config vllm",
        "--worker-extension-cls echo2.rollout.vllm_ext.WeightInstaller", "--logprobs-mode processed_logits",
        f"--logits-processors {vllm_args.GUMBEL_PROCESSOR}", "--enforce-eager", "--max-model-len 288",
        f"--kv-cache-memory-bytes {2**28}", "--tensor-parallel-size 1", "--seed 3",
    ):  # fmt: skip
        assert part in text, part
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert env["OMP_NUM_THREADS"] == "2"
    argv, env = launch_command(
        RolloutConfig(engine="server", top_p=0.9, sampling="multinomial"), model_dir="/m", dtype="bfloat16", socket_path="/s",
        llm_kwargs={"max_model_len": 288, "gpu_memory_utilization": 0.85}, seed=0,
    )  # fmt: skip
    assert "--logits-processors" not in argv and "raw_logprobs" in argv and "--enforce-eager" not in argv
    assert "VLLM_USE_V2_MODEL_RUNNER" not in env


def test_worker_refuses_a_remote_server_without_a_key(monkeypatch, capsys):
    from echo2.cli import main

    monkeypatch.delenv("ECHO2_SERVER_API_KEY", raising=False)
    argv = ["worker", "--coordinator", "http://127.0.0.1:1", "--token", "t", "--engine", "server",
            "--server-url", "http://10.1.2.3:8000", "--dry-run", "--config", TINY]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("echo2: config error: rollout.server.url: http://10.1.2.3:8000 is not")


def test_a_running_worker_whose_server_samples_otherwise_exits_2_with_one_line(monkeypatch, capsys):
    """The check runs when the worker builds its engine from the run config the coordinator sent
    (not at --dry-run): a server attached by url started with the wrong log-prob mode stops
    `echo2 worker` with status 2 and one line naming the key. Only the registration is faked."""
    from types import SimpleNamespace

    from server_stub import Stub

    from echo2.cli import main
    from echo2.config import load_config
    from echo2.rollout.membership import Membership

    config = load_config(TINY, {"rollout.engine": "server", "rollout.sampling": "multinomial"})

    async def registered(self, stop, *, install, work):  # the coordinator sent `config`
        self.registration = SimpleNamespace(run=SimpleNamespace(config=lambda: config))
        await work()

    monkeypatch.setattr(Membership, "serve", registered)
    stub = Stub()
    url = stub.start()
    try:
        stub.settings |= {"logprobs_mode": "raw_logits"}
        argv = ["worker", "--coordinator", "http://127.0.0.1:1", "--token", "t", "--engine", "server",
                "--server-url", url, "-q"]  # fmt: skip
        assert main(argv) == 2
    finally:
        stub.stop()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("echo2: config error: rollout.server.url: "), err
    assert "raw_logits" in err[0] and "Traceback" not in err[0]
    assert any(p == "/collective_rpc" for p, _ in stub.calls), "the check asked the server"
