#!/usr/bin/env bash
# Re-run every paper scenario of `echo2 simulate` (scenarios/paper/) and write the JSON results and
# plots that docs/reproduction.md shows, with the wall time of each run.
#   scripts/reproduce_paper.sh            # all of them, into docs/reproduction/
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/reproduction
mkdir -p "$out"

sim() {  # NAME SCENARIO [ARGS...]: JSON to $out/NAME.json, plot to $out/NAME.png
    local name=$1 scenario=$2
    shift 2
    local t0=$SECONDS
    echo2 simulate "scenarios/paper/$scenario.toml" --json --plot "$out/$name.png" "$@" >"$out/$name.json"
    printf '%-28s %4d s   echo2 simulate scenarios/paper/%s.toml %s\n' "$name" $((SECONDS - t0)) "$scenario" "$*"
}

sim fig4 fig4-broadcast
sim sens-fig4-chunk sens-fig4-chunk
sim fig3c fig3c-bubble
sim fig3c-overlap fig3c-bubble --rollout.keep_generating=true
sim table2 table2-ablation
sim table2-overlap table2-ablation --rollout.keep_generating=true
sim table2-star9-timeline table2-ablation --series "w/o P2P (9)"
sim table2-full-timeline table2-ablation --series Full
sim sens-table2-mu sens-table2-mu
sim table4 table4-faults
sim table4-overlap table4-faults --rollout.keep_generating=true
sim table4-bcast-drop-timeline table4-faults --series "Broadcast: 1 forwarder drops out"
sim table4-bcast-slow-timeline table4-faults --series "Broadcast: 1 forwarder slows 0.5x"
sim sens-table4-storage sens-table4-storage
sim sens-table4-offset sens-table4-offset
sim sec52 sec52-cost
sim sens-sec52-mu sens-sec52-mu
# Delta snapshots (issue 24): a PREDICTION from the delta ratio measured on a 135M model
# (docs/bench/snapshot_delta.json), not something the paper measured; docs/reproduction.md, last section.
sim delta delta-snapshots
sim delta-fig3c fig3c-bubble --broadcast.delta=true
