"""What a worker process's flags say, declared once: `PeerConfig` (reaching the coordinator,
relaying snapshots: every worker) and `WorkerConfig` (a rollout worker: that and its engine), and
the two ways a worker refuses to go on at start or at a registration (`RelayStartError`,
`KeyChanged`). Pure: no I/O but the check that `ca_file` exists.

The command-line flags of `echo2 worker` and `python -m echo2.rollout.broadcast_peer` are these
fields (`add_flags`: `--relay-port` for `relay_port`, the field's docstring as its help), and a
mistake in one is found by these models' validators alone (`from_flags` raises a `ConfigError`
naming the flag); `to_argv` writes a config back as flags (the local fleet's command lines). The
run's own config comes from the coordinator.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from echo2.config import ConfigError
from echo2.wire.protocol import HOST_PATTERN


class PeerConfig(BaseModel):
    """A worker's standing with the coordinator: who it is, how it reaches the coordinator, and
    how it relays snapshots."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    url: str = Field(json_schema_extra={"flag": "coordinator", "metavar": "URL"})
    """The coordinator, e.g. http://10.0.0.2:8765."""
    token: str = Field(json_schema_extra={"metavar": "TOKEN"})
    """The run's bearer token (default $ECHO2_TOKEN); it only registers."""
    name: str
    """Worker name shown in /status."""
    price_per_hour: float = Field(0.0, json_schema_extra={"metavar": "USD"})
    """USD per hour, for cost accounting."""
    hardware: str = "cpu"
    """Free-form description shown in /status."""
    inbound: bool = False
    """This host accepts inbound connections: serve snapshot chunks to a peer (relay role) on
    --relay-host:--relay-port."""
    relay_host: str = Field("0.0.0.0", json_schema_extra={"metavar": "HOST"})
    """Address the relay binds."""
    relay_port: int = Field(0, json_schema_extra={"metavar": "PORT"})
    """Relay port (0: any free port)."""
    relay_advertise: str | None = Field(None, json_schema_extra={"metavar": "HOST"})
    """Host peers reach the relay at (default: the address the coordinator sees)."""
    upload_mbps: float | None = Field(None, json_schema_extra={"metavar": "MBPS"})
    """Cap on relay upload, Mbit/s (default: the run's broadcast.worker_upload_mbps)."""
    download_mbps: float | None = Field(None, json_schema_extra={"metavar": "MBPS"})
    """Cap on snapshot download, Mbit/s (default: the run's broadcast.worker_download_mbps)."""
    give_up_after: float = Field(300.0, json_schema_extra={"metavar": "SEC"})
    """Stop retrying an unreachable coordinator after this many seconds (the worker stops)."""
    learner_key: str | None = Field(None, json_schema_extra={"metavar": "FINGERPRINT"})
    """The learner key's fingerprint, as `echo2 run` logs it (default: trust the first key seen,
    and stop if it ever changes)."""
    ca_file: str | None = Field(None, json_schema_extra={"metavar": "PEM"})
    """CA to verify an https coordinator with (default: the system's)."""

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not re.fullmatch(r"https?://[^/\s]+/?", value):
            raise ValueError(f"not an http:// or https:// URL: {value!r}")
        return value

    @field_validator("token", mode="before")
    @classmethod
    def _token(cls, value: Any) -> Any:
        if not value:
            raise ValueError("missing (or set ECHO2_TOKEN)")
        return value

    @field_validator("upload_mbps", "download_mbps")
    @classmethod
    def _cap(cls, value: float | None) -> float | None:
        return _positive(value)

    @field_validator("relay_port")
    @classmethod
    def _port(cls, value: int) -> int:
        if not 0 <= value <= 65535:
            raise ValueError("must be in 0..65535")
        return value

    @field_validator("relay_host", "relay_advertise")
    @classmethod
    def _host(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(HOST_PATTERN, value):
            raise ValueError(f"not a host name or address: {value!r}")
        return value

    @field_validator("learner_key")
    @classmethod
    def _fingerprint(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[0-9a-fA-F]{16,64}", value):
            raise ValueError("not a key fingerprint (16 to 64 hex digits)")
        return value

    @field_validator("ca_file")
    @classmethod
    def _ca_file(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).is_file():
            raise ValueError(f"no such file {value}")
        return value


class WorkerConfig(PeerConfig):
    """A rollout worker: a peer that also generates, with an engine of its own."""

    engine: Literal["hf", "vllm", "server"] | None = None
    """The engine this worker generates with, on its GPU if it has one (default: the run's
    rollout.engine); "server": an inference server ([rollout.server], docs/engines.md)."""
    server_url: str | None = Field(None, json_schema_extra={"metavar": "URL"})
    """With --engine server: the inference server this worker drives (http://127.0.0.1:PORT or
    unix:/path; default: rollout.server.url, or one it launches when rollout.server.launch)."""
    emulate: float | None = Field(None, json_schema_extra={"metavar": "RATE"})
    """EMULATION for capacity experiments: no model, random responses at RATE trajectories/s."""
    throughput: float | None = Field(None, json_schema_extra={"metavar": "RATE"})
    """Trajectories/s this worker declares at registration (default: the --emulate rate, else a
    calibration generation is timed once the model is loaded); the coordinator replaces it with
    what the worker delivers once measured."""

    @field_validator("emulate", "throughput")
    @classmethod
    def _rate(cls, value: float | None) -> float | None:
        return _positive(value)


def _positive(value: float | None) -> float | None:
    if value is not None and not value > 0:
        raise ValueError("must be > 0")
    return value


# ---------------------------------------------------------------------------- the flags
def flag(model: type[PeerConfig], field: str) -> str:
    """The command-line flag of a field: `--relay-port` for `relay_port`."""
    extra = model.model_fields[field].json_schema_extra or {}
    return "--" + str(extra.get("flag", field)).replace("_", "-")


def add_flags(
    parser: argparse.ArgumentParser,
    model: type[PeerConfig],
    *,
    exclude: tuple[str, ...] = (),
    **defaults: Any,
) -> None:
    """One flag per field of `model` but those in `exclude`, typed, with the field's docstring as
    help; `defaults` overrides a field's default (a required field without one is a required flag)."""
    for name, info in model.model_fields.items():
        if name in exclude:
            continue
        default = defaults.get(name, None if info.is_required() else info.default)
        extra = info.json_schema_extra or {}
        kw: dict[str, Any] = {"dest": name, "help": info.description}
        kind, choices = _kind(info.annotation)
        if kind is bool:
            parser.add_argument(flag(model, name), action="store_true", **kw)
            continue
        if choices:
            kw["choices"] = choices
        elif "metavar" in extra:
            kw["metavar"] = extra["metavar"]
        required = info.is_required() and name not in defaults
        parser.add_argument(flag(model, name), type=kind, default=default, required=required, **kw)


def _kind(annotation: Any) -> tuple[type, tuple | None]:
    """The argparse type of a field's annotation (`float | None` -> float; a Literal's choices)."""
    args = [a for a in get_args(annotation) if a is not type(None)] or [annotation]
    first = args[0]
    if get_origin(first) is Literal:
        return str, get_args(first)
    return first, None


def from_flags(model: type[PeerConfig], args: argparse.Namespace, **fixed: Any) -> Any:
    """The config the parsed flags say (`fixed` adds fields no flag sets); a mistake raises
    ConfigError naming the first flag at fault."""
    values = {name: getattr(args, name) for name in model.model_fields if hasattr(args, name)}
    try:
        return model(**values, **fixed)
    except ValidationError as e:
        error = e.errors()[0]
        message = error["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{flag(model, str(error['loc'][0]))}: {message}") from None


def to_argv(config: PeerConfig) -> list[str]:
    """The flags that give `config` back through `from_flags` (a field at its default is left
    out), but not the token: it goes by $ECHO2_TOKEN, never on a command line."""
    argv: list[str] = []
    for name, info in type(config).model_fields.items():
        value = getattr(config, name)
        if name == "token" or value is False or (not info.is_required() and value == info.default):
            continue
        argv += [flag(type(config), name)] if value is True else [flag(type(config), name), str(value)]
    return argv


class RelayStartError(Exception):
    """The relay server could not listen where the flags say."""


class KeyChanged(Exception):
    """The coordinator presented a learner key other than the pinned one: the worker stops."""
