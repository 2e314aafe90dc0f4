#!/usr/bin/env python3
"""tandem-bench and tandem-synth refuse bad input where it enters (exit 2, the flag or the
trace file and line named), exit 1 when every request failed or stdout cannot be written,
and never replace a device with a regular file; tandem-quantize refuses to write over its
own input and bad flags with exit 2.

tandem-perplexity: bad flags exit 2, a missing or too short text exits 1 naming the cause,
its output has llama-perplexity's shape, a full or closed stdout exits 1.

Usage: test_tools_faults.py TANDEM_BENCH TANDEM_SYNTH SHARED_DIR TANDEM_QUANTIZE TANDEM_PERPLEXITY
(TANDEM_SHARED wins)
"""
import json
import os
import subprocess
import sys

from faults_support import Checks, model_path

bench, synth, quantize, perplexity = sys.argv[1], sys.argv[2], sys.argv[4], sys.argv[5]
model = model_path(sys.argv[3])
check = Checks("tandem-tools-faults-")
tmp = check.tmp


def run(*args, stdout=subprocess.PIPE):
    return subprocess.run(list(args), stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.PIPE, timeout=120)


def trace(name, text):
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        f.write(text)
    return path


serve = [bench, "serve", "-m", model, "--no-progress"]
usage = [
    ([bench, "-m", model, "-t", "-1"], b"--threads"),
    ([bench, "-m", model, "-p", "2147483647"], b"--n-prompt"),
    ([bench, "kv", "-m", model, "-t", "-1"], b"--threads"),
    ([bench, "kv", "-m", model, "-ctk", "f16", "-ctv", "q8_0"], b"--cache-type-k"),
    ([bench, "kv", "-m", model, "-ctk", "q4_0", "-ctv", "q4_0"], b"--cache-type-k"),
    ([bench, "kv", "-m", model, "--cache-type-k", "q8_0"], b"--cache-type-k"),
    (serve + ["-t", "-1"], b"--threads"),
    (serve + ["--executors", "tpu"], b"--executors"),
    (serve + ["--executors", "gpu+gpu"], b"--executors"),
    (serve + ["--rate", "-2"], b"--rate"),
    (serve + ["--rate", "nan"], b"--rate"),
    (serve + ["--rate", "inf"], b"--rate"),
    (serve + ["--target", "5"], b"--target"),
    (serve + ["--mix", "0", "0", "0"], b"--mix"),
    (serve + ["--mix", "1", "-1", "0"], b"--mix"),
    (serve + ["--max-running", "0"], b"--max-running"),
    (serve + ["--simulate", "bogus+epyc32"], b"unknown processor profile 'bogus'"),
    (serve + ["--simulate", "l40s+"], b"--simulate"),
    (serve + ["--simulate", ""], b"--simulate"),
    (serve + ["--simulate", "l40s", "--loads", "nan"], b"--loads"),
    (serve + ["--simulate", "l40s", "--time-scale", "0"], b"--time-scale"),
    (serve + ["--batch-host-tpot-fraction", "nan"], b"--batch-host-tpot-fraction"),
    ([synth, "--preset", "no-such-preset", "-o", os.path.join(tmp, "x.gguf")], b"--preset"),
]
for args, named in usage:
    p = run(*args)
    check(f"usage {args[1:]!r} exits 2", p.returncode == 2, f"rc {p.returncode} {p.stderr[-200:]!r}")
    check(f"usage {args[1:]!r} names {named!r}", named in p.stderr, repr(p.stderr[-200:]))

# tandem-synth with an unknown (or no) preset names every valid one, as --list prints them.
presets = [line.split()[0] for line in run(synth, "--list").stdout.decode().splitlines() if line.strip()]
check("synth --list prints presets", len(presets) >= 2, repr(presets))
for args in (["--preset", "bogus"], []):
    p = run(synth, *args, "-o", os.path.join(tmp, "x.gguf"))
    err = p.stderr.decode(errors="replace")
    check(f"synth {args}: exit 2 naming every preset", p.returncode == 2 and all(n in err for n in presets),
          repr(err[-300:]))
    check(f"synth {args}: nothing written", not os.path.exists(os.path.join(tmp, "x.gguf")))
