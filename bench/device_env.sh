# Sourced by the device scripts: unbuffered output, $OUT, carried wheels (if any) and spruce on PYTHONPATH.
# SPRUCE_WHEELS_INSTALLED=1 (set by a script that sourced this and then starts several scripts at once, one a GPU):
# the wheels are in /tmp/site already, so the scripts do not install them over each other.
# SPRUCE_SRC: the source tree spruce is imported from (default ./src).
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  [ -n "${SPRUCE_WHEELS_INSTALLED:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${SPRUCE_SRC:-$PWD/src} PATH=/tmp/site/bin:$PATH  # carried scripts (py-spy) in /tmp/site/bin
else
  export PYTHONPATH=${SPRUCE_SRC:-$PWD/src}
fi
