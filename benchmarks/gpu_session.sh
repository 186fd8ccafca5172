#!/usr/bin/env bash
# The GPU figures of benchmarks/timing.md ("GPU execution") as commands of at most 10 minutes
# each, for a GPU lent for about 15 minutes:
#
#   gpu_session.sh 1   the table (FedAvg and the five seed methods at 10 and 100 clients a
#                      round, the sequential executor at 10 only, 8 FedAvg runs packed at 10
#                      a round; PFLlib beside it when PFLLIB is set), the profiles of
#                      settings 1 and 2, and the features pass's memory
#   gpu_session.sh 2   `protofl reproduce fednh-table1 --scale paper --data substitute`,
#                      packed, for at most BUDGET seconds (default 540): the runs finished,
#                      and every 10 s the rounds recorded so far (progress.log), so that the
#                      whole table's time can be read off
#   gpu_session.sh 3   the variants of the batched step: FedAvg and FedNH at 10 and 100 a round
#                      with each `execution.conv_as_matmul` (off, one_channel, all); FedAvg with
#                      `execution.compile` (the whole step compiled), 5 rounds (round 1's seconds
#                      hold the compilation); the setting 2 profile with one_channel, the setting
#                      1 profile compiled
#   gpu_session.sh all part 1 with its limits at FIT percent (default 100), then part 2 for what
#                      is left of TOTAL seconds (default 570): one command for one loan
#
# Each part writes markdown under OUT (default gpu-out) as it goes; a part stopped by its
# time limit keeps what it wrote. DATA: a folder with mnist/ (default data); PFLLIB: a
# PFLlib checkout prepared as in benchmarks/peers_setup.md, section 5 (optional); PY: the
# Python (default python3); REPRO: part 2's output folder (default OUT/fednh-table1);
# REPRO_EXTRA: more `key=value` overrides for part 2 (e.g. execution.compile=true).
# DEVICE=cpu SMOKE=1 runs parts 1 and 3 on gpu.py's small settings on the CPU, a check of
# this script on any machine. Each part writes at most 8 files under OUT.
set -uo pipefail
part=${1:?usage: benchmarks/gpu_session.sh 1|2|3|all}
DATA=${DATA:-data}
OUT=${OUT:-gpu-out}
PY=${PY:-python3}
REPRO=${REPRO:-$OUT/fednh-table1}
DEVICE=${DEVICE:-cuda}
export PYTHONPATH=src FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 RAY_USAGE_STATS_ENABLED=0
mkdir -p "$OUT"
small=()
[ -n "${SMOKE:-}" ] && small=(--smoke)
limit() {  # limit SECONDS NAME COMMAND...: run it, say how long it took and how it ended
  local s=$1 name=$2 t0=$SECONDS
  shift 2
  timeout "$s" "$@"
  local rc=$?
  echo "[session] $name: rc $rc after $((SECONDS - t0)) s (limit $s)" | tee -a "$OUT/session.log"
}
FIT=${FIT:-100}
fit() { echo $(( $1 * FIT / 100 )); }  # a part's limit, FIT percent of it
part1() {
  peers=()
  [ -n "${PFLLIB:-}" ] && peers=(--pfllib "$PFLLIB" --pfllib-python "$PY")
  limit "$(fit 330)" table "$PY" benchmarks/gpu.py --data-dir "$DATA" --device "$DEVICE" "${small[@]}" --only 1,2 \
    --methods fedavg,fednh,fedgela,fedproto,mpfedcl,rebafl --sequential-at 1 --no-launches --packed 8 \
    "${peers[@]}" --out "$OUT/table.md"
  for s in 1 2; do  # setting 2's profile took 89 s on an H200 (2026-11-30), data loading included
    limit "$(fit $((45 * s)))" "profile $s" "$PY" benchmarks/gpu_profile.py --data-dir "$DATA" --device "$DEVICE" \
      "${small[@]}" --setting "$s" --out "$OUT/profile-$s.md"
  done
  limit "$(fit 90)" "features memory" "$PY" benchmarks/features_memory.py --device "$DEVICE" --rows 0,4096 \
    --out "$OUT/features_memory.md"
}
part2() {  # part2 SECONDS
  local t0=$SECONDS
  (while sleep 10; do  # seconds since the start, rounds recorded by all runs together
    echo "$((SECONDS - t0)) $(cat "$REPRO"/*/*/metrics.jsonl 2>/dev/null | wc -l)"
  done) > "$OUT/progress.log" &
  local poll=$!
  limit "$1" "fednh-table1 paper packed" "$PY" -m protofl reproduce fednh-table1 --scale paper \
    --data substitute --data-dir "$DATA" --out "$REPRO" execution.device="$DEVICE" \
    execution.pack_runs=true ${REPRO_EXTRA:-} > "$OUT/reproduce.log" 2>&1
  kill "$poll"
  done=$(find "$REPRO" -name summary.json -exec grep -l '"complete"' {} + 2>/dev/null | wc -l)
  echo "[session] runs complete: $done; last progress (s, rounds): $(tail -n 1 "$OUT/progress.log")" \
    | tee -a "$OUT/session.log"
}
part3() {
  limit "$(fit 170)" "stack kernels" "$PY" benchmarks/gpu.py --data-dir "$DATA" --device "$DEVICE" "${small[@]}" \
    --only 1,2 --methods fedavg,fednh --executors batched --conv-as-matmul off,one_channel,all --no-launches \
    --out "$OUT/kernels.md"
  # each compiled run compiles the whole step once (minutes on the CPU; on a GPU not measured yet)
  limit "$(fit 210)" "compiled" "$PY" benchmarks/gpu.py --data-dir "$DATA" --device "$DEVICE" "${small[@]}" \
    --only 1,2 --methods fedavg --executors batched --compile --rounds 5 --conv-as-matmul off --no-launches \
    --out "$OUT/compile.md"
  limit "$(fit 80)" "profile 2, one_channel" "$PY" benchmarks/gpu_profile.py --data-dir "$DATA" --device "$DEVICE" \
    "${small[@]}" --setting 2 --conv-as-matmul one_channel --out "$OUT/profile-2-one_channel.md"
  limit "$(fit 110)" "profile 1, compiled" "$PY" benchmarks/gpu_profile.py --data-dir "$DATA" --device "$DEVICE" \
    "${small[@]}" --setting 1 --compile --out "$OUT/profile-1-compiled.md"
}
case "$part" in
  1) part1 ;;
  2) part2 "${BUDGET:-540}" ;;
  3) part3 ;;
  all) part1; part2 $(( ${TOTAL:-570} - SECONDS )) ;;
  *) echo "usage: benchmarks/gpu_session.sh 1|2|3|all" >&2; exit 2 ;;
esac