p = run(synth, "--preset", "bogus", "-o", os.path.join(tmp, "x.gguf"))
check("synth --preset bogus: names the value", b"'bogus'" in p.stderr, repr(p.stderr[-300:]))
# The help footer on -p/-n/-d/-t and -ctk/-ctv lists belongs to the speed mode only: kv takes
# one KV type and serve no -ctk at all.
LISTS = b"Lists (-p -n -d -t)"
p = run(bench, "--help")
check("bench --help: the lists footer", p.returncode == 0 and LISTS in p.stdout, repr(p.stdout[-300:]))
for sub in ("kv", "serve"):
    p = run(bench, sub, "--help")
    check(f"bench {sub} --help: no lists footer", p.returncode == 0 and LISTS not in p.stdout and b"comma lists"
          not in p.stdout, repr(p.stdout[-300:]))

# Only what is missing is asked for: -o given, no preset -> no "-o FILE" in the message; neither
# given -> both named.
p = run(synth, "-o", os.path.join(tmp, "x.gguf"))
check("synth -o without --preset: asks for --preset only",
      p.returncode == 2 and b"--preset NAME" in p.stderr and b"-o FILE" not in p.stderr, repr(p.stderr[-300:]))
p = run(synth)
check("synth with neither: asks for --preset and -o", p.returncode == 2 and b"--preset NAME" in p.stderr
      and b"-o FILE" in p.stderr, repr(p.stderr[-300:]))

# A bad -ctk/-ctv value is quoted in the message, so that stray spaces show.
for args, want in ((["-ctk", "f16 ", "-ctv", "f16"], b"--cache-type-k 'f16 ' is not one of"),
                   (["-ctk", "f16", "-ctv", " q8_0"], b"--cache-type-v ' q8_0' is not one of")):
    for mode, tool in (("kv", [bench, "kv", "-m", model]), ("speed", [bench, "-m", model, "-p", "8", "-n", "0"])):
        p = run(*tool, *args)
        check(f"bench {mode} {args}: exit 2, the value quoted", p.returncode == 2 and want in p.stderr,
              repr(p.stderr[-300:]))

# bench kv -ctk/-ctv: the store holds that type; its bytes per token follow the type's row
# size (f16 2 bytes a value, f32 4, q8_0 34 bytes a block of 32).
kv_bytes = {}
for t in ("f16", "f32", "q8_0"):
    p = run(bench, "kv", "-m", model, "-c", "64", "-ctk", t, "-ctv", t, "--json")
    try:
        j = json.loads(p.stdout)
    except ValueError:
        j = {}
    check(f"bench kv -ctk {t} -ctv {t}: types in the record", p.returncode == 0 and j.get("type_k") == t
          and j.get("type_v") == t, f"rc {p.returncode} {p.stderr[-200:]!r}")
    kv_bytes[t] = j.get("kv_bytes", 0)
check("bench kv: f32 KV twice f16, q8_0 34/64 of f16", kv_bytes["f16"] > 0 and kv_bytes["f32"] == 2 * kv_bytes["f16"]
      and kv_bytes["q8_0"] * 64 == kv_bytes["f16"] * 34, repr(kv_bytes))

bad_traces = [
    (tmp, b"is a directory"),
    (trace("empty.jsonl", ""), b"holds no requests"),
    (trace("syntax.jsonl", '{"t": 0, "prompt_tokens": 4}\n{"t": 1, bad}\n'), b"syntax.jsonl:2:"),
    (trace("huge.jsonl", '{"t": 0, "prompt_tokens": 4, "output_tokens": 1e9}\n'), b"huge.jsonl:1:"),
    (trace("negative.jsonl", '{"t": -1, "prompt_tokens": 4}\n'), b"negative.jsonl:1:"),
    (trace("array.jsonl", '[1, 2]\n'), b"array.jsonl:1:"),
]
for path, said in bad_traces:
    p = run(*serve, "--trace", path)
    check(f"trace {os.path.basename(path)} refused", p.returncode == 1 and said in p.stderr,
          f"rc {p.returncode} {p.stderr[-300:]!r}")

