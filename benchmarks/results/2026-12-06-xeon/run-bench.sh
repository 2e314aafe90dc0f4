#!/bin/bash
# tandem-bench vs llama-bench, alternating per model, uptime around each program (from the
# repository root; quiet machine). Models: SmolLM2-135M-Instruct Q4_0 and its hub Q4_1 file
# (scripts/fetch-smollm2), Gemma 3 270M Q4_K_M (scripts/fetch-gemma3). The peer: llama-bench
# from the llama.cpp inside the PyPI sdist llama-cpp-python==0.3.17 (native Release, OpenMP).
B=build/release/examples LB=${LLAMA_BENCH:-/work/peer/llama_cpp_python-0.3.17/vendor/llama.cpp/build/bin/llama-bench}
C=${HOME}/.cache/tandem
OUT=${1:-/tmp/cmp}; mkdir -p "$OUT"; lscpu > "$OUT/lscpu.txt"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for m in "$C/SmolLM2-135M-Instruct-Q4_0.gguf" "$C/SmolLM2-135M-Instruct.Q4_1.gguf" "$C/gemma-3-270m-q4_k_m.gguf"; do
    n=$(basename "$m" .gguf)
    echo "tandem $n r$round before: $(date -u +%T) $(uptime)" >> "$OUT/uptime.log"
    $B/tandem-bench -m "$m" -p 512 -n 128 -t 2 -r 2 -o jsonl >> "$OUT/tandem-$n.jsonl"
    echo "llama $n r$round before:  $(date -u +%T) $(uptime)" >> "$OUT/uptime.log"
    $LB -m "$m" -p 512 -n 128 -t 2 -r 2 -fa 0,1 -o jsonl >> "$OUT/llama-$n.jsonl"
    echo "llama $n r$round after:   $(date -u +%T) $(uptime)" >> "$OUT/uptime.log"
  done
done
