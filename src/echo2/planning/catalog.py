"""`echo2 plan --catalog skypilot`: rentable worker types from a GPU price catalog.

Pure: catalog rows (cloud, accelerator, count, on-demand and spot price per hour, region) joined
with the throughputs the user declares per accelerator give one candidate per (cloud, accelerator,
spot or on-demand), at its cheapest region; the planner selects from them like from a POOL.toml,
and `worker_tables` turns the chosen ones into `[[scheduler.skypilot.workers]]` tables.

The rows come from a catalog directory in SkyPilot's own layout, CLOUD/vms.csv (`read_catalog`,
offline: tests/fixtures/skypilot_catalog is a small one), by default the one SkyPilot itself keeps
(`sky_catalog`: ~/.sky/catalogs/v8, which `sky show-gpus` fetches). Never imports sky; knows no
scheduler and no SDK calls.
"""

from __future__ import annotations

import csv
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from echo2.config import ConfigError, read_toml, validation_message
from echo2.fleet.selection import WorkerOffer

COLUMNS = ("InstanceType", "AcceleratorName", "AcceleratorCount", "Price", "SpotPrice", "Region")
"""The columns read from each CLOUD/vms.csv (SkyPilot's own catalog files carry more)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CatalogRow:
    cloud: str
    instance_type: str
    accelerator_name: str
    accelerator_count: int
    price: float | None
    """USD per hour on demand (None: not offered on demand)."""
    spot_price: float | None
    """USD per hour on spot (None: no spot market)."""
    region: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """A rentable worker type: the planner's offer and where SkyPilot finds it."""

    offer: WorkerOffer
    cloud: str
    accelerator: str
    accelerator_count: int
    spot: bool
    region: str
    """The cheapest region seen (informational: the worker table lets SkyPilot choose)."""


def _price(text: str) -> float | None:
    text = text.strip()
    if not text:
        return None
    value = float(text)
    return value if math.isfinite(value) and value > 0 else None


