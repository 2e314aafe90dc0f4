#!/usr/bin/env python3
"""scripts/gpu-check, the script for a lent GPU machine, without a GPU: its usage (--help
exits 0, an unknown option or a bad setting 2), its phases and deadline on stub binaries
(the tests, bench, synth and serve programs replaced by scripts that answer at once), the
benchmarks skipped when no device is visible, SIGTERM reaching the running phase, and what
it leaves under $OUT: at most five files (the device tool returns at most 8), summary.txt
and a logs.tar.gz holding the logs, also when the build is missing or the deadline cuts
phases.

Usage: test_gpu_check.py SOURCE_DIR
"""
import json
import os
import stat
import subprocess
import sys
import tarfile

from faults_support import Checks

src = sys.argv[1]
script = os.path.join(src, "scripts", "gpu-check")
check = Checks("tandem-gpu-check-")
tmp = check.tmp


def run(args, env_extra, timeout=120):
    env = dict(os.environ, **env_extra)
    return subprocess.run([script] + args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=env, timeout=timeout)


def stub(path, body):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body + "\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)


def out_files(out):
    return sorted(os.listdir(out))


def summary(out):
    with open(os.path.join(out, "summary.txt")) as f:
        return f.read()


def logs_in(out):
    with tarfile.open(os.path.join(out, "logs.tar.gz")) as t:
        return sorted(os.path.basename(n) for n in t.getnames() if n.endswith((".log", ".json")))


r = run(["--help"], {})
check("--help exits 0", r.returncode == 0, repr(r.returncode))
check("--help names gpu-check-prepare", b"gpu-check-prepare" in r.stdout, r.stdout[:200])
r = run(["--bogus"], {})
check("an unknown option exits 2", r.returncode == 2 and b"--bogus" in r.stderr, repr((r.returncode, r.stderr)))

# No build: exit 1, the missing binary named, five files at most.
out = os.path.join(tmp, "out-missing")
r = run([out], {"GPU_CHECK_NO_BUILD": "1", "GPU_CHECK_BUILD": os.path.join(tmp, "empty-build"),
                "TANDEM_SHARED": tmp, "GPU_CHECK_SANITIZER": "none"})
check("a missing build exits 1", r.returncode == 1, repr(r.returncode))
check("a missing build is named", "FAILED: missing binary" in summary(out), summary(out))
check("a missing build leaves <= 5 files", len(out_files(out)) <= 5, repr(out_files(out)))

# Stub binaries: every phase runs, the figures reach gpu-bench.jsonl and gpu-bench.md.
build = os.path.join(tmp, "build")
stub(os.path.join(build, "tests/gpu/tandem-gpu-tests"), 'echo "All tests passed (1 assertion in 1 test case)"')
stub(os.path.join(build, "examples/tandem-synth"),
     'while [ $# -gt 0 ]; do [ "$1" = -o ] && echo gguf > "$2"; shift; done')
record = {"model": "stub", "device": "Stub GPU", "cc": "9.0", "weights_vram_mib": 1.0, "p": 512, "n": 128,
          "pp_tps": 1000.0, "pp_sd": 1.0, "tg_tps": 100.0, "tg_sd": 0.5, "depth": 0, "commit": "abc"}
stub(os.path.join(build, "kernels/cuda/tandem-gpu-bench"), "echo '" + json.dumps(record) + "'")
stub(os.path.join(build, "examples/tandem-bench"), "echo '{\"goodput_requests_per_s\": 1.5, \"wall_s\": 2}'")
out = os.path.join(tmp, "out-stub")
env = {"GPU_CHECK_NO_BUILD": "1", "GPU_CHECK_BUILD": build, "TANDEM_SHARED": tmp, "GPU_CHECK_SANITIZER": "none"}
r = run([out], env)
s = summary(out)
check("every phase passing exits 0", r.returncode == 0, repr(r.returncode) + s)
check("the tests pass in the summary", "passed: All tests passed" in s, s)
check("four bench runs", s.count("] bench ") == 4, s)
check("two serve runs", s.count("] serve --executors") == 2, s)
with open(os.path.join(out, "gpu-bench.jsonl")) as f:
    check("gpu-bench.jsonl holds the four records", len([l for l in f if l.strip()]) == 4)
with open(os.path.join(out, "gpu-bench.md")) as f:
    md = f.read()
