#!/usr/bin/env python3
"""Tokens/s per test and the Tandem / best-llama.cpp ratio from the JSONL records here."""
import glob, json, os
here = os.path.dirname(os.path.abspath(__file__))
def load(f):
    return [json.loads(l) for l in open(f) if l.strip()]
for tf in sorted(glob.glob(os.path.join(here, "tandem-*.jsonl"))):
    n = os.path.basename(tf)[len("tandem-"):-len(".jsonl")]
    lf = os.path.join(here, f"llama-{n}.jsonl")
    if not os.path.exists(lf):
        continue
    best = {}
    for r in load(lf):
        k = (r["n_prompt"], r["n_gen"], r.get("n_depth", 0))
        best.setdefault(k, {})["fa1" if r.get("flash_attn") else "fa0"] = (r["avg_ts"], r["stddev_ts"])
    for r in load(tf):
        k = (r["n_prompt"], r["n_gen"], r.get("n_depth", 0))
        test = (f"pp{k[0]}" if k[0] else f"tg{k[1]}") + (f" @ d{k[2]}" if k[2] else "")
        l = best.get(k, {})
        b = max(v[0] for v in l.values()) if l else float("nan")
        fa0 = "%.1f ± %.1f" % l["fa0"] if "fa0" in l else "-"
        fa1 = "%.1f ± %.1f" % l["fa1"] if "fa1" in l else "-"
        print(f"| {n} | {test} | {fa0} | {fa1} | {r['avg_ts']:.1f} ± {r['stddev_ts']:.1f} | **{r['avg_ts'] / b:.2f}** |")
