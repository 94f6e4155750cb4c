"""One namespace of a `netns.ShapedNetwork` (`Host`: run a command in it) and the checked command
runner the network is built with (`run`, which raises `NetnsError`)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from procs import child_env
from shaping import Shape

if TYPE_CHECKING:
    from netns import ShapedNetwork


class NetnsError(RuntimeError):
    """A command that builds or shapes the network failed."""


def run(argv: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: exit {p.returncode}: {(p.stderr or p.stdout).strip()}")
    return p


@dataclass
class Host:
    """One namespace on the bridge. `veth` is the bridge-side end (root namespace); inside the
    namespace the other end is `eth0` with address `ip`."""

    name: str
    ip: str
    netns: str
    veth: str
    shape: Shape
    _net: ShapedNetwork = field(repr=False)

    def cmd(self, argv: Sequence[str]) -> list[str]:
        """`argv` prefixed to run inside this namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def python(self, *args: str) -> list[str]:
        """argv for this interpreter (the venv's python) with `args`, e.g. host.python("-m", "echo2.x")."""
        return [sys.executable, *args]

    def popen(
        self, cmd: Sequence[str] | str, *, env: Mapping[str, str | None] | None = None, **kw: Any
    ) -> subprocess.Popen:
        """Start `cmd` (argv, or a string for /bin/sh -c) inside the namespace with `child_env(env)`.
        The process leads a new session (so its whole group can be stopped) unless overridden, and
        is stopped by the network's `close()` if still running then."""
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.cmd(argv), env=child_env(env), **kw)
        self._net._procs.append(p)
        return p

    def run(
        self,
        cmd: Sequence[str] | str,
        *,
        env: Mapping[str, str | None] | None = None,
        timeout: float | None = 60.0,
        **kw: Any,
    ) -> subprocess.CompletedProcess:
        """Run `cmd` inside the namespace to completion (like subprocess.run; text output captured
        unless overridden)."""
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.cmd(argv), env=child_env(env), timeout=timeout, **kw)
