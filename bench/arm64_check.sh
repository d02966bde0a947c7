#!/usr/bin/env bash
# arm64_check.sh [WORK] - prove `edgellm run` on aarch64 (qemu user-mode; Raspberry Pi 4 CPU by default).
#
# On the host: export a tiny seeded model with a tokenizer (fp32, plus int8/int4 via `edgellm quantize`)
# and record `edgellm run --prompt ... --temperature 0 --json` for each. Then run the same command as
# aarch64 Python under /work/shared/tools/arm64-sandbox.sh, with ONLY the runtime's dependencies installed
# (numpy, onnxruntime, tokenizers) and the source tree imported through a shim package (no install), and
# check that the greedy tokens and text are the host's.
#
# Environment: ARM64_SANDBOX (the sandbox script), ARM64_DIR (its folder, default REPO/.arm64),
# ARM64_CPUS (default "cortex-a72"; e.g. "cortex-a72 cortex-a76"). The first run downloads ~135 MB
# (Debian arm64 python, qemu, aarch64 wheels) into ARM64_DIR; later runs reuse it.
# Cost (2-core dev VM): cold sandbox setup ~30 s; then ~15-25 s per export and CPU under emulation.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${1:-/tmp/edgellm-arm64-check}"
SB="${ARM64_SANDBOX:-$(cd "$(dirname "$0")/../.." && pwd)/shared/tools/arm64-sandbox.sh}"
ARMDIR="${ARM64_DIR:-$REPO/.arm64}"
CPUS="${ARM64_CPUS:-cortex-a72}"
PY="${PYTHON:-python3}"
export ARM64_EXTRA_WHEELS="tokenizers"   # keep the same for setup and run (the sandbox stamps on it)

[ -x "$SB" ] || [ -f "$SB" ] || { echo "arm64_check: sandbox script not found: $SB" >&2; exit 1; }
start=$(date +%s)
mkdir -p "$WORK/arm"
rm -f "$WORK"/arm/*.json
names=$("$PY" "$REPO/bench/arm64_host.py" prepare "$WORK")
"$PY" "$REPO/bench/arm64_host.py" shim "$WORK" "$REPO"
echo "arm64_check: host exports ready ($names) after $(( $(date +%s) - start )) s"
bash "$SB" setup "$ARMDIR" >&2
host_attr() { "$PY" -c 'import sys; sys.path.insert(0, sys.argv[1]); import arm64_host as h; v = getattr(h, sys.argv[2]); print(v if isinstance(v, str) else " ".join(v))' "$REPO/bench" "$1"; }
prompt=$(host_attr PROMPT)
flags=$(host_attr RUN_FLAGS)
lone=$(host_attr LONE)
lone_flags=$(host_attr LONE_FLAGS)
plain=$(host_attr PLAIN)
plain_flags=$(host_attr PLAIN_FLAGS)
status=0
for cpu in $CPUS; do
  for name in $names; do
    t0=$(date +%s)
    dir="${name%"$lone"}"; extra=""
    [ "$dir" != "$name" ] && extra="$lone_flags"   # NAME-lone: the export NAME through its lone-row stack
    if [ "${name%"$plain"}" != "$name" ]; then dir="${name%"$plain"}"; extra="$plain_flags"; fi  # NAME-plain: no speculation
    # $flags is split on purpose (plain words); the prompt has spaces and stays one argument
    # from WORK: run in the repo, `python -m` would find the source tree's edgellm/ (no runtime inside) first
    if ! (cd "$WORK" && ARM64_CPU="$cpu" PYTHONPATH="$WORK/shim" bash "$SB" run "$ARMDIR" -- \
        python3 -m edgellm run "$WORK/exports/$dir" --prompt "$prompt" $flags $extra \
        > "$WORK/arm/$name.json" 2> "$WORK/arm/$name.err"); then
      echo "arm64_check: $name on $cpu FAILED:" >&2; tail -5 "$WORK/arm/$name.err" >&2; status=1
    fi
    echo "arm64_check: $name on $cpu: $(( $(date +%s) - t0 )) s"
  done
  # a first difference past NEAR_TIE: fetch the board's teacher-forced logits for those runs, then judge again
  rm -f "$WORK"/arm/*.logits.json
  first=0
  "$PY" "$REPO/bench/arm64_host.py" compare "$WORK" > "$WORK/compare.txt" || first=1
  if [ "$first" = 1 ] && [ -s "$WORK/explain.txt" ]; then
    while read -r name export; do
      (cd "$WORK" && ARM64_CPU="$cpu" PYTHONPATH="$WORK/shim" bash "$SB" run "$ARMDIR" -- \
        python3 "$REPO/bench/arm64_logits.py" "$WORK/exports/$export" "$WORK/host/$name.json" \
        > "$WORK/arm/$name.logits.json" 2> "$WORK/arm/$name.logits.err" < /dev/null) || rm -f "$WORK/arm/$name.logits.json"
      echo "arm64_check: $name: the board's teacher-forced logits fetched"
    done < "$WORK/explain.txt"
    "$PY" "$REPO/bench/arm64_host.py" compare "$WORK" || status=1
  else
    cat "$WORK/compare.txt"
    [ "$first" = 0 ] || status=1
  fi
  # are a decode step's logits bit for bit its row of a verification on this CPU? (reported: where not,
  # `--speculative auto` leaves greedy speculation off, which the NAME-plain comparison above checks)
  for name in $(host_attr ROWS); do
    got=$(cd "$WORK" && ARM64_CPU="$cpu" PYTHONPATH="$WORK/shim" bash "$SB" run "$ARMDIR" -- \
        python3 "$REPO/bench/arm64_rows.py" "$WORK/exports/$name" 2> "$WORK/arm/$name.rows.err") || got=""
    echo "arm64_check: $name rows on $cpu: ${got:-FAILED}"
    [ -n "$got" ] || status=1
  done
done
echo "arm64_check: done in $(( $(date +%s) - start )) s (status $status)"
exit $status
