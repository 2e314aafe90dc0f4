#!/bin/bash
# after the AVX2 repack: depth 0, each model tandem-bench then llama-bench -fa 0,1
cd /work/main
B=build/release/examples LB=/work/peer/llama.cpp/build/llama-bench
SMOL=/root/.cache/tandem/SmolLM2-135M-Instruct-Q4_0.gguf
OUT=$1; mkdir -p $OUT; lscpu > $OUT/lscpu.txt
for m in /tmp/tinyllama-synth.gguf /tmp/qwen25-synth.gguf "$SMOL"; do
  n=$(basename "$m" .gguf)
  echo "tandem $n before: $(date -u +%T) $(uptime)" >> $OUT/uptime.log
  $B/tandem-bench -m "$m" -p 512 -n 128 -t 2 -r 3 -o jsonl > $OUT/tandem-$n-2.jsonl
  echo "tandem $n after:  $(date -u +%T) $(uptime)" >> $OUT/uptime.log
  $LB -m "$m" -p 512 -n 128 -t 2 -r 3 -fa 0,1 -o jsonl > $OUT/llama-$n-2.jsonl
  echo "llama $n after:   $(date -u +%T) $(uptime)" >> $OUT/uptime.log
done
echo done >> $OUT/uptime.log