failing = trace("too-long.jsonl", '{"t": 0, "prompt_tokens": 500, "output_tokens": 4}\n' * 2)
p = run(*serve, "--trace", failing, "-c", "64")
check("every request failed: exit 1", p.returncode == 1 and b"every request failed" in p.stderr,
      f"rc {p.returncode} {p.stderr[-300:]!r}")

with open("/dev/full", "wb") as full:
    p = run(*serve, "--trace", trace("ok.jsonl", '{"t": 0, "prompt_tokens": 5, "output_tokens": 4}\n'), stdout=full)
    check("serve > /dev/full exits 1", p.returncode == 1 and b"cannot write standard output" in p.stderr,
          f"rc {p.returncode}")
    p = run(bench, "-m", model, "-p", "16", "-n", "4", "-r", "1", "--no-bandwidth", stdout=full)
    check("bench > /dev/full exits 1", p.returncode == 1 and b"cannot write standard output" in p.stderr,
          f"rc {p.returncode}")
    p = run(bench, "kv", "-m", model, "-c", "64", "--kv-dir", tmp, stdout=full)
    check("bench kv > /dev/full exits 1", p.returncode == 1, f"rc {p.returncode}")
    p = run(synth, "--list", stdout=full)
    check("synth --list > /dev/full exits 1", p.returncode == 1, f"rc {p.returncode}")
check("bench kv leaves nothing in --kv-dir", sorted(os.listdir(tmp)) == sorted(
    ["empty.jsonl", "syntax.jsonl", "huge.jsonl", "negative.jsonl", "array.jsonl", "too-long.jsonl", "ok.jsonl"]),
    repr(os.listdir(tmp)))

# A closed stdout pipe (`tandem-bench ... | head`): exit 1 on EPIPE, never a kill by SIGPIPE.
def closed_pipe(*args):
    r, w = os.pipe()
    os.close(r)
    try:
        return run(*args, stdout=w)
    finally:
        os.close(w)


for name, args in [("bench", [bench, "-m", model, "-p", "16", "-n", "4", "-r", "1", "--no-bandwidth"]),
                   ("bench serve", [*serve, "--trace", os.path.join(tmp, "ok.jsonl")]),
                   ("synth --list", [synth, "--list"])]:
    p = closed_pipe(*args)
    check(f"{name} to a closed pipe exits 1, not SIGPIPE", p.returncode == 1, f"rc {p.returncode} {p.stderr[-200:]!r}")
p = closed_pipe(quantize, "--help")
check("quantize --help to a closed pipe is not killed by SIGPIPE", p.returncode >= 0, f"rc {p.returncode}")

p = run(synth, "--preset", "small-llama", "-o", "/dev/full")
check("synth -o /dev/full refused", p.returncode == 1 and b"character device" in p.stderr, repr(p.stderr[-200:]))
check("/dev/full still a device", not os.path.isfile("/dev/full"))
os.symlink("real.gguf", os.path.join(tmp, "link.gguf"))
p = run(synth, "--preset", "small-llama", "-o", os.path.join(tmp, "link.gguf"))
check("synth -o through a symlink writes the target", p.returncode == 0 and os.path.islink(os.path.join(tmp, "link.gguf"))
      and os.path.getsize(os.path.join(tmp, "real.gguf")) > 0, repr(p.stderr[-200:]))

# tandem-quantize IN IN (the same file, also under another spelling) is refused before
# anything is written: the input's bytes stay as they were.
src = os.path.join(tmp, "in.gguf")
with open(model_path(sys.argv[3], "aidreams260K-f32.gguf"), "rb") as f:
    original = f.read()
with open(src, "wb") as f:
    f.write(original)
