"""A shaped virtual network for the broadcast benchmark: one Linux bridge in the root namespace and,
for each of N hosts plus one "learner" host, a network namespace joined to it by a veth pair, with
tc shaping on both directions of every host's link.

Layout (the second octet is 77 unless another live network holds 10.77; see `subnet`; a second
network in the same process gets prefix e2b-<pid>a-, then e2b-<pid>b-, ...):

    bridge  e2b-<pid>-br   10.77.0.1/16   (root namespace)
    learner e2b-<pid>-learner   10.77.0.2/16   eth0 <-veth-> e2b-<pid>-l  (on the bridge)
    host i  e2b-<pid>-h<i>      10.77.(1 + i // 250).(1 + i % 250)/16
                                eth0 <-veth-> e2b-<pid>-<i>  (on the bridge)

Every namespace has `lo` up and `eth0` up; all hosts share one L2 segment, so any host reaches any
other (and the learner) directly, and the root namespace reaches all of them via the bridge address.

Shaping. Each host's link is shaped with a token-bucket filter (TBF) on two egress points:

* upload (host -> bridge): on `eth0` inside the namespace;
* download (bridge -> host): on the bridge-side veth in the root namespace.

Rates are in Mbit/s (10^6 bit/s, as tc's `mbit`); None leaves that direction unshaped (veth speed).
A transfer from A to B is therefore capped at min(A.up, B.down).

Burst (bucket size): `burst = max(MIN_BURST, rate * BURST_TIME)`, with MIN_BURST = 64 KiB and
BURST_TIME = 1 ms (so 64 KiB up to ~500 Mbit/s, 125 KiB at 1000 Mbit/s). The floor matters because
veth hands TBF GSO super-packets of up to 64 KiB: a packet larger than the bucket makes TBF split
it in software (or drop it if it cannot be split), which costs CPU on every packet; with a
bucket of at least 64 KiB every packet fits. The 1 ms term keeps the bucket larger than what
the hrtimer watchdog can drain between wake-ups at high rates. A larger bucket makes the first
`burst` bytes of a transfer go at line rate: 64 KiB is 1.3% of a 5 MB transfer, 3% of 2 MB. Queue:
TBF's `limit` is `burst + rate * QUEUE_TIME` bytes (QUEUE_TIME = 50 ms, at least 128 KiB), enough
for TCP to keep the bucket busy without an unbounded queue (worst added delay ~50 ms + burst).

Measured with `python bench/netcheck.py --hosts 3 --mbps R` (one TCP flow, pure-Python sockets, 2-core VM, kernel 6.18, BBR): goodput / cap =
0.96 at 5 (2 MB), 20, 40, 100, 300, 500 and 1000 Mbit/s (60 MB at 500 and 1000). TBF counts
link-layer bytes, and a full segment carries 1448 payload bytes in 1514 on the wire (0.956), so
the wire rate is the cap within ~1%. A bucket of two packets instead reached only 0.89x at
1000 Mbit/s (the 1 ms term fixes that); below ~300 Mbit/s the bucket size made no difference.

Processes run inside a namespace with `Host.popen` (`ip netns exec NAME ...`); their environment is
procs.child_env's (echo2's `src` on PYTHONPATH, the venv's `bin` on PATH), so `host.python("-m",
"echo2....")` works. Everything created is deleted by `close()` (also on `with` exit), which is
idempotent; a failed setup deletes what it made before raising. Importing this module changes
nothing in the process: an entry point that wants every live network closed at exit and on
SIGTERM/SIGHUP calls `install_cleanup()` in its `main()`. The tc command lines are shaping.py's.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import warnings
from collections.abc import Sequence
from typing import Any

from netns_host import Host, NetnsError, run
from procs import stop_processes
from shaping import Rate, Shape, tbf_args

PREFIX = "e2b-"  # every namespace and link this module creates starts with it
LOCK_NAME = "echo2-netns-subnet-"  # abstract unix socket claiming a /16 for a live ShapedNetwork
IFNAMSIZ = 15


# --- process-wide bookkeeping: the live networks, closed at exit by an entry point's install_cleanup ---

_LIVE: dict[int, ShapedNetwork] = {}
_LIVE_LOCK = threading.RLock()  # taken by the signal handler too
_INSTANCES = 0
_HANDLERS_INSTALLED = False


def _close_all() -> None:
    with _LIVE_LOCK:
        nets = list(_LIVE.values())
    for net in nets:
        with contextlib.suppress(Exception):
            net.close()


def _on_signal(signum: int, frame: Any) -> None:
    _close_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def install_cleanup() -> None:
    """Close every live network at exit (atexit) and on SIGTERM/SIGHUP, for an entry point's
    `main()` to call once. The signal handlers go in only from the main thread and only where
    nobody else installed one (an application's own handler is left alone: it should exit, running
    atexit). Idempotent."""
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    _HANDLERS_INSTALLED = True
    atexit.register(_close_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:
                signal.signal(sig, _on_signal)


def _new_prefix() -> str:
    """e2b-<pid>- for the first network of a process, e2b-<pid>a-, e2b-<pid>b-, ... after."""
    global _INSTANCES
    with _LIVE_LOCK:
        k = _INSTANCES
        _INSTANCES += 1
    tag = "" if k == 0 else _letters(k - 1)
    return f"{PREFIX}{os.getpid()}{tag}-"


def _letters(k: int) -> str:
    s = ""
    while True:
        s = chr(ord("a") + k % 26) + s
        k = k // 26 - 1
        if k < 0:
            return s


_AVAILABLE: tuple[bool, str] | None = None


class ShapedNetwork:
    """N shaped hosts plus a learner host on one bridge; see the module docstring.

    `mbps` caps every host: a rate for both directions, an (up, down) pair, a Shape, or a sequence
    of those with one entry per host (a list); `learner_mbps` likewise for the learner. `subnet` is the
    first two octets ("10.77"); by default the first of 10.77 ... 10.126 that no live network (of
    any process) holds and that no root-namespace address or route uses.
    """

    def __init__(
        self,
        n_hosts: int,
        mbps: Shape | Rate | tuple[Rate, Rate] | Sequence[Shape | Rate | tuple[Rate, Rate]] = None,
        learner_mbps: Shape | Rate | tuple[Rate, Rate] = None,
        *,
        subnet: str | None = None,
        prefix: str | None = None,
    ) -> None:
        if n_hosts < 0:
            raise ValueError("n_hosts must be >= 0")
        if isinstance(mbps, list):
            if len(mbps) != n_hosts:
                raise ValueError(f"{len(mbps)} host shapes for {n_hosts} hosts")
            self._shapes = [Shape.of(s) for s in mbps]
        else:
            self._shapes = [Shape.of(mbps)] * n_hosts  # type: ignore[arg-type]
        self._learner_shape = Shape.of(learner_mbps)
        self.n_hosts = n_hosts
        self.prefix = prefix or _new_prefix()
        if not self.prefix.startswith(PREFIX):
            raise ValueError(f"prefix must start with {PREFIX!r}")
        longest = max(len(f"{self.prefix}br"), len(f"{self.prefix}{max(n_hosts - 1, 0)}"))
        if longest > IFNAMSIZ:
            raise ValueError(
                f"interface names would exceed {IFNAMSIZ} chars; use fewer hosts or a shorter prefix"
            )
        self._want_subnet = subnet
        self.subnet: str | None = None
        self.bridge = f"{self.prefix}br"
        self.hosts: list[Host] = []
        self.learner: Host | None = None
        self._procs: list[subprocess.Popen] = []
        # what exists now, in creation order; close() pops as it deletes
        self._made_links: list[str] = []
        self._made_netns: list[str] = []
        self._lock_sock: socket.socket | None = None
        self._started = False
        self._close_lock = threading.RLock()  # RLock: a signal handler may close() during close()

    # --- addresses ------------------------------------------------------------------------------

    @property
    def bridge_ip(self) -> str:
        return f"{self.subnet}.0.1"

    @property
    def learner_ip(self) -> str:
        return f"{self.subnet}.0.2"

    def host_ip(self, i: int) -> str:
        return f"{self.subnet}.{1 + i // 250}.{1 + i % 250}"

    def host(self, i: int) -> Host:
        return self.hosts[i]

    def all_hosts(self) -> list[Host]:
        """The learner first, then host 0 .. N-1."""
        return ([self.learner] if self.learner else []) + self.hosts

    # --- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> ShapedNetwork:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> ShapedNetwork:
        """Create everything; on any failure delete what was made and re-raise."""
        if self._started:
            raise RuntimeError("ShapedNetwork already started")
        self._started = True
        with _LIVE_LOCK:
            _LIVE[id(self)] = self
        try:
            self._claim_subnet()
            self._add_link(self.bridge, ["ip", "link", "add", self.bridge, "type", "bridge"])
            run(["ip", "link", "set", self.bridge, "type", "bridge", "forward_delay", "0", "stp_state", "0"])
            run(["ip", "addr", "add", f"{self.bridge_ip}/16", "dev", self.bridge])
            run(["ip", "link", "set", self.bridge, "up"])
            self.learner = self._add_host(
                "learner", f"{self.prefix}learner", f"{self.prefix}l", self.learner_ip, self._learner_shape
            )
            for i, shape in enumerate(self._shapes):
                self.hosts.append(
                    self._add_host(f"h{i}", f"{self.prefix}h{i}", f"{self.prefix}{i}", self.host_ip(i), shape)
                )
        except BaseException:
            self.close()
            raise
        return self

    def _claim_subnet(self) -> None:
        used = run(["ip", "-4", "-o", "addr", "show"]).stdout + run(["ip", "-4", "route", "show"]).stdout
        candidates = [self._want_subnet] if self._want_subnet else [f"10.{b}" for b in range(77, 127)]
        for sub in candidates:
            if not re.fullmatch(r"\d{1,3}\.\d{1,3}", sub):
                raise ValueError(f"subnet must be two octets like '10.77', got {sub!r}")
            # the claim is an abstract unix socket: held while bound, freed when closed or when the
            # process dies, and leaves no file behind
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(f"\0{LOCK_NAME}{sub}")
            except OSError:
                sock.close()
                continue
            if re.search(rf"(?<![\d.]){re.escape(sub)}\.", used):
                sock.close()  # in use by something that does not take our claim
                continue
            self._lock_sock, self.subnet = sock, sub
            return
        raise NetnsError(f"no free subnet among {candidates}")

    def _add_link(self, name: str, argv: list[str]) -> None:
        self._made_links.append(name)  # before creating: close() tolerates names that do not exist
        run(argv)

    def _add_host(self, name: str, netns: str, veth: str, ip: str, shape: Shape) -> Host:
        self._made_netns.append(netns)
        run(["ip", "netns", "add", netns])
        self._add_link(
            veth, ["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns]
        )
        run(["ip", "link", "set", veth, "master", self.bridge, "up"])
        run(["ip", "-n", netns, "link", "set", "lo", "up"])
        run(["ip", "-n", netns, "addr", "add", f"{ip}/16", "dev", "eth0"])
        run(["ip", "-n", netns, "link", "set", "eth0", "up"])
        host = Host(name=name, ip=ip, netns=netns, veth=veth, shape=Shape(), _net=self)
        self._apply(host, shape)
        return host

    def _apply(self, host: Host, shape: Shape) -> None:
        for ns_args, dev, rate, old in (
            (["-n", host.netns], "eth0", shape.up_mbps, host.shape.up_mbps),
            ([], host.veth, shape.down_mbps, host.shape.down_mbps),
        ):
            if rate is not None:
                run(["tc", *ns_args, "qdisc", "replace", "dev", dev, "root", *tbf_args(rate)])
            elif old is not None:
                run(["tc", *ns_args, "qdisc", "del", "dev", dev, "root"])
        host.shape = shape

    def reshape(self, host: Host, spec: Shape | Rate | tuple[Rate, Rate]) -> None:
        """Change one host's caps on the live network (None removes the shaping)."""
        self._apply(host, Shape.of(spec))

    def close(self) -> None:
        """Stop processes started with Host.popen, delete every link and namespace made, release the
        subnet. Idempotent; keeps going past errors and warns about what it could not delete."""
        with self._close_lock:
            errors: list[str] = []
            self._stop_procs(errors)
            for ns in self._made_netns:  # anything else still inside (children of our children)
                self._kill_netns_pids(ns)
            while self._made_links:
                name = self._made_links.pop()
                p = run(["ip", "link", "del", name], check=False)
                if p.returncode != 0 and "Cannot find device" not in p.stderr:
                    errors.append(f"ip link del {name}: {p.stderr.strip()}")
            while self._made_netns:
                ns = self._made_netns.pop()
                p = run(["ip", "netns", "del", ns], check=False)
                if p.returncode != 0 and "No such file" not in p.stderr:
                    errors.append(f"ip netns del {ns}: {p.stderr.strip()}")
            if self._lock_sock is not None:
                self._lock_sock.close()
                self._lock_sock = None
            with _LIVE_LOCK:
                _LIVE.pop(id(self), None)
            if errors:
                warnings.warn("ShapedNetwork teardown: " + "; ".join(errors), RuntimeWarning, stacklevel=2)

    def _stop_procs(self, errors: list[str]) -> None:
        errors += stop_processes(self._procs)
        self._procs.clear()

    @staticmethod
    def _kill_netns_pids(ns: str) -> None:
        p = run(["ip", "netns", "pids", ns], check=False)
        for tok in p.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(tok), signal.SIGKILL)

    # --- capability check -----------------------------------------------------------------------

    @staticmethod
    def available() -> tuple[bool, str]:
        """(True, "ok") if this process can build a shaped network (root, ip and tc present, and a
        namespace + veth + bridge + tbf can actually be made); otherwise (False, why). The probe
        deletes what it makes; the answer is cached for the process."""
        global _AVAILABLE
        if _AVAILABLE is None:
            _AVAILABLE = _probe()
        return _AVAILABLE


def _probe() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "network namespaces need root (euid is not 0)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) not found on PATH"
    try:
        with ShapedNetwork(0, learner_mbps=10, prefix=f"{PREFIX}{os.getpid()}p-"):
            pass
    except (NetnsError, OSError, subprocess.SubprocessError) as e:
        return False, f"cannot create namespace/veth/bridge/tbf: {e}"
    return True, "ok"
