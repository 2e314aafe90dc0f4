#!/bin/bash
# Re-runs on main d063c33 while the clean-clone CI runs (load noted per sweep).
cd /work/main
B=build/release/examples/tandem-bench; M=../shared/models/aidreams260K-q4_0.gguf
run() { name=$1; shift; echo "== $name $(date -u +%H:%M:%S) load: $(cut -d' ' -f1-3 /proc/loadavg)"; nice -n -5 "$B" serve -m $M --simulate l40s+epyc32 "$@" > /work/simruns/$name.txt 2>&1; echo "rc=$? end $(date -u +%H:%M:%S) load: $(cut -d' ' -f1-3 /proc/loadavg)"; }
run memory-bound-repeat2 --trace benchmarks/traces/memory-bound.jsonl --sim-token-scale 32 -c 46080 --time-scale 20 --loads 0.25 0.35 0.5 0.6
run batch-heavy --trace benchmarks/traces/batch-heavy.jsonl --sim-token-scale 4 --loads 0.5 0.75 1 1.25
run interactive-heavy --trace benchmarks/traces/interactive-heavy.jsonl --sim-token-scale 4 --loads 0.5 0.75 1 1.25
run long-context --trace benchmarks/traces/long-context.jsonl --sim-token-scale 32 -c 32768 --time-scale 20 --loads 0.5 0.75 1 1.5
