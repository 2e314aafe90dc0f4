#!/usr/bin/env python3
"""Per round: tokens/s of each test, llama.cpp's best of fa 0/1, and the Tandem / llama.cpp ratio."""
import glob, json, os, sys
here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))  # a records folder, default this one
def load(f):
    return [json.loads(l) for l in open(f) if l.strip()]
def test_name(r):
    return (f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}") + (f" @ d{r['n_depth']}" if r.get("n_depth") else "")
for tf in sorted(glob.glob(os.path.join(here, "tandem-*.jsonl"))):
    n = os.path.basename(tf)[len("tandem-"):-len(".jsonl")]
    lf = os.path.join(here, f"llama-{n}.jsonl")
    if not os.path.exists(lf):
        continue
    tandem = {}
    for r in load(tf):
        tandem.setdefault(test_name(r), []).append(r["avg_ts"])
    llama = {}
    for r in load(lf):  # rounds in order; each round has fa 0 then fa 1 for each test
        llama.setdefault((test_name(r), bool(r.get("flash_attn"))), []).append(r["avg_ts"])
    for test, ts in tandem.items():
        cells = []
        for i, t in enumerate(ts):
            best = max(llama.get((test, fa), [float("nan")] * (i + 1))[i] for fa in (False, True))
            cells.append(f"{t:.1f} / {best:.1f} (**{t / best:.2f}x**)")
        print(f"| {n} | {test} | " + " | ".join(cells) + " |")
