"""`echo2 plan --catalog skypilot`: candidate worker types from a GPU price catalog, offline.

No SkyPilot and no network: the catalog is the small one the tests ship
(tests/fixtures/skypilot_catalog, ILLUSTRATIVE prices, in SkyPilot's CLOUD/vms.csv layout).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from echo2.cli import main as cli_main
from echo2.config import ConfigError, SkyPilotConfig
from echo2.planning.catalog import Throughputs, candidates, read_catalog, sky_catalog, sky_catalog_dir

ROOT = Path(__file__).resolve().parents[2]
CATALOG = ROOT / "tests" / "fixtures" / "skypilot_catalog"
THROUGHPUTS = ROOT / "tests" / "fixtures" / "skypilot_throughputs.toml"


# ---------------------------------------------------------------------------- catalog and plan
def test_candidates_take_the_cheapest_region_per_cloud_accelerator_and_market():
    cands = candidates(read_catalog(CATALOG), Throughputs(throughput={"RTX4090": 0.8}, max_workers=3))
    got = {c.offer.name: (c.offer.price, c.region, c.offer.count) for c in cands}
    assert got == {
        "runpod-rtx4090-od": (0.69, "CA", 3),
        "runpod-rtx4090-spot": (0.35, "CA", 3),
        "vast-rtx4090-od": (0.39, "EU", 3),
        "vast-rtx4090-spot": (0.25, "EU", 3),
    }


def test_plan_catalog_dry_run_is_offline_and_names_clouds_and_types(capsys):
    rc = cli_main(
        ["plan", "--catalog", "skypilot", "--catalog-dir", str(CATALOG), "--throughputs", str(THROUGHPUTS),
         "--t-train", "20", "--t-bcast", "6", "--batch", "64", "--staleness", "4", "--dry-run", "--json"]
    )  # fmt: skip
    plan = json.loads(capsys.readouterr().out)
    assert rc == 0 and plan["feasible"]
    assert plan["throughput"] >= plan["mu_target"]
    assert plan["rent"] and all(t["infra"][0] in ("runpod", "vast") for t in plan["rent"])
    assert sum(t["count"] * t["throughput"] for t in plan["rent"]) == pytest.approx(plan["throughput"])
    SkyPilotConfig(coordinator_url="http://x:1", workers=plan["rent"])  # pastes into the config as is


def test_plan_catalog_text_prints_the_tables_to_paste(capsys, tmp_path):
    few = tmp_path / "t.toml"
    few.write_text("max_workers = 2\n[throughput]\nRTX4090 = 0.8\n")
    args = ["plan", "--catalog", "skypilot", "--catalog-dir", str(CATALOG), "--throughputs", str(few)]
    rc = cli_main(
        [*args, "--t-train", "20", "--t-bcast", "6", "--batch", "64", "--staleness", "4", "--dry-run"]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "on vast (spot" in out and "on runpod (spot" in out  # two marketplaces: 2 + 2 workers
    assert "[[scheduler.skypilot.workers]]" in out


def test_plan_catalog_mistakes_are_config_errors(capsys, tmp_path):
    base = [
        "plan",
        "--catalog",
        "skypilot",
        "--t-train",
        "20",
        "--t-bcast",
        "6",
        "--batch",
        "64",
        "--staleness",
        "4",
    ]
    assert cli_main([*base, "--catalog-dir", str(CATALOG), "--dry-run"]) == 2  # no --throughputs
    assert cli_main([*base, "--throughputs", str(THROUGHPUTS), "--dry-run"]) == 2  # offline needs a dir
    assert cli_main([*base, "--throughputs", str(THROUGHPUTS), "--catalog-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--throughputs" in err and "--catalog-dir" in err
    with pytest.raises(ConfigError):
        read_catalog(tmp_path)


def test_the_base_install_never_imports_sky():
    code = (
        "import sys\n"
        "from echo2.cli import main\n"
        "import echo2.fleet.providers.skypilot.provider, echo2.planning.catalog, echo2.config\n"
        f"rc = main(['plan', '--catalog', 'skypilot', '--catalog-dir', {str(CATALOG)!r}, '--throughputs', "
        f"{str(THROUGHPUTS)!r}, '--t-train', '20', '--t-bcast', '6', '--batch', '64', '--staleness', '4', '--dry-run'])\n"
        "assert rc == 0, rc\n"
        "assert 'sky' not in sys.modules, 'sky imported'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ}
    )
    assert out.returncode == 0, out.stderr


def test_without_a_catalog_dir_the_plan_reads_the_catalog_skypilot_fetched(monkeypatch, tmp_path):
    monkeypatch.setenv("SKY_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="sky show-gpus"):
        sky_catalog()
    shutil.copytree(CATALOG, sky_catalog_dir())
    assert sky_catalog_dir() == tmp_path / ".sky" / "catalogs" / "v8"
    assert {r.cloud for r in sky_catalog()} == {r.cloud for r in read_catalog(CATALOG)}
