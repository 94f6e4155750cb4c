"""A worker's flags are declared once, by its config's fields (rollout/worker_config.py), and
checked once, by its validators: `echo2 worker` and `python -m echo2.rollout.broadcast_peer` offer
exactly those fields as flags, and a mistake names the flag."""

from __future__ import annotations

import argparse

import pytest

from echo2.config import ConfigError
from echo2.rollout import broadcast_peer
from echo2.rollout.worker_config import PeerConfig, WorkerConfig, add_flags, flag, from_flags, to_argv

OWN_FLAGS = {"--threads", "--dry-run", "--config", "--quiet", "--help"}
"""`echo2 worker`'s flags that are about the process, not the worker (no field of WorkerConfig)."""


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--")}


def test_echo2_worker_flags_are_the_config_fields():
    from echo2.rollout.worker_cli import add_parser

    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    worker = sub.choices["worker"]
    assert _flags(worker) - OWN_FLAGS == {flag(WorkerConfig, f) for f in WorkerConfig.model_fields}
    assert "--coordinator" in _flags(worker), "url's flag keeps its name"


def test_peer_flags_are_the_peer_config_fields(capsys):
    with pytest.raises(SystemExit):
        broadcast_peer.main(["--help"])
    shown = capsys.readouterr().out
    for field in set(PeerConfig.model_fields) - {"hardware", "price_per_hour"}:
        assert flag(PeerConfig, field) in shown
    assert "--engine" not in shown and "--emulate" not in shown


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--coordinator", "localhost:1"], "--coordinator: not an http:// or https:// URL"),
        (["--relay-port", "70000"], "--relay-port: must be in 0..65535"),
        (["--upload-mbps", "0"], "--upload-mbps: must be > 0"),
        (["--emulate", "-1"], "--emulate: must be > 0"),
        (["--relay-advertise", "bad host!"], "--relay-advertise: not a host name or address"),
        (["--learner-key", "xyz"], "--learner-key: not a key fingerprint"),
        (["--ca-file", "/nonexistent.pem"], "--ca-file: no such file"),
        (["--token", ""], "--token: missing"),
    ],
)
def test_a_mistake_names_its_flag(argv, says):
    parser = argparse.ArgumentParser()
    add_flags(parser, WorkerConfig, token="t", name="w")
    args = parser.parse_args(["--coordinator", "http://127.0.0.1:9", *argv])
    with pytest.raises(ConfigError, match=says):
        from_flags(WorkerConfig, args)


def test_the_flags_give_the_config_the_fields_say():
    parser = argparse.ArgumentParser()
    add_flags(parser, WorkerConfig, token="t", name="w")
    args = parser.parse_args(["--coordinator", "https://c:1", "--inbound", "--engine", "vllm"])
    config = from_flags(WorkerConfig, args)
    assert config == WorkerConfig(url="https://c:1", token="t", name="w", inbound=True, engine="vllm")
    assert config.relay_host == "0.0.0.0" and config.throughput is None


def test_a_config_written_as_flags_reads_back_the_same():
    """What the local fleet starts its workers with (`to_argv`), the token aside."""
    config = WorkerConfig(
        url="http://127.0.0.1:8765",
        token="t",
        name="local-0",
        price_per_hour=0.5,
        inbound=True,
        relay_host="127.0.0.1",
        emulate=3.0,
        learner_key="ab" * 16,
    )
    argv = to_argv(config)
    assert "t" not in argv and "--token" not in argv
    parser = argparse.ArgumentParser()
    add_flags(parser, WorkerConfig, token="t", name="elsewhere")
    assert from_flags(WorkerConfig, parser.parse_args(argv)) == config
