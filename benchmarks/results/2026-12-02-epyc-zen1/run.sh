#!/bin/bash
# What ran on 2026-12-02 00:26-01:16 UTC (one round; from the repository root, quiet machine):
# each model: tandem-bench, then llama-bench with flash attention off and on, uptime around each.
B=build/release/examples LB=/work/peer/llama.cpp/build/llama-bench
SMOL=$(scripts/fetch-smollm2)
OUT=${1:-/tmp/cmp}; mkdir -p "$OUT"; lscpu > "$OUT/lscpu.txt"
for m in /tmp/tinyllama-synth.gguf /tmp/qwen25-synth.gguf "$SMOL"; do
  case $m in *tinyllama*) d=0,4096;; *qwen25*) d=0;; *) d=0,2048;; esac
  n=$(basename "$m" .gguf)
  echo "tandem $n before: $(date -u +%T) $(uptime)" >> "$OUT/uptime.log"
  $B/tandem-bench -m "$m" -p 512 -n 128 -d $d -t 2 -r 3 -o jsonl > "$OUT/tandem-$n-1.jsonl"
  echo "tandem $n after:  $(date -u +%T) $(uptime)" >> "$OUT/uptime.log"
  $LB -m "$m" -p 512 -n 128 -d $d -t 2 -r 3 -fa 0,1 -o jsonl > "$OUT/llama-$n-1.jsonl"
  echo "llama $n after:   $(date -u +%T) $(uptime)" >> "$OUT/uptime.log"
done
