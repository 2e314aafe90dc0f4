#!/bin/bash
# tandem-server vs llama-server on SmolLM2-135M-Instruct Q4_0, 2 threads, 16 slots each,
# continuous batching, 2048 context per slot; closed loops of 1, 4, 16 and 64 clients with
# benchmarks/serve_http_load.py (streaming /v1/completions, 64 requests, prompts of 96-160
# random English words (~133 tokens on both servers), 64 output tokens with ignore_eos),
# alternating the servers per concurrency.
T=build/release/examples/tandem-server LS=${LS:-/work/peer/llama_cpp_python-0.3.17/vendor/llama.cpp/build/bin/llama-server}
PY=${PY:-python3} M=$(scripts/fetch-smollm2) TR=benchmarks/results/2026-12-03-zen5/server-compare.jsonl
OUT=${1:-/tmp/srv}; mkdir -p "$OUT"
wait_up() { for _ in $(seq 300); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.2; done; return 1; }
for c in 1 4 16 64; do
  $T -m "$M" --executors cpu -t 2 -c 2048 -np 16 --max-queued 4096 --port 18181 --alias smol >"$OUT/tandem-$c.log" 2>&1 &
  wait_up http://127.0.0.1:18181 && { echo "tandem c=$c $(uptime)"; $PY benchmarks/serve_http_load.py --url http://127.0.0.1:18181/v1 --trace $TR --clients $c -n 64 > "$OUT/tandem-c$c.json"; }
  kill %1; wait
  $LS -m "$M" -t 2 -c 32768 -np 16 -cb --port 18182 -a smol >"$OUT/llama-$c.log" 2>&1 &
  wait_up http://127.0.0.1:18182 && { echo "llama c=$c $(uptime)"; $PY benchmarks/serve_http_load.py --url http://127.0.0.1:18182/v1 --trace $TR --clients $c -n 64 > "$OUT/llama-c$c.json"; }
  kill %1; wait
done
