#!/bin/bash
# tandem-bench vs llama-bench, alternating per model, uptime around each program (from the
# repository root; quiet machine). Models: SmolLM2-135M-Instruct Q4_0 (scripts/fetch-smollm2),
# TinyLlama-1.1B and Qwen2.5-0.5B shapes (tandem-synth --preset ...).
B=build/release/examples LB=/work/peer/llama.cpp/build/llama-bench
SMOL=$(scripts/fetch-smollm2)
OUT=${1:-/tmp/cmp}; mkdir -p "$OUT"; lscpu > "$OUT/lscpu.txt"
for m in "$SMOL" /tmp/tinyllama-synth.gguf /tmp/qwen25-synth.gguf; do
  case $m in *tinyllama*|*qwen25*) d=0;; *) d=0,2048;; esac
  n=$(basename "$m" .gguf)
  echo "tandem $n before: $(date -u +%T) $(uptime)" >> "$OUT/uptime.log"
  $B/tandem-bench -m "$m" -p 512 -n 128 -d $d -t 2 -r 2 -o jsonl > "$OUT/tandem-$n.jsonl"
  echo "llama $n before:  $(date -u +%T) $(uptime)" >> "$OUT/uptime.log"
  $LB -m "$m" -p 512 -n 128 -d $d -t 2 -r 2 -fa 0,1 -o jsonl > "$OUT/llama-$n.jsonl"
  echo "llama $n after:   $(date -u +%T) $(uptime)" >> "$OUT/uptime.log"
done
