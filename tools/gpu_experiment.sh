#!/usr/bin/env bash
# Run a parked experiment (profiles/experiments/NAME.patch) on the GPU host in one call: copy the working tree to
# a scratch folder, apply the patch there, and run the commands its header lists in order (the lines that start with
# "python3 tools/gpu_sweep.py", "python3 tools/sanitize.py" or "python3 -m pytest", optionally after VAR=value settings
# of their environment: each in a process of its own): the sweeps check each variant's logits against the first's,
# the sanitizer runs and the tests check the patched kernel. The tree this script runs from is not changed. Logs
# under $OUT/experiment_NAME.log. --only=1,3 runs only those commands (numbered from 1 in the header's order), so one
# patch's can be spread over calls.
# Usage on the GPU host: bash tools/gpu_experiment.sh profiles/experiments/NAME.patch [--only=N,...] [--dry-run]
set -uo pipefail
patch=${1:-}
if [ -z "$patch" ] || [ "$patch" = "-h" ] || [ "$patch" = "--help" ]; then
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; [ -n "$patch" ]; exit $?
fi
usage="usage: gpu_experiment.sh PATCH [--only=N,...] [--dry-run]"
[ -f "$patch" ] || { echo "$usage  (no such file: $patch)" >&2; exit 2; }
dry=0; only=""
for a in "${@:2}"; do
  case "$a" in
    --dry-run) dry=1 ;;
    --only=*) only=${a#--only=} ;;
    *) echo "$usage  (unknown argument: $a)" >&2; exit 2 ;;
  esac
done
commands='python3 (tools/gpu_sweep\.py|tools/sanitize\.py|-m pytest) '
mapfile -t sweeps < <(grep -E "^[[:space:]]*([A-Z][A-Z0-9_]*=[^[:space:]]+[[:space:]]+)*$commands" "$patch" |
                      sed 's/^[[:space:]]*//')
if [ ${#sweeps[@]} -eq 0 ]; then
  echo "usage: gpu_experiment.sh PATCH  ($patch lists no 'python3 tools/gpu_sweep.py'," \
       "'python3 tools/sanitize.py' or 'python3 -m pytest' line)" >&2
  exit 2
fi
if [ -n "$only" ]; then
  picked=()
  for n in ${only//,/ }; do
    if ! [[ "$n" =~ ^[0-9]+$ ]] || [ "$n" -lt 1 ] || [ "$n" -gt ${#sweeps[@]} ]; then
      echo "$usage  (--only takes command numbers 1..${#sweeps[@]}, not $n)" >&2; exit 2
    fi
    picked+=("${sweeps[$((n - 1))]}")
  done
  sweeps=("${picked[@]}")
fi
name=$(basename "$patch" .patch)
patch=$(realpath "$patch")
work=$(mktemp -d /tmp/experiment_XXXX)
tar -cf - --exclude=./.gpu --exclude=./.git --exclude=./profiles . | tar -xf - -C "$work"
if ! ( cd "$work" && git apply "$patch" ); then
  echo "gpu_experiment.sh: $patch does not apply to this tree" >&2; rm -rf "$work"; exit 2
fi
if [ "$dry" = 1 ]; then
  printf 'the patch applies; would run:\n'; printf '  %s\n' "${sweeps[@]}"; rm -rf "$work"; exit 0
fi
source tools/gpu_env.sh
export PYTHONPATH=$work${PYTHONPATH:+:$PYTHONPATH}
cd "$work" || exit 1
for s in "${sweeps[@]}"; do
  echo "## $s"
  eval "$s" 2>&1 | grep -v Warn
done | tee "$OUT/experiment_$name.log"