for out in (src, os.path.join(tmp, ".", "in.gguf")):
    p = run(quantize, src, out, "q4_0")
    with open(src, "rb") as f:
        same = f.read() == original
    check(f"quantize {os.path.basename(src)} onto itself ({out}) refused, input unchanged",
          p.returncode == 2 and b"is the input file" in p.stderr and same, f"rc {p.returncode} {p.stderr[-200:]!r}")
p = run(quantize, src, os.path.join(tmp, "out.gguf"), "q5_k")
check("quantize to an unknown type: exit 2", p.returncode == 2 and not os.path.exists(os.path.join(tmp, "out.gguf")),
      f"rc {p.returncode}")

# tandem-perplexity on the f32 stories model (a tiny text, -c 16: chunks of 16 tokens).
f32_model = model_path(sys.argv[3], "aidreams260K-f32.gguf")
text = trace("story.txt", "Once upon a time there was a little girl who liked to play in the park. " * 12)
p = run(perplexity, "-m", f32_model, "-f", text, "-c", "16", "-t", "1", "--chunks", "3")
out = p.stdout.decode(errors="replace")
check("perplexity: [1]..[3] running values and the final estimate", p.returncode == 0 and "[1]" in out
      and "[3]" in out and "[4]" not in out and "Final estimate: PPL = " in out and " +/- " in out,
      f"rc {p.returncode} {out[-200:]!r} {p.stderr[-200:]!r}")
for args, named in ((["-c", "2"], b"--ctx-size"), (["-b", "0"], b"--batch-size"), (["--convert", "q5_k"], b"--convert"),
                    (["--chunks", "-2"], b"--chunks")):
    p = run(perplexity, "-m", f32_model, "-f", text, *args)
    check(f"perplexity {args}: exit 2 naming the flag", p.returncode == 2 and named in p.stderr,
          f"rc {p.returncode} {p.stderr[-200:]!r}")
p = run(perplexity, "-m", f32_model, "-f", os.path.join(tmp, "no-such.txt"))
check("perplexity: a missing text exits 1 naming it", p.returncode == 1 and b"no-such.txt" in p.stderr,
      f"rc {p.returncode} {p.stderr[-200:]!r}")
p = run(perplexity, "-m", f32_model, "-f", tmp)
check("perplexity: a directory as the text exits 1 naming it (it aborted on the stream's exception)",
      p.returncode == 1 and b"is a directory" in p.stderr, f"rc {p.returncode} {p.stderr[-200:]!r}")
p = run(perplexity, "-m", f32_model, "-f", text, "-c", "4096")
check("perplexity: a text shorter than 2 chunks exits 1 saying how long it is",
      p.returncode == 1 and b"at least 8192 tokens" in p.stderr, f"rc {p.returncode} {p.stderr[-200:]!r}")
with open("/dev/full", "wb") as full:
    p = run(perplexity, "-m", f32_model, "-f", text, "-c", "16", "-t", "1", "--chunks", "1", stdout=full)
    check("perplexity > /dev/full exits 1", p.returncode == 1, f"rc {p.returncode} {p.stderr[-200:]!r}")

# A simulated trace whose prompts do not fit -c: a warning up front (every request would be
# refused and count as missed), and the capacity line says neither configuration met the
# target instead of blaming GPU-only alone.
t = trace("too-long.jsonl", "".join(f'{{"t": {i}, "prompt_tokens": 2000, "output_tokens": 4, "sla": "batch"}}\n'
                                    for i in range(3)))
p = run(*serve, "--simulate", "l40s+epyc32", "--trace", t, "-c", "1000", "--time-scale", "200", "--loads", "1")
err, out = p.stderr.decode(errors="replace"), p.stdout.decode(errors="replace")
check("serve: prompts >= -c warn", p.returncode == 0 and "3 of 3 requests have prompts of >= -c 1000" in err,
      f"rc {p.returncode} {err[-300:]!r}")
check("serve: nobody met the target is said so", "neither met it at any load" in out, repr(out[-300:]))
check.finish()
