#!/usr/bin/env bash
# dspark installed as a user installs it — a fresh virtualenv outside the checkout, `pip install .`
# with its dependencies — then `dspark eval --limit 1` run from another directory: the bundled
# evaluation sets and the shipped drafter must come from the installed package, not the checkout.
# Usage: bash benchmarks/check_install.sh [OUTPUT.txt]   (results: benchmarks/results/install-check.txt)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/benchmarks/results/install-check.txt}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
{
  echo "# bash benchmarks/check_install.sh — $(date -u +%Y-%m-%d), CPU flags: $(grep -o -w 'avx2\|avx512_bf16\|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  echo "\$ python3 -m venv \$WORK/venv && \$WORK/venv/bin/pip install torch==2.13.0 && \$WORK/venv/bin/pip install $ROOT"
  python3 -m venv "$WORK/venv"
  "$WORK/venv/bin/pip" install -q torch==2.13.0 2>&1 | grep -v '^WARNING: Location' || true
  "$WORK/venv/bin/pip" install -q "$ROOT" 2>&1 | grep -v '^WARNING: Location' || true
  mkdir "$WORK/elsewhere" && cd "$WORK/elsewhere"
  echo "\$ cd \$WORK/elsewhere && dspark eval --drafter auto --limit 1 --max-new-tokens 32 --out out"
  "$WORK/venv/bin/python" -c "import dspark; print('dspark imported from', dspark.__file__.replace('$WORK', '\$WORK'))"
  "$WORK/venv/bin/dspark" eval --drafter auto --limit 1 --max-new-tokens 32 --out out 2>&1 | tr '\r' '\n' \
    | grep -v '^evaluating\|^\s*$' | sed "s|$WORK|\$WORK|g"
  echo "exit status: ${PIPESTATUS[0]}"
} > "$OUT"
cat "$OUT"