check("gpu-bench.md has pp512 and tg128 rows", "| pp512 |" in md and "| tg128@d0 |" in md, md)
check("the stub run leaves <= 5 files", len(out_files(out)) <= 5, repr(out_files(out)))
names = logs_in(out)
check("logs.tar.gz holds the test, bench and serve logs",
      "tests-gpu.log" in names and "serve-gpu.json" in names and "bench-qwen2.5-0.5b-tg128-d4096.json" in names,
      repr(names))

# A deadline too near for the optional phases: they are skipped and said so; the tests fail
# for want of time (exit 1).
out = os.path.join(tmp, "out-deadline")
r = run([out], dict(env, GPU_CHECK_DEADLINE="45"))
s = summary(out)
check("a near deadline exits 1", r.returncode == 1, repr(r.returncode))
check("a near deadline skips the benchmarks", "SKIPPED (deadline of 45s too near): bench tinyllama-1.1b pp512-tg128" in s, s)
check("a near deadline leaves <= 5 files", len(out_files(out)) <= 5, repr(out_files(out)))

# No CUDA device (the tests report themselves skipped, exit 77): benchmarks and serving are
# skipped and said so, no model is synthesised.
nodev = os.path.join(tmp, "build-nodev")
stub(os.path.join(nodev, "tests/gpu/tandem-gpu-tests"), 'echo "SKIPPED: no CUDA device (none visible)"; exit 77')
for name in ("examples/tandem-synth", "kernels/cuda/tandem-gpu-bench", "examples/tandem-bench"):
    stub(os.path.join(nodev, name), "touch " + os.path.join(tmp, "nodev-ran") + "; exit 1")
out = os.path.join(tmp, "out-nodev")
r = run([out], dict(env, GPU_CHECK_BUILD=nodev))
s = summary(out)
check("no device: exit 1", r.returncode == 1, repr(r.returncode))
check("no device: benchmarks and serving skipped",
      s.count("SKIPPED (no CUDA device)") == 4 and not os.path.exists(os.path.join(tmp, "nodev-ran")), s)

# SIGTERM while a phase runs (a synth that would take 10 minutes): the phase gets the signal
# (it leaves a mark), the script says so and leaves its files; nothing keeps running.
sig = os.path.join(tmp, "build-sig")
for name in ("tests/gpu/tandem-gpu-tests", "kernels/cuda/tandem-gpu-bench", "examples/tandem-bench"):
    stub(os.path.join(sig, name), 'echo "All tests passed"')
mark = os.path.join(tmp, "synth-got-term")
started = os.path.join(tmp, "synth-started")
stub(os.path.join(sig, "examples/tandem-synth"),
     f"trap 'touch {mark}; kill $!; exit 143' TERM; touch {started}; sleep 600 & wait")
out = os.path.join(tmp, "out-sig")
p = subprocess.Popen([script, out], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     env=dict(os.environ, **dict(env, GPU_CHECK_BUILD=sig)))
for _ in range(600):  # until the synth phase runs (a hang guard, not a timing check)
    if os.path.exists(started) or p.poll() is not None:
        break
    subprocess.run(["sleep", "0.1"])
p.terminate()
try:
    rc = p.wait(timeout=120)
except subprocess.TimeoutExpired:
    p.kill()
    rc = None
check("SIGTERM: exit 1", rc == 1, repr(rc))
check("SIGTERM reaches the running phase", os.path.exists(mark))
check("SIGTERM: the summary says so", "STOPPED by a signal" in summary(out), summary(out))
check("SIGTERM: logs.tar.gz left", os.path.exists(os.path.join(out, "logs.tar.gz")))
left = subprocess.run(["pgrep", "-f", os.path.join(sig, "examples/tandem-synth")], capture_output=True).stdout
check("SIGTERM: no phase left running", left == b"", repr(left))

# Bad settings are usage errors (exit 2), before anything runs.
for extra, args, what in [({"GPU_CHECK_DEADLINE": "abc"}, [os.path.join(tmp, "o1")], b"GPU_CHECK_DEADLINE"),
                          ({"GPU_CHECK_REPS": "0"}, [os.path.join(tmp, "o2")], b"GPU_CHECK_REPS"),
                          ({}, ["/proc/gpu-check-out"], b"output folder")]:
    r = run(args, dict(env, **extra))
    check(f"{extra or args}: exit 2 naming it", r.returncode == 2 and what in r.stderr, repr((r.returncode, r.stderr)))

check.finish()
