#!/usr/bin/env bash
# Nsight Compute report of one megakernel decode step, selected by its NVTX range: speed of light, memory,
# launch and occupancy, and where the warps stall (warp states, scheduler, and per SASS instruction the
# sampled stall reasons: SourceCounters).
# Usage on the GPU host: bash tools/gpu_ncu.sh MODEL BATCH [OPTIONS]   (OPTIONS as tools/ncu_step.py takes
# them, e.g. diag_no_copy=1; reports under $OUT: NAME.ncu-rep, NAME.csv (details), NAME_sass.csv (per instruction))
set -uo pipefail
source tools/gpu_env.sh
model=${1:-llama-3.2-1b}; batch=${2:-1}; opts=${3:-}
name="ncu_${model}_b${batch}${opts:+_${opts//[^a-z0-9]/_}}"
ncu --nvtx --nvtx-include "megakernel@decode_step/" --clock-control none \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
    --section WarpStateStats --section SchedulerStats --section SourceCounters \
    -o "$OUT/$name" -f python3 tools/ncu_step.py "$model" "$batch" $opts 2>&1 | tail -20
ncu --import "$OUT/$name.ncu-rep" --page details --csv 2>/dev/null > "$OUT/$name.csv" || true
ncu --import "$OUT/$name.ncu-rep" --page source --print-source sass --csv 2>/dev/null > "$OUT/${name}_sass.csv" || true
ncu --import "$OUT/$name.ncu-rep" --page details 2>/dev/null | grep -v "^    ---" | head -150
