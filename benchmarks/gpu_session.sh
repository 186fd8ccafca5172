#!/usr/bin/env bash
# The GPU figures of benchmarks/timing.md ("GPU execution") as two commands of at most 10
# minutes each, for a GPU lent for about 15 minutes:
#
#   gpu_session.sh 1   the table (FedAvg and the five seed methods at 10 and 100 clients a
#                      round, the sequential executor at 10 only, 8 FedAvg runs packed at 10
#                      a round; PFLlib beside it when PFLLIB is set), the profiles of
#                      settings 1 and 2, and the features pass's memory
#   gpu_session.sh 2   `protofl reproduce fednh-table1 --scale paper --data substitute`,
#                      packed, for at most BUDGET seconds (default 540): the runs finished
#                      and the time, so that the whole table's time can be read off
#
# Each part writes markdown under OUT (default gpu-out) as it goes; a part stopped by its
# time limit keeps what it wrote. DATA: a folder with mnist/ (default data); PFLLIB: a
# PFLlib checkout prepared as in benchmarks/peers_setup.md, section 5 (optional); PY: the
# Python (default python3). DEVICE=cpu SMOKE=1 runs part 1 on gpu.py's small settings on
# the CPU, a check of this script on any machine.
set -uo pipefail
part=${1:?usage: benchmarks/gpu_session.sh 1|2}
DATA=${DATA:-data}
OUT=${OUT:-gpu-out}
PY=${PY:-python3}
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
if [ "$part" = 1 ]; then
  peers=()
  [ -n "${PFLLIB:-}" ] && peers=(--pfllib "$PFLLIB" --pfllib-python "$PY")
  limit 400 table "$PY" benchmarks/gpu.py --data-dir "$DATA" --device "$DEVICE" "${small[@]}" --only 1,2 \
    --methods fedavg,fednh,fedgela,fedproto,mpfedcl,rebafl --sequential-at 1 --no-launches --packed 8 \
    "${peers[@]}" --out "$OUT/table.md"
  for s in 1 2; do
    limit 45 "profile $s" "$PY" benchmarks/gpu_profile.py --data-dir "$DATA" --device "$DEVICE" "${small[@]}" \
      --setting "$s" --out "$OUT/profile-$s.md"
  done
  limit 90 "features memory" "$PY" benchmarks/features_memory.py --device "$DEVICE" --rows 0,4096 \
    --out "$OUT/features_memory.md"
elif [ "$part" = 2 ]; then
  limit "${BUDGET:-540}" "fednh-table1 paper packed" "$PY" -m protofl reproduce fednh-table1 --scale paper \
    --data substitute --data-dir "$DATA" --out "$OUT/fednh-table1" execution.device="$DEVICE" \
    execution.pack_runs=true 2>&1 | tail -n 40 > "$OUT/reproduce.log"
  done=$(find "$OUT/fednh-table1" -name summary.json -exec grep -l '"complete"' {} + 2>/dev/null | wc -l)
  echo "[session] runs complete: $done" | tee -a "$OUT/session.log"
else
  echo "usage: benchmarks/gpu_session.sh 1|2" >&2
  exit 2
fi
