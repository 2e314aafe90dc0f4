#!/usr/bin/env python3
"""Tandem / llama.cpp ratios from run-bench.sh's records: per (model, test, depth), Tandem's
mean t/s over llama.cpp's best of flash attention off/on. Usage: summarize.py [DIR]."""
import glob
import json
import os
import sys

d = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
res = {}
for f in sorted(glob.glob(os.path.join(d, '*.jsonl'))):
    name = os.path.basename(f)[:-len('.jsonl')]
    prog, model = name.split('-', 1)
    for line in open(f):
        r = json.loads(line)
        test = 'pp%d' % r['n_prompt'] if r['n_prompt'] else 'tg%d' % r['n_gen']
        res.setdefault((model, test, r['n_depth']), {}).setdefault(prog, []).append(r)
for (model, test, depth), v in sorted(res.items()):
    if 'tandem' not in v or 'llama' not in v:
        continue
    t = v['tandem'][0]
    best = max(v['llama'], key=lambda r: r['avg_ts'])
    print(f"{model:32} {test:6} d{depth:<5} tandem {t['avg_ts']:8.1f} ± {t['stddev_ts']:5.1f} ({t.get('cpu_isa')})"
          f"  llama {best['avg_ts']:8.1f} ± {best['stddev_ts']:5.1f} (fa {int(best['flash_attn'])})"
          f"  {t['avg_ts'] / best['avg_ts']:.2f}x")