def read_catalog(path: str | Path) -> list[CatalogRow]:
    """A catalog directory in SkyPilot's layout, DIR/CLOUD/vms.csv (what ~/.sky/catalogs/v8 holds
    once SkyPilot has fetched it; the tests ship a small one). A bad file names it and the row."""
    root = Path(path)
    files = sorted(root.glob("*/vms.csv")) if root.is_dir() else []
    if not files:
        raise ConfigError(f"--catalog-dir: no CLOUD/vms.csv under {root}")
    rows = []
    for file in files:
        with file.open(newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise ConfigError(f"{file}: missing columns {', '.join(missing)}")
            for i, r in enumerate(reader, start=2):
                if not r["AcceleratorName"].strip():
                    continue  # a CPU-only instance type
                try:
                    rows.append(
                        CatalogRow(
                            cloud=file.parent.name.lower(),
                            instance_type=r["InstanceType"].strip(),
                            accelerator_name=r["AcceleratorName"].strip(),
                            accelerator_count=int(float(r["AcceleratorCount"])),
                            price=_price(r["Price"]),
                            spot_price=_price(r["SpotPrice"]),
                            region=r["Region"].strip(),
                        )
                    )
                except (ValueError, TypeError) as e:
                    raise ConfigError(f"{file}: row {i}: {e}") from None
    return rows


SKY_CATALOG_VERSION = "v8"
"""The schema version of SkyPilot 0.14's catalog directory (~/.sky/catalogs/v8)."""


def sky_catalog_dir() -> Path:
    """Where SkyPilot keeps the price catalog it fetched: $SKY_RUNTIME_DIR (default ~)/.sky/catalogs/v8."""
    root = Path(os.environ.get("SKY_RUNTIME_DIR") or "~").expanduser()
    return root / ".sky" / "catalogs" / SKY_CATALOG_VERSION


def sky_catalog() -> list[CatalogRow]:
    """SkyPilot's own price catalog, as SkyPilot fetched it into its catalog directory (echo2
    never imports sky: SkyPilot lives in a venv of its own, docs/fleet.md)."""
    root = sky_catalog_dir()
    if not any(root.glob("*/vms.csv")):
        raise ConfigError(
            f"--catalog-dir: SkyPilot's catalog is not under {root}; fetch it with SkyPilot's own "
            "`sky show-gpus --all` (in SkyPilot's venv), or give --catalog-dir DIR"
        )
    return read_catalog(root)


class Throughputs(BaseModel):
    """THROUGHPUT.toml: trajectories/s one worker delivers per accelerator ("RTX4090", or
    "H100:2" for a worker with two), declared or measured by a calibration run."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    throughput: dict[str, float] = Field(min_length=1)
    """Accelerator[:count] -> trajectories per second of one worker."""
    max_workers: int = Field(8, ge=1)
    """At most this many workers of each candidate type."""


def load_throughputs(path: str | Path) -> Throughputs:
    try:
        t = Throughputs.model_validate(read_toml(path))
    except ValidationError as e:
        raise ConfigError(f"{path}: {validation_message(e)}") from None
    for key, value in t.throughput.items():
        if (
            not re.fullmatch(r"[A-Za-z0-9._-]+(:[1-9][0-9]*)?", key)
            or not value > 0
            or not math.isfinite(value)
        ):
            raise ConfigError(f"{path}: throughput.{key}: want ACCELERATOR[:COUNT] = trajectories/s > 0")
    return t


def _split(key: str) -> tuple[str, int]:
    name, _, count = key.partition(":")
    return name, int(count or 1)


def candidates(rows: list[CatalogRow], throughputs: Throughputs) -> list[Candidate]:
    """One candidate per (cloud, accelerator, count, spot) with a declared throughput, at its
    cheapest price; named CLOUD-ACCELERATOR[xCOUNT]-spot|od (lower case)."""
    wanted = {_split(k): v for k, v in throughputs.throughput.items()}
    best: dict[tuple[str, str, int, bool], tuple[float, CatalogRow]] = {}
    for r in rows:
        mu = wanted.get((r.accelerator_name, r.accelerator_count))
        if mu is None:
            continue
        for spot, price in ((False, r.price), (True, r.spot_price)):
            if price is None:
                continue
            key = (r.cloud, r.accelerator_name, r.accelerator_count, spot)
            if key not in best or price < best[key][0]:
                best[key] = (price, r)
    out = []
    for (cloud, acc, n, spot), (price, row) in sorted(best.items()):
        name = f"{cloud}-{acc}{f'x{n}' if n > 1 else ''}-{'spot' if spot else 'od'}".lower()
        name = re.sub(r"[^a-z0-9-]", "-", name)
        mu = wanted[(acc, n)]
        out.append(
            Candidate(
                offer=WorkerOffer(name=name, throughput=mu, price=price, count=throughputs.max_workers),
                cloud=cloud,
                accelerator=acc,
                accelerator_count=n,
                spot=spot,
                region=row.region,
            )
        )
    return out


def worker_tables(chosen: dict[str, int], cands: list[Candidate]) -> list[dict]:
    """`[[scheduler.skypilot.workers]]` tables for the types the plan rents (count: how many)."""
    by_name = {c.offer.name: c for c in cands}
    tables = []
    for name, count in chosen.items():
        if not count:
            continue
        c = by_name[name]
        tables.append(
            {
                "name": name,
                "count": count,
                "throughput": c.offer.throughput,
                "price": c.offer.price,
                "accelerator": c.accelerator,
                "accelerator_count": c.accelerator_count,
                "infra": [c.cloud],
                "spot": c.spot,
            }
        )
    return tables


def plan_from_catalog(inp, *, catalog_dir: str | None, throughputs: str) -> tuple[dict, str]:
    """`echo2 plan --catalog skypilot`: the plan over the catalog's candidates, with `rent` (the
    `[[scheduler.skypilot.workers]]` tables of the chosen types), and its human-readable report."""
    import tomli_w

    from echo2.planning.plan import Pool, WorkerOfferConfig, make_plan, render

    t = load_throughputs(throughputs)
    rows = read_catalog(catalog_dir) if catalog_dir else sky_catalog()
    cands = candidates(rows, t)
    if not cands:
        raise ConfigError(f"{throughputs}: no accelerator in it has a price in the catalog")
    pool = Pool(
        workers=[
            WorkerOfferConfig(
                name=c.offer.name, count=c.offer.count, throughput=c.offer.throughput, price=c.offer.price
            )
            for c in cands
        ]
    )
    plan = make_plan(inp, pool)
    plan["rent"] = worker_tables(plan["active"], cands)
    lines = [render(plan), "", "rent (scheduler.skypilot.workers):"]
    by_name = {c.offer.name: c for c in cands}
    for table in plan["rent"]:
        c = by_name[table["name"]]
        lines.append(
            f"  {table['count']} x {c.accelerator}:{c.accelerator_count} on {c.cloud} "
            f"({'spot' if c.spot else 'on demand'}, ${c.offer.price:.2f}/h each, cheapest in {c.region})"
        )
    lines += ["", tomli_w.dumps({"scheduler": {"skypilot": {"workers": plan["rent"]}}}).rstrip()]
    return plan, "\n".join(lines)
