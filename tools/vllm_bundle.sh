#!/usr/bin/env bash
# The vLLM 0.26.0 wheel set for the air-gapped GPU host (Python 3.12, torch 2.11.0+cu130).
#
# Here (a machine that reaches PyPI):
#   bash tools/vllm_bundle.sh build [PART_MIB]
#     downloads, with --no-deps for manylinux x86-64 CPython 3.12, every package of
#     /work/shared/gpu/vllm-0.26.0-host-requirements.txt (or $VLLM_REQUIREMENTS) except those the
#     offline LLM path does not need (EXCLUDE below), unpacks the wheels into one site folder, deletes
#     the FlashAttention-2 library from it (the H200 runs FA3), and writes one tar.xz of that folder
#     split into parts of at most PART_MIB MiB (default 53: a part and the ~9 MiB checkout stay under the
#     64 MiB a call carries), one part per folder:
#     .gpu/vllm/pNN/vllm-0.26.0-py312.tar.xz.partNN, each folder with a copy of MANIFEST (part count,
#     sha256 of the joined file, the wheel names). xz packs the unpacked site into fewer parts than
#     the wheels themselves take (their deflate is weaker), so fewer calls carry it.
#     .gpu/ is ignored by git: the parts travel to the host as carried paths, one part per call (the
#     host takes at most 64 MiB per call, the checkout included).
#
# On the GPU host, in every call (after `source tools/gpu_env.sh`):
#   source tools/vllm_bundle.sh stage
#     copies the carried part(s) to /tmp/vstage; once every part is there (and the joined sha256
#     matches MANIFEST) it unpacks the site into /tmp/vsite, once, and deletes the parts; exports PYTHONPATH with
#     /tmp/vsite after the CuTe DSL site, VLLM_ENABLE_V1_MULTIPROCESSING=0, and sets VLLM_BUNDLE_READY=1
#     once the site is complete. Safe to source on every call; it never exits the calling shell.

VLLM_BUNDLE_NAME=vllm-0.26.0-py312.tar.xz
VLLM_BUNDLE_DIR=.gpu/vllm

_vllm_bundle_build() {
  set -euo pipefail
  local part=${1:-53}
  local req=${VLLM_REQUIREMENTS:-/work/shared/gpu/vllm-0.26.0-host-requirements.txt}
  # Not needed by the offline vllm.LLM path on the H200 (seen working without them, 2026-11-30).
  local EXCLUDE="tilelang z3-solver tokenspeed-triton tokenspeed-mla humming-kernels cuda-tile sentry-sdk
                 fastapi-cloud-cli rignore fastar"
  local work; work=$(mktemp -d)
  trap "rm -rf '$work'" EXIT
  local plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
  local n
  for n in 17 27 28 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
  plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

  local reqs=() line name
  while read -r line; do
    line=${line%%#*}; line=${line//[[:space:]]/}
    [ -z "$line" ] && continue
    name=${line%%[=<>!~]*}
    if [[ " ${EXCLUDE//$'\n'/ } " == *" $name "* ]]; then continue; fi
    reqs+=("$line")
  done < "$req"
  echo "downloading ${#reqs[@]} wheels (--no-deps, manylinux x86_64, cp312)"
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/wheels" "${reqs[@]}"

  mkdir -p "$work/site"
  local w
  for w in "$work"/wheels/*.whl; do python3 -m zipfile -e "$w" "$work/site"; done
  # The FlashAttention-2 library is 305 MB of the 732 MB vLLM unpacks to; Hopper uses FA3.
  local fa2="$work/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"
  [ -f "$fa2" ] || { echo "no $fa2 in the vLLM wheel: check the vLLM version" >&2; exit 1; }
  rm -f "$fa2"
  (cd "$work/wheels" && ls *.whl > "$work/wheels.txt")
  rm -rf "$VLLM_BUNDLE_DIR"; mkdir -p "$VLLM_BUNDLE_DIR"
  tar -C "$work/site" -cf - . | xz -6 -T0 > "$work/$VLLM_BUNDLE_NAME"
  local sha; sha=$(sha256sum "$work/$VLLM_BUNDLE_NAME" | cut -d' ' -f1)
  split -b "${part}M" -d -a 2 "$work/$VLLM_BUNDLE_NAME" "$work/$VLLM_BUNDLE_NAME.part"
  local parts=("$work/$VLLM_BUNDLE_NAME".part*)
  local p i=0
  for p in "${parts[@]}"; do
    local d; d=$(printf '%s/p%02d' "$VLLM_BUNDLE_DIR" "$i")
    mkdir -p "$d"; mv "$p" "$d/"
    { echo "parts ${#parts[@]}"; echo "sha256 $sha"; echo "wheels"; cat "$work/wheels.txt"; } > "$d/MANIFEST"
    i=$((i + 1))
  done
  echo "$(wc -l < "$work/wheels.txt") wheels, sha256 of the joined parts $sha, ${#parts[@]} parts:"
  ls -l "$VLLM_BUNDLE_DIR"/p*/"$VLLM_BUNDLE_NAME".part*
}

_vllm_bundle_stage() {
  local stage=/tmp/vstage site=/tmp/vsite f
  mkdir -p "$stage"
  for f in "$VLLM_BUNDLE_DIR"/p*/"$VLLM_BUNDLE_NAME".part* "$VLLM_BUNDLE_DIR"/p*/MANIFEST; do
    [ -f "$f" ] && cp -f "$f" "$stage/"
  done
  if [ ! -f "$site/.complete" ] && [ -f "$stage/MANIFEST" ]; then
    local want have sha
    want=$(awk '$1=="parts"{print $2}' "$stage/MANIFEST")
    have=$(ls "$stage"/"$VLLM_BUNDLE_NAME".part* 2>/dev/null | wc -l)
    if [ "$have" -eq "$want" ]; then
      sha=$(cat "$stage"/"$VLLM_BUNDLE_NAME".part* | sha256sum | cut -d' ' -f1)
      if [ "$sha" != "$(awk '$1=="sha256"{print $2}' "$stage/MANIFEST")" ]; then
        echo "vllm bundle: sha256 of the joined parts does not match MANIFEST" >&2
      else
        mkdir -p "$site"
        if cat "$stage"/"$VLLM_BUNDLE_NAME".part* | tar -xJ -C "$site"; then
          # quack (a vLLM dependency) needs a newer CuTe DSL than the 4.6.0 vLLM pins; vLLM only uses
          # it to warm up MoE router GEMMs, which the tools skip when quack is absent (docs/vllm.md)
          [ -d "$site/quack" ] && mv "$site/quack" "$site/.quack-needs-newer-cutedsl"
          touch "$site/.complete"
          rm -f "$stage"/"$VLLM_BUNDLE_NAME".part*
        else
          echo "vllm bundle: unpacking into $site failed" >&2
        fi
      fi
    else
      echo "vllm bundle: $have of $want parts staged in $stage"
    fi
  fi
  case ":${PYTHONPATH:-}:" in *":$site:"*) ;; *) export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$site ;; esac
  export VLLM_ENABLE_V1_MULTIPROCESSING=0
  if [ -f "$site/.complete" ]; then export VLLM_BUNDLE_READY=1; echo "vllm bundle: ready in $site"; fi
}

case "${1:-}" in
  build) shift; (_vllm_bundle_build "$@") ;;
  stage) _vllm_bundle_stage ;;
  *) echo "usage: bash tools/vllm_bundle.sh build [PART_MIB] | source tools/vllm_bundle.sh stage" >&2 ;;
esac
