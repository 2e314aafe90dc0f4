#!/bin/bash
# The memory-bound trace (the source article's scenario) on the article's node and on the
# Genoa node, with the server profiles' compute re-calibrated from the issue-22 kernels
# (docs/simulation.md, "Calibration 2026-12-06"); quiet machine, one sweep at a time.
# From the repository root: benchmarks/results/2026-12-06-sim/run.sh OUTDIR
B=build/release/examples/tandem-bench; M=../shared/models/aidreams260K-q4_0.gguf
OUT=${1:-/tmp/sim}; mkdir -p "$OUT"
run() { name=$1; shift; echo "== $name $(date -u +%H:%M:%S) load: $(cut -d' ' -f1-3 /proc/loadavg)"; "$B" serve -m $M "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? end $(date -u +%H:%M:%S) load: $(cut -d' ' -f1-3 /proc/loadavg)"; }
T="--trace benchmarks/traces/memory-bound.jsonl --sim-token-scale 32 -c 46080 --time-scale 20"
run memory-bound-epyc7r13 --simulate l40s+epyc7r13 $T --loads 0.35 0.5 0.75
run memory-bound-epyc32 --simulate l40s+epyc32 $T --loads 0.6 0.75
