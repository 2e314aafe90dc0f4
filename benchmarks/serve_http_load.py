#!/usr/bin/env python3
"""Load generator for an OpenAI-compatible server (tandem-server, llama-server, vLLM).

Replays a tandem-bench serve trace (benchmarks/traces/*.jsonl: "t", "prompt_tokens",
"output_tokens", "sla", optional "prefix_id"/"prefix_tokens") through the official
`openai` client, streaming, with prompts of about the trace's lengths (random English words,
one token each with a byte-level BPE vocabulary; or, with --token-ids, random token ids as
tandem-bench serve builds them) and `ignore_eos`, so every request generates exactly its
output_tokens. The mean prompt length the server counted is printed.

  --clients N   closed loop: N clients, each sends its next request when the last ends
  --replay      open loop: each request starts at its trace time "t" (tandem-bench serve's mode)

Prints one JSON object: wall time, requests/s, output tokens/s, and client-side TTFT / TPOT /
end-to-end percentiles (ms). Needs: pip install openai.
"""
import argparse
import concurrent.futures as cf
import json
import random
import threading
import time

import openai


def pct(values, p):
    if not values:
        return 0.0
    v = sorted(values)
    idx = p / 100 * (len(v) - 1)
    lo = int(idx)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (idx - lo)


def prompt_ids(item, n_vocab, salt):
    ids = [1]
    prefix = random.Random(item.get("prefix_id", ""))
    for _ in range(min(item.get("prefix_tokens", 0), item["prompt_tokens"] - 1)):
        ids.append(3 + prefix.randrange(n_vocab - 3))
    rng = random.Random(salt)
    while len(ids) < item["prompt_tokens"]:
        ids.append(3 + rng.randrange(n_vocab - 3))
    return ids


# Prompt text: common English words drawn at random; with a byte-level BPE vocabulary (SmolLM2,
# Llama 3, Qwen2) each " word" is one token, so a prompt of N words is about N tokens.
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education").split()


def prompt_text(item, salt):
    words = []
    prefix = random.Random(item.get("prefix_id", ""))
    for _ in range(min(item.get("prefix_tokens", 0), item["prompt_tokens"] - 1)):
        words.append(prefix.choice(WORDS))
    rng = random.Random(salt)
    while len(words) < item["prompt_tokens"] - 1:  # BOS is the first token
        words.append(rng.choice(WORDS))
    return " ".join(words)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--model", default=None, help="model id (default: the server's first)")
    ap.add_argument("--trace", required=True)
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--replay", action="store_true")
    ap.add_argument("-n", type=int, default=0, help="use the first N requests (0 = all)")
    ap.add_argument("--token-ids", action="store_true",
                    help="send random token-id prompts (default: random English words, which every server takes)")
    args = ap.parse_args()

    items = [json.loads(line) for line in open(args.trace) if line.strip()]
    if args.n:
        items = items[: args.n]
    client = openai.OpenAI(base_url=args.url, api_key="none", max_retries=0, timeout=600.0)
    model = client.models.list().data[0]
    n_vocab = (model.model_extra or {}).get("meta", {}).get("n_vocab", 32000)
    prompts = [prompt_ids(it, n_vocab, 1000003 + i) if args.token_ids else prompt_text(it, 1000003 + i)
               for i, it in enumerate(items)]

    ttft, tpot, e2e, out_tokens, in_tokens = [], [], [], [], []
    lock = threading.Lock()

    def run(i):
        it = items[i]
        t0 = time.perf_counter()
        first = last = None
        n = n_in = 0
        stream = client.completions.create(
            model=args.model or model.id, prompt=prompts[i], max_tokens=it["output_tokens"], temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "sla": it.get("sla", "standard")})
        for ch in stream:
            now = time.perf_counter()
            if ch.choices and ch.choices[0].text:
                first = first or now
                last = now
            if ch.usage:
                n = ch.usage.completion_tokens
                n_in = ch.usage.prompt_tokens
        with lock:
            e2e.append(time.perf_counter() - t0)
            out_tokens.append(n)
            in_tokens.append(n_in)
            if first is not None:
                ttft.append(first - t0)
                if n > 1:
                    tpot.append((last - first) / (n - 1))

    start = time.perf_counter()
    if args.replay:
        with cf.ThreadPoolExecutor(len(items)) as pool:
            futs = []
            for i, it in enumerate(items):
                time.sleep(max(0.0, start + it["t"] - time.perf_counter()))
                futs.append(pool.submit(run, i))
            for f in futs:
                f.result()
    else:
        with cf.ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(run, range(len(items))))
    wall = time.perf_counter() - start
    ms = lambda v: [round(pct(v, p) * 1000, 1) for p in (50, 95, 99)]
    print(json.dumps({"mode": "replay" if args.replay else f"{args.clients} clients", "requests": len(items),
                      "prompt_tokens_mean": round(sum(in_tokens) / len(in_tokens), 1), "wall_s": round(wall, 2), "req_per_s": round(len(items) / wall, 2),
                      "output_tok_per_s": round(sum(out_tokens) / wall, 1), "ttft_ms_p50_p95_p99": ms(ttft),
                      "tpot_ms_p50_p95_p99": ms(tpot), "e2e_ms_p50_p95_p99": ms(e2e)}))


if __name__ == "__main__":
    main()
