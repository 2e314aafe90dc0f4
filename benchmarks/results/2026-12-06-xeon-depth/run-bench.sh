#!/bin/bash
# tandem-bench vs llama-bench, alternating per model, uptime around each program (from the
# repository root; quiet machine). Models: SmolLM2-135M-Instruct Q4_0 (scripts/fetch-smollm2)
# at depths 0, 2048 and 8192; the TinyLlama-1.1B and Qwen2.5-0.5B shapes
# (build/release/examples/tandem-synth --preset tinyllama-1.1b / qwen2.5-0.5b -o /tmp/...).
# The peer: llama-bench from the llama.cpp inside the PyPI sdist llama-cpp-python==0.3.17
# ($LLAMA_BENCH overrides it: the AVX2-only build for the AVX2 rows, run with TANDEM_CPU_ISA=avx2;
# $MODELS the model list).
B=build/release/examples LB=${LLAMA_BENCH:-/work/peer/llama_cpp_python-0.3.17/vendor/llama.cpp/build/bin/llama-bench}
SMOL=${HOME}/.cache/tandem/SmolLM2-135M-Instruct-Q4_0.gguf
OUT=${1:-/tmp/cmp}; mkdir -p "$OUT"; lscpu > "$OUT/lscpu.txt"
for m in ${MODELS:-/tmp/tinyllama-synth.gguf /tmp/qwen25-synth.gguf $SMOL}; do
  case $m in *synth*) d=0;; *) d=0,2048,8192;; esac
  n=$(basename "$m" .gguf)
  echo "tandem $n before: $(date -u +%T) $(uptime)" >> "$OUT/uptime.log"
  $B/tandem-bench -m "$m" -p 512 -n 128 -d $d -t 2 -r 2 -o jsonl > "$OUT/tandem-$n.jsonl"
  echo "llama $n before:  $(date -u +%T) $(uptime)" >> "$OUT/uptime.log"
  $LB -m "$m" -p 512 -n 128 -d $d -t 2 -r 2 -fa 0,1 -o jsonl > "$OUT/llama-$n.jsonl"
  echo "llama $n after:   $(date -u +%T) $(uptime)" >> "$OUT/uptime.log"
done
