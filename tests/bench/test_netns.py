"""The shaped network of the broadcast benchmark: real namespaces, veths, a bridge and tc TBF (needs
root; skipped with the reason otherwise). A 2 MB TCP transfer between two hosts capped at 40 Mbit/s
lands near the cap, and teardown leaves no namespace or link behind, also after a failed setup."""

from __future__ import annotations

import netns
import pytest
from netcheck import leftovers, loopback_ok, measure_tcp, reachable
from netns import ShapedNetwork
from netns_host import NetnsError

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shaped_network")]

CAP = 40.0


def test_shaped_transfer_rate_and_teardown():
    with ShapedNetwork(2, CAP) as net:
        prefix = net.prefix
        assert len(leftovers(prefix)) == 1 + 2 * 3  # bridge; learner + 2 hosts: netns and veth each
        assert net.learner.ip == f"{net.subnet}.0.2"
        h0, h1 = net.host(0), net.host(1)
        assert h0.ip != h1.ip and h0.netns != h1.netns
        # loopback inside a namespace, and a host reaching the learner over the bridge
        assert loopback_ok(h0) and loopback_ok(net.learner)
        assert reachable(h1, net.learner) and reachable(net.learner, h0)
        r = measure_tcp(h0, h1, 2_000_000, timeout=30)
        assert r["bytes"] == 2_000_000
        assert 0.6 * CAP <= r["mbps"] <= 1.15 * CAP, r
    assert leftovers(prefix) == []
    net.close()  # idempotent
    assert leftovers(prefix) == []


def test_failed_setup_cleans_up(monkeypatch):
    real, calls = netns.tbf_args, []

    def failing(mbps):
        calls.append(mbps)
        if len(calls) == 4:  # the learner's two qdiscs, host 0 upload, then fail on host 0 download
            raise NetnsError("injected")
        return real(mbps)

    monkeypatch.setattr(netns, "tbf_args", failing)
    net = ShapedNetwork(2, CAP)
    with pytest.raises(NetnsError, match="injected"):
        net.start()
    assert leftovers(net.prefix) == []
    net.close()


def test_importing_the_harness_installs_no_handlers():
    """Only an entry point's main() (install_cleanup) registers atexit and SIGTERM/SIGHUP
    handlers; importing every harness module leaves the process as it was."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(netns.__file__).parent
    code = (
        "import atexit, signal, sys; sys.path.insert(0, sys.argv[1]);"
        # what the harness imports from echo2 and the libraries (logging registers its own atexit)
        "import logging, echo2.coordinator.state, echo2.broadcast.tracker, echo2.broadcast.plan;"
        "n = atexit._ncallbacks();"
        "import netns, netns_host, netcheck, broadcast, broadcast_learner, broadcast_report, procs, procstat, shaping;"
        "assert atexit._ncallbacks() == n, 'atexit';"
        "assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGHUP) == signal.SIG_DFL;"
        "netns.install_cleanup(); assert atexit._ncallbacks() == n + 1;"
        "assert signal.getsignal(signal.SIGTERM) is netns._on_signal; print('ok')"
    )
    p = subprocess.run([sys.executable, "-c", code, str(bench)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
