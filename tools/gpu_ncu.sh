#!/usr/bin/env bash
# Nsight Compute report of one megakernel decode step, selected by its NVTX range.
# Usage on the GPU host: bash tools/gpu_ncu.sh MODEL BATCH   (report under $OUT)
set -uo pipefail
source tools/gpu_env.sh
model=${1:-llama-3.2-1b}; batch=${2:-1}
ncu --nvtx --nvtx-include "megakernel@decode_step/" --clock-control none \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
    -o "$OUT/ncu_${model}_b${batch}" -f python3 tools/ncu_step.py "$model" "$batch" 2>&1 | tail -20
ncu --import "$OUT/ncu_${model}_b${batch}.ncu-rep" --page details --csv 2>/dev/null > "$OUT/ncu_${model}_b${batch}.csv" || true
ncu --import "$OUT/ncu_${model}_b${batch}.ncu-rep" --page details 2>/dev/null | head -80
