"""Where the coordinator's server thread spends its time on ingestion with the referee (cProfile of
the aiohttp loop's thread while bench/coordinator_load.py's clients push, one group per lease).

    cd bench && python profile_ingest.py --seconds 5 --top 30
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import coordinator_load as load

from echo2.coordinator.server import Coordinator


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--groups-per-lease", type=int, default=1)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    profile = cProfile.Profile()
    start, stop = Coordinator.start, Coordinator.stop

    def profiled_start(self, *a, **k):  # the profiler runs in the server's own thread
        url = start(self, *a, **k)
        self._loop.call_soon_threadsafe(profile.enable)
        return url

    def profiled_stop(self):
        self._loop.call_soon_threadsafe(profile.disable)
        time.sleep(0.2)
        stop(self)

    Coordinator.start, Coordinator.stop = profiled_start, profiled_stop
    groups, vocab = load.honest_groups(int(2000 * args.seconds))
    knobs = argparse.Namespace(
        clients=args.clients, ingest_seconds=args.seconds, groups_per_lease=args.groups_per_lease
    )
    result = load.ingest_once(groups, vocab, knobs, referee=True)
    print(f"{result['records_per_s']:.0f} records/s under the profiler")
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
