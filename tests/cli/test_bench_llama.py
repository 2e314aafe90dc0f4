#!/usr/bin/env python3
"""tandem-bench speaks llama-bench: -p/-n/-d/-t lists (llama-bench's first[-last[(+|*)step]]
syntax, repeatable flags), -r, -o md|json|jsonl (and --json = -o json) with llama-bench's
record fields, the environment in every record, and bad values refused with exit 2 naming
the flag. No timing is asserted: only shapes, counts and the arithmetic between fields.

The model's parameter count and file type are read from the GGUF header here, by a parser
independent of Tandem's.

Usage: test_bench_llama.py TANDEM_BENCH SHARED_DIR   (TANDEM_SHARED wins)
"""
import json
import math
import os
import re
import statistics
import struct
import subprocess
import sys

from faults_support import Checks

bench = sys.argv[1]
shared = os.environ.get("TANDEM_SHARED", sys.argv[2])
model = os.path.join(shared, "models", "aidreams260K-q4_0.gguf")
check = Checks("tandem-bench-llama-")


def run(*args, env=None):
    e = dict(os.environ)
    e.pop("TANDEM_COMMIT", None)
    e.pop("TANDEM_CPU_ISA", None)
    e.pop("TANDEM_CPU_REPACK", None)
    e.update(env or {})
    return subprocess.run([bench, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=300, env=e)


def gguf_facts(path):
    """(sum of tensor elements, general.file_type) from a GGUF v2/v3 header."""
    with open(path, "rb") as f:
        data = f.read(1 << 22)
    off = 0

    def take(fmt):
        nonlocal off
        v = struct.unpack_from("<" + fmt, data, off)
        off += struct.calcsize("<" + fmt)
        return v[0]

    def string():
        nonlocal off
        n = take("Q")
        s = data[off:off + n].decode("utf-8", "replace")
        off += n
        return s

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(t):
        if t == 8:
            return string()
        if t == 9:
            et, n = take("I"), take("Q")
            return [value(et) for _ in range(n)]
        return take(scalar[t])

    assert data[:4] == b"GGUF"
    off = 4
    take("I")
    n_tensors, n_kv = take("Q"), take("Q")
    kv = {}
    for _ in range(n_kv):
        k = string()
        kv[k] = value(take("I"))
    n_params = 0
    for _ in range(n_tensors):
        string()
        dims = [take("Q") for _ in range(take("I"))]
        take("I")
        take("Q")
        n_params += math.prod(dims)
    return n_params, kv.get("general.file_type")


n_params, file_type = gguf_facts(model)
check("the model is Q4_0 (general.file_type 2)", file_type == 2, repr(file_type))

LLAMA_BENCH_FIELDS = ["build_commit", "build_number", "cpu_info", "gpu_info", "backends", "model_filename",
                      "model_type", "model_size", "model_n_params", "n_threads", "type_k", "type_v", "n_prompt",
                      "n_gen", "n_depth", "test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts", "samples_ns",
                      "samples_ts"]
ENV_FIELDS = ["cpu_isa", "load_avg_before", "load_avg_after"]
BANDWIDTH_FIELDS = ["decode_bytes_per_token", "read_bandwidth_bytes_per_s", "bandwidth_limit_ts",
                    "tg_fraction_of_bandwidth_limit"]


def check_record(name, r, reps):
    keys = list(r.keys())
    check(f"{name}: llama-bench fields in llama-bench's order", keys[:len(LLAMA_BENCH_FIELDS)] == LLAMA_BENCH_FIELDS,
          repr(keys))
    check(f"{name}: environment fields", all(k in r for k in ENV_FIELDS), repr(keys))
    check(f"{name}: types", isinstance(r["build_commit"], str) and r["build_commit"] != "" and
          isinstance(r["cpu_info"], str) and r["cpu_info"] != "" and r["backends"] == "CPU" and
          isinstance(r["n_prompt"], int) and isinstance(r["n_gen"], int) and isinstance(r["n_depth"], int) and
          isinstance(r["avg_ns"], int) and isinstance(r["stddev_ns"], int) and isinstance(r["avg_ts"], float),
          repr(r))
    check(f"{name}: model facts", r["model_filename"] == model and r["model_n_params"] == n_params and
          r["model_size"] > 0 and r["model_type"].startswith("llama ") and r["model_type"].endswith(" Q4_0"),
          f"{r['model_type']!r} {r['model_n_params']} vs {n_params}")
    check(f"{name}: test_time is RFC 3339 UTC", re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", r["test_time"])
          is not None, r["test_time"])
    check(f"{name}: pp xor tg", (r["n_prompt"] > 0) != (r["n_gen"] > 0), repr((r["n_prompt"], r["n_gen"])))
    ns, ts = r["samples_ns"], r["samples_ts"]
    check(f"{name}: {reps} samples", len(ns) == reps and len(ts) == reps, f"{len(ns)} {len(ts)}")
    tokens = r["n_prompt"] + r["n_gen"]
    check(f"{name}: samples_ts = tokens / samples_ns",
          all(n > 0 and math.isclose(t, 1e9 * tokens / n, rel_tol=1e-9) for n, t in zip(ns, ts)), repr((ns, ts)))
    check(f"{name}: avg_ts is the mean of samples_ts", math.isclose(r["avg_ts"], statistics.fmean(ts), rel_tol=1e-9))
    sd = statistics.stdev(ts) if len(ts) > 1 else 0.0
    check(f"{name}: stddev_ts is the sample stddev", math.isclose(r["stddev_ts"], sd, rel_tol=1e-6, abs_tol=1e-9),
          f"{r['stddev_ts']} vs {sd}")
    check(f"{name}: avg_ns is the mean of samples_ns", abs(r["avg_ns"] - statistics.fmean(ns)) <= 1.0)
    for k in ("load_avg_before", "load_avg_after"):
        check(f"{name}: {k} holds three averages", isinstance(r[k], list) and len(r[k]) == 3 and
              all(isinstance(x, (int, float)) and x >= 0 for x in r[k]), repr(r[k]))


# -o json: one record per (threads, depth, test), threads outermost, pp tests before tg.
p = run("-m", model, "-p", "16,32", "-n", "4", "-d", "0,24", "-t", "1,2", "-r", "3", "-o", "json", "--no-bandwidth")
check("-o json exits 0", p.returncode == 0, p.stderr[-400:])
records = json.loads(p.stdout) if p.returncode == 0 else []
check("-o json is an array of 12 records", isinstance(records, list) and len(records) == 12, repr(len(records)))
want = [(t, d, np, ng) for t in (1, 2) for d in (0, 24) for np, ng in ((16, 0), (32, 0), (0, 4))]
got = [(r["n_threads"], r["n_depth"], r["n_prompt"], r["n_gen"]) for r in records]
check("records in llama-bench's order", got == want, repr(got))
for i, r in enumerate(records):
    check_record(f"json record {i}", r, 3)
    check(f"json record {i}: no bandwidth fields under --no-bandwidth", not any(k in r for k in BANDWIDTH_FIELDS))
check("one build_commit, cpu_info and cpu_isa in a run",
      len({(r["build_commit"], r["cpu_info"], r["cpu_isa"]) for r in records}) == 1)

# --json is -o json; the environment: TANDEM_COMMIT and the ISA dispatched (TANDEM_CPU_ISA caps it).
p = run("-m", model, "-p", "8", "-n", "2", "-r", "2", "--json", "--no-bandwidth",
        env={"TANDEM_COMMIT": "c0ffee1", "TANDEM_CPU_ISA": "scalar"})
rs = json.loads(p.stdout) if p.returncode == 0 else []
check("--json prints the same array shape", p.returncode == 0 and len(rs) == 2, p.stderr[-300:])
for i, r in enumerate(rs):
    check_record(f"--json record {i}", r, 2)
    check(f"--json record {i}: build_commit from TANDEM_COMMIT", r["build_commit"] == "c0ffee1", r["build_commit"])
    check(f"--json record {i}: cpu_isa is the dispatched one", r["cpu_isa"] in ("scalar", "scalar+repack"), r["cpu_isa"])

# The repack of Q4_0 weights (on every ISA) shows in cpu_isa ("scalar+repack");
# TANDEM_CPU_REPACK=0 turns it off.
p = run("-m", model, "-p", "8", "-n", "0", "-r", "1", "--json", "--no-bandwidth", env={"TANDEM_CPU_ISA": "scalar"})
rs_on = json.loads(p.stdout) if p.returncode == 0 else []
p = run("-m", model, "-p", "8", "-n", "0", "-r", "1", "--json", "--no-bandwidth",
        env={"TANDEM_CPU_ISA": "scalar", "TANDEM_CPU_REPACK": "0"})
rs_off = json.loads(p.stdout) if p.returncode == 0 else []
check("cpu_isa says scalar+repack when the executor repacks", rs_on and rs_on[0]["cpu_isa"] == "scalar+repack",
      repr(rs_on[:1]))
check("cpu_isa says scalar under TANDEM_CPU_REPACK=0", rs_off and rs_off[0]["cpu_isa"] == "scalar", repr(rs_off[:1]))

# -o jsonl: one object per line, the same records.
p = run("-m", model, "-p", "8", "-n", "2", "-d", "5", "-r", "1", "-o", "jsonl", "--no-bandwidth")
lines = p.stdout.decode().splitlines()
check("-o jsonl: one line per test", p.returncode == 0 and len(lines) == 2, repr(lines))
for i, line in enumerate(lines):
    r = json.loads(line)
    check_record(f"jsonl record {i}", r, 1)
    check(f"jsonl record {i}: depth 5", r["n_depth"] == 5)

# Bandwidth: measured for tg tests only, fraction = avg_ts / (bandwidth / bytes per token).
p = run("-m", model, "-p", "8", "-n", "2", "-r", "1", "-o", "jsonl")
rs = [json.loads(line) for line in p.stdout.decode().splitlines()] if p.returncode == 0 else []
check("bandwidth run: two records", len(rs) == 2, p.stderr[-300:])
if len(rs) == 2:
    check("pp record has no bandwidth fields", not any(k in rs[0] for k in BANDWIDTH_FIELDS))
    tg = rs[1]
    check("tg record has the bandwidth fields", all(k in tg for k in BANDWIDTH_FIELDS), repr(list(tg)))
    if all(k in tg for k in BANDWIDTH_FIELDS):
        limit = tg["read_bandwidth_bytes_per_s"] / tg["decode_bytes_per_token"]
        check("bandwidth limit arithmetic", math.isclose(tg["bandwidth_limit_ts"], limit, rel_tol=1e-9) and
              math.isclose(tg["tg_fraction_of_bandwidth_limit"], tg["avg_ts"] / limit, rel_tol=1e-9))

# List syntax: ranges with + and * steps, repeated flags, 0 = no test of that kind.
for args, pps, tgs, depths in [
    (["-p", "8-32*2", "-n", "0"], [8, 16, 32], [], [0]),
    (["-p", "0", "-n", "1-5+2"], [], [1, 3, 5], [0]),
    (["-p", "8", "-p", "12", "-n", "0", "-d", "0-8+4"], [8, 12], [], [0, 4, 8]),
    (["-p", "4,6", "-n", "2", "-d", "3,1"], [4, 6], [2], [3, 1]),
]:
    p = run("-m", model, *args, "-r", "1", "-o", "jsonl", "--no-bandwidth")
    rs = [json.loads(line) for line in p.stdout.decode().splitlines()] if p.returncode == 0 else []
    want = [(d, x, 0) for d in depths for x in pps] + [(d, 0, x) for d in depths for x in tgs]
    want.sort(key=lambda w: depths.index(w[0]))
    got = [(r["n_depth"], r["n_prompt"], r["n_gen"]) for r in rs]
    check(f"lists {args}", p.returncode == 0 and got == want, f"{got} vs {want} {p.stderr[-200:]!r}")

# -o md (the default): llama-bench's columns and test names, one row per test, a footer.
p = run("-m", model, "-p", "8", "-n", "2", "-d", "0,6", "-r", "2", "--no-bandwidth")
out = p.stdout.decode()
rows = [line for line in out.splitlines() if line.startswith("| llama ")]
check("md exits 0", p.returncode == 0, p.stderr[-300:])
check("md header", re.search(r"^\| model +\| +size \| +params \| backend \| threads \|.*\| +test \| +t/s \|", out,
                             re.M) is not None, out[:300])
check("md: one row per test", len(rows) == 4, repr(rows))
names = [re.split(r"\s*\|\s*", r)[7] for r in rows]
check("md test names", names == ["pp8", "tg2", "pp8 @ d6", "tg2 @ d6"], repr(names))
check("md t/s is 'avg ± sd'", all(re.search(r"\d+\.\d\d ± \d+\.\d\d", r) for r in rows))
check("md footer names the build and CPU", re.search(r"^build: \S+ \| cpu: .+ \| isa: \S+", out, re.M) is not None)

# -ctk/-ctv: type_k / type_v in the records (f16 by default), md columns when not f16.
p = run("-m", model, "-p", "8", "-n", "2", "-r", "1", "-o", "jsonl", "--no-bandwidth")
rs = [json.loads(line) for line in p.stdout.decode().splitlines()] if p.returncode == 0 else []
check("default type_k/type_v f16", len(rs) == 2 and all(r["type_k"] == r["type_v"] == "f16" for r in rs), repr(rs))
p = run("-m", model, "-p", "8", "-n", "2", "-r", "1", "-o", "jsonl", "--no-bandwidth", "-ctk", "q8_0", "-ctv", "q8_0")
rs = [json.loads(line) for line in p.stdout.decode().splitlines()] if p.returncode == 0 else []
check("-ctk q8_0 -ctv q8_0: type_k/type_v q8_0", len(rs) == 2 and all(r["type_k"] == r["type_v"] == "q8_0"
                                                                       for r in rs), p.stderr[-300:])
p = run("-m", model, "-p", "8", "-n", "0", "-r", "1", "--no-bandwidth", "--cache-type-k", "q8_0",
        "--cache-type-v", "q8_0")
out = p.stdout.decode()
check("md with q8_0 KV has type_k and type_v columns", p.returncode == 0 and
      re.search(r"^\| model .*\| type_k \| type_v \|", out, re.M) is not None and
      re.search(r"^\| llama .*\|\s+q8_0 \|\s+q8_0 \|", out, re.M) is not None, out[:600])

# -ctk/-ctv lists (comma-separated, repeatable, as llama-bench's): every test once per KV
# type, the types in the order given; K and V item by item the same.
for args in (["-ctk", "f16,q8_0", "-ctv", "f16,q8_0"], ["-ctk", "f16", "-ctk", "q8_0", "-ctv", "f16,q8_0"]):
    p = run("-m", model, "-p", "8", "-n", "2", "-r", "1", "-o", "jsonl", "--no-bandwidth", *args)
    rs = [json.loads(line) for line in p.stdout.decode().splitlines()] if p.returncode == 0 else []
    got = [(r["type_k"], r["type_v"], r["n_prompt"], r["n_gen"]) for r in rs]
    want = [("f16", "f16", 8, 0), ("f16", "f16", 0, 2), ("q8_0", "q8_0", 8, 0), ("q8_0", "q8_0", 0, 2)]
    check(f"{args}: one record per KV type and test", got == want, f"{got!r} {p.stderr[-300:]!r}")
p = run("-m", model, "-p", "8", "-n", "0", "-r", "1", "--no-bandwidth", "-ctk", "q8_0,f32", "-ctv", "q8_0,f32")
rows = re.findall(r"^\| llama .*$", p.stdout.decode(), re.M)
kv_cols = [tuple(re.split(r"\s*\|\s*", r)[7:9]) for r in rows]
check("md: a row per KV type with its type_k/type_v", p.returncode == 0 and kv_cols == [("q8_0", "q8_0"), ("f32", "f32")],
      repr(rows))
# The bandwidth footer names the KV type of each line when the run has more than one (or a
# non-default one), so that the lines of -ctk f32,q8_0 are told apart.
p = run("-m", model, "-p", "0", "-n", "2", "-r", "1", "-ctk", "f32,q8_0", "-ctv", "f32,q8_0")
foot = re.findall(r"^tg2, \d+ threads.*read bandwidth.*$", p.stdout.decode(), re.M)
check("md footer: one bandwidth line per KV type, each named",
      p.returncode == 0 and len(foot) == 2 and ", type_k f32:" in foot[0] and ", type_k q8_0:" in foot[1],
      repr(foot) + repr(p.stderr[-300:]))
p = run("-m", model, "-p", "0", "-n", "2", "-r", "1")
foot = re.findall(r"^tg2, \d+ threads.*read bandwidth.*$", p.stdout.decode(), re.M)
check("md footer: the default f16 alone is not named", p.returncode == 0 and len(foot) == 1 and "type_k" not in foot[0],
      repr(foot))

# llama-bench's -ngl / --n-gpu-layers (a list, as -t): this mode runs the CPU executor only, so
# 0 is what it does anyway and is accepted (a list of zeros too: the same tests once per item,
# as -t 1,1 runs them twice); any other count is refused with exit 2, the GPU tools named.
base = run("-m", model, "-p", "8", "-n", "2", "-r", "1", "-o", "jsonl", "--no-bandwidth")
base_tests = [(r["n_prompt"], r["n_gen"]) for r in map(json.loads, base.stdout.decode().splitlines())] \
    if base.returncode == 0 else None
for args, times in [(["-ngl", "0"], 1), (["--n-gpu-layers", "0"], 1), (["--gpu-layers", "0"], 1),
                    (["-ngl", "0,0"], 2), (["-ngl", "0", "-ngl", "0"], 2), (["-ngl=0"], 1)]:
    p = run("-m", model, "-p", "8", "-n", "2", "-r", "1", "-o", "jsonl", "--no-bandwidth", *args)
    got = [(r["n_prompt"], r["n_gen"]) for r in map(json.loads, p.stdout.decode().splitlines())] \
        if p.returncode == 0 else None
    check(f"{args}: runs the same tests {times}x", base_tests is not None and got == base_tests * times,
          f"{got} vs {base_tests} rc {p.returncode} {p.stderr[-300:]!r}")
for args in (["-ngl", "99"], ["-ngl", "0,99"], ["-ngl", "0-8+4"], ["-ngl", "0", "-ngl", "2"],
             ["--n-gpu-layers", "1"], ["--gpu-layers", "0-1"], ["-ngl", "-1"], ["-ngl", "auto"],
             ["-ngl", "all"], ["-ngl", "99999999999"], ["-ngl", "0,auto"], ["-ngl=99"]):
    p = run("-m", model, *args)
    err = p.stderr.decode(errors="replace")
    check(f"{args}: exit 2, nothing on stdout", p.returncode == 2 and p.stdout == b"", f"rc {p.returncode}")
    check(f"{args}: says the speed mode runs on the CPU and names the GPU paths",
          "--n-gpu-layers" in err and "CPU" in err and "serve --executors" in err and "tandem-gpu-bench" in err and
          "--n-gen" not in err, repr(err[-400:]))
p = run("--help")
check("--help lists --n-gpu-layers", p.returncode == 0 and b"--n-gpu-layers" in p.stdout, repr(p.stdout[-300:]))

# Bad values: exit 2, the flag named, nothing on stdout.
for args, flag in [
    (["-p", "8,"], b"--n-prompt"),
    (["-p", "abc"], b"--n-prompt"),
    (["-p", "16-8"], b"--n-prompt"),
    (["-p", "1-8*1"], b"--n-prompt"),
    (["-p", "0-8*2"], b"--n-prompt"),
    (["-p", "2147483647"], b"--n-prompt"),
    (["-n", "1-100000"], b"--n-gen"),
    (["-n", "4;8"], b"--n-gen"),
    (["-d", "-5"], b"--n-depth"),
    (["-d", "2000000"], b"--n-depth"),
    (["-t", "600"], b"--threads"),
    (["-t", "1,,2"], b"--threads"),
    (["-ngl", "abc"], b"--n-gpu-layers"),
    (["-ngl", "0,"], b"--n-gpu-layers"),
    (["-r", "0"], b"--repetitions"),
    (["-o", "csv"], b"--output"),
    (["--json", "-o", "jsonl"], b"--json"),
    (["-ctk", "f16", "-ctv", "q8_0"], b"--cache-type-k"),
    (["-ctk", "q4_0", "-ctv", "q4_0"], b"--cache-type-k"),
    (["-ctk", "f16,q8_0"], b"--cache-type-k"),  # -ctv is f16 alone: the second pair differs
    (["-ctk", "f16,q8_0", "-ctv", "f16,f32"], b"--cache-type-k"),
    (["-ctk", "f16", "-ctv", "f16,q8_0"], b"--cache-type-k"),
    (["-ctk", "f16,", "-ctv", "f16,"], b"--cache-type-k"),
    (["-ctk", "f16,q4_0", "-ctv", "f16,q4_0"], b"--cache-type-k"),
]:
    p = run("-m", model, *args)
    check(f"bad {args}: exit 2", p.returncode == 2, f"rc {p.returncode}")
    check(f"bad {args}: names {flag.decode()}", flag in p.stderr, repr(p.stderr[-200:]))
    check(f"bad {args}: no output", p.stdout == b"", repr(p.stdout[:100]))
p = run("-m", os.path.join(shared, "models", "no-such-model.gguf"), "-o", "json")
check("missing model: exit 1 with an error", p.returncode == 1 and b"tandem-bench: error:" in p.stderr,
      f"rc {p.returncode} {p.stderr[-200:]!r}")

check.finish()
