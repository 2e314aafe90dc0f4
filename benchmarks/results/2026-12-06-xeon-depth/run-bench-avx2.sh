#!/bin/bash
# run-bench.sh's models and depths with both programs on their AVX2 code: Tandem with
# TANDEM_CPU_ISA=avx2 (the repacked AVX2 path), llama.cpp built for AVX2 only (build-avx2:
# -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
# -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF, benchmarks/README.md).
B=build/release/examples LB=${LLAMA_BENCH_AVX2:-/work/peer/llama_cpp_python-0.3.17/vendor/llama.cpp/build-avx2/bin/llama-bench}
SMOL=${HOME}/.cache/tandem/SmolLM2-135M-Instruct-Q4_0.gguf
OUT=${1:-/tmp/cmp-avx2}; mkdir -p "$OUT"; lscpu > "$OUT/lscpu.txt"
for m in /tmp/tinyllama-synth.gguf /tmp/qwen25-synth.gguf "$SMOL"; do
  case $m in *synth*) d=0;; *) d=0,2048,8192;; esac
  n=$(basename "$m" .gguf)
  echo "tandem $n before: $(date -u +%T) $(uptime)" >> "$OUT/uptime.log"
  TANDEM_CPU_ISA=avx2 $B/tandem-bench -m "$m" -p 512 -n 128 -d $d -t 2 -r 2 -o jsonl > "$OUT/tandem-$n.jsonl"
  echo "llama $n before:  $(date -u +%T) $(uptime)" >> "$OUT/uptime.log"
  $LB -m "$m" -p 512 -n 128 -d $d -t 2 -r 2 -fa 0,1 -o jsonl > "$OUT/llama-$n.jsonl"
  echo "llama $n after:   $(date -u +%T) $(uptime)" >> "$OUT/uptime.log"
done
