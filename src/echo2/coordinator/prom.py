"""GET /metrics: the coordinator's status in the Prometheus text format (prometheus-client).

Owns the mapping of GET /status's figures to metric families, read at scrape time from the same
status the JSON endpoint serves (so the two never disagree): learner and published versions,
T_train, T_bcast, learner idle time and bubble ratio, accepted and rejected records (by reason),
buffered and consumed records by version and staleness, workers by state, and each worker's
version, throughput and price. Names start with `echo2_`; times are in seconds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_GAUGES = (
    ("learner_version", "learner_version", "Policy version of the learner."),
    ("published_version", "published_version", "Newest snapshot version published."),
    ("t_train", "t_train_seconds", "Median learner step time (T_train)."),
    ("t_bcast", "t_bcast_seconds", "Median time for a snapshot to run on 90% of live workers (T_bcast)."),
    ("t_bcast_all", "t_bcast_all_seconds", "Median time for a snapshot to run on all live workers."),
    ("learner_idle_s", "learner_idle_seconds", "Time the learner waited for rollouts."),
    ("bubble_ratio", "bubble_ratio", "Learner idle time over idle plus training time."),
    ("scheduler_target", "scheduler_target_throughput", "Scheduler target, trajectories/s."),
    ("workers_cost_per_hour", "workers_cost_usd_per_hour", "Hourly price of the active workers."),
)


class StatusCollector:
    """A prometheus-client collector over a callable returning GET /status's body."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        s = self.status()
        for key, name, doc in _GAUGES:
            if isinstance(s.get(key), int | float):
                yield GaugeMetricFamily(f"echo2_{name}", doc, value=s[key])
        if isinstance(s.get("credential_conflicts_total"), int):
            yield CounterMetricFamily(
                "echo2_credential_conflicts",
                "Worker credentials revoked because two clients used one at once.",
                value=s["credential_conflicts_total"],
            )
        if isinstance(s.get("accepted"), int | float):
            yield CounterMetricFamily("echo2_records_accepted", "Records accepted.", value=s["accepted"])
        rejected = CounterMetricFamily(
            "echo2_records_rejected", "Records rejected, by reason and stage.", labels=["reason", "where"]
        )
        for where, key in (("ingestion", "rejected"), ("buffer", "buffer_rejected")):
            for reason, n in (s.get(key) or {}).items():
                rejected.add_metric([reason, where], n)
        yield rejected
        buffered = GaugeMetricFamily(
            "echo2_buffer_records", "Buffered records by version.", labels=["version"]
        )
        for version, n in (s.get("buffer_by_version") or {}).items():
            buffered.add_metric([str(version)], n)
        yield buffered
        consumed = CounterMetricFamily(
            "echo2_consumed_records", "Records trained on, by staleness.", labels=["staleness"]
        )
        for k, n in (s.get("staleness_histogram") or {}).items():
            consumed.add_metric([str(k)], n)
        yield consumed
        workers = s.get("workers") or []
        by_state = GaugeMetricFamily("echo2_workers", "Registered workers by state.", labels=["state"])
        for state, n in sorted(Counter(w["state"] for w in workers).items()):
            by_state.add_metric([state], n)
        yield by_state
        labels = ["worker_id", "name"]
        families = {
            "version": GaugeMetricFamily(
                "echo2_worker_version", "Snapshot version a worker runs.", labels=labels
            ),
            "throughput": GaugeMetricFamily(
                "echo2_worker_throughput", "Reported worker throughput, trajectories/s.", labels=labels
            ),
            "price_per_hour": GaugeMetricFamily(
                "echo2_worker_price_usd_per_hour", "Worker price.", labels=labels
            ),
        }
        for w in workers:
            for key, family in families.items():
                if isinstance(w.get(key), int | float):
                    family.add_metric([w["worker_id"], w["name"]], w[key])
        yield from families.values()


def exposition(status: Callable[[], dict[str, Any]]) -> bytes:
    """The Prometheus text exposition of one status read."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(status))
    return generate_latest(registry)
