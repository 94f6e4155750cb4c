"""What every config section shares: the error a user mistake raises, and the frozen, strict
pydantic base of a section (an unknown key is refused). Imports no torch."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config file, key or value the user must fix. The message names the dotted key or file."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
