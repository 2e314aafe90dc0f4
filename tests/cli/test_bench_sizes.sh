#!/usr/bin/env bash
# Issue 15 item 5: sizes asked for are bounded before anything is allocated. A trace
# whose requests ask for 10^7, 10^9 and INT32_MAX output tokens runs through
# `tandem-bench serve` under a 3 GB address-space limit (3 GB per allocation under ASan): every request is clamped to the
# context (finish "length") and the run succeeds. (Before the clamp, the Scheduler sized
# each request's event log for its max_tokens: 16 GB for 10^9.)
# Usage: test_bench_sizes.sh TANDEM_BENCH SHARED_DIR (TANDEM_SHARED, when set, wins)
set -u
bench="$1"
shared="${TANDEM_SHARED:-$2}"
model="$shared/models/aidreams260K-q4_0.gguf"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/trace.jsonl" <<'TRACE'
{"t": 0.0, "sla": "standard", "prompt_tokens": 20, "output_tokens": 10000000}
{"t": 0.0, "sla": "interactive", "prompt_tokens": 30, "output_tokens": 1000000000}
{"t": 0.0, "sla": "batch", "prompt_tokens": 40, "output_tokens": 2147483647}
TRACE
# Under AddressSanitizer (TANDEM_SANITIZE set by CMake) an address-space limit cannot apply:
# ASan reserves terabytes of shadow memory at start. There the same bound is put on each
# allocation instead (ASan's max_allocation_size_mb; larger ones throw std::bad_alloc).
if [[ "${TANDEM_SANITIZE:-}" == *address* ]]; then
  ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}max_allocation_size_mb=3000:allocator_may_return_null=1" \
    "$bench" serve -m "$model" --executors cpu+cpu -t 2 -c 256 --trace "$tmp/trace.jsonl" \
    --json --no-progress > "$tmp/out" 2> "$tmp/err"
else
  (ulimit -v 3000000 && "$bench" serve -m "$model" --executors cpu+cpu -t 2 -c 256 --trace "$tmp/trace.jsonl" \
    --json --no-progress > "$tmp/out" 2> "$tmp/err")
fi
rc=$?
if [ "$rc" -ne 0 ]; then
  echo "FAILED: tandem-bench serve exited $rc"
  cat "$tmp/err"
  exit 1
fi
# All three finished by length (ok requests count in the throughput): 3 of 3.
if ! python3 - "$tmp/out" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
j = json.loads(text[text.index("{"):])
runs = j if isinstance(j, list) else j.get("runs", [j])
r = runs[0]
ok = r["throughput_requests_per_s"] * r["wall_s"]
assert r["requests"] == 3 and round(ok) == 3, (r["requests"], ok)
PY
then
  echo "FAILED: not every request finished"
  cat "$tmp/out"
  exit 1
fi
echo "passed: 3 oversized requests clamped to the context"
