"""`python -m echo2.rollout.server_guard PARENT_PID -- COMMAND...`: run COMMAND (a launched inference
server) and end it when the process PARENT_PID is gone, so a worker killed without cleaning up
(SIGKILL, a crash) leaves no server behind. The guard leads the process group the worker stops as a
whole (rollout/server_launch.py); it exits with COMMAND's status. Polls once a second."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 1.0


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m echo2.rollout.server_guard PARENT_PID -- COMMAND...", file=sys.stderr)
        return 2
    parent, command = int(argv[0]), argv[2:]
    child = subprocess.Popen(command)

    def forward(signum, _frame):
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while child.poll() is None:
        if os.getppid() != parent:  # the worker is gone: this process was re-parented
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(os.getpgrp(), signal.SIGKILL)  # this group: the server and its children
            break
        time.sleep(POLL_S)
    return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
