# Source on the GPU host: stages the CuTe DSL bundle parts carried in .gpu/p*/ into /tmp/stage,
# unpacks them once both are there, and exports PYTHONPATH. Safe to source on every call.
mkdir -p /tmp/stage
for part in .gpu/p*/cutedsl-*.part*; do [ -f "$part" ] && cp --update=none "$part" /tmp/stage/; done
if [ ! -d /tmp/site/nvidia_cutlass_dsl ] && [ -f /tmp/stage/cutedsl-4.6.0-py312.tar.xz.part00 ] \
   && [ -f /tmp/stage/cutedsl-4.6.0-py312.tar.xz.part01 ]; then
  mkdir -p /tmp/site && cat /tmp/stage/cutedsl-4.6.0-py312.tar.xz.part* | tar -xJ -C /tmp/site
fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
