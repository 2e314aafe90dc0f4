#!/usr/bin/env python3
"""tandem-gpu-bench's flags: --help prints the usage on stdout and exits 0; a malformed or
out-of-range value (-p abc, -p 12x, -r 0, a flag without its value, an unknown flag, no -m)
exits 2 with a reason naming the flag and the value. The flags are read before the model is
loaded and before any CUDA call, so this runs on a machine without a GPU: a well-formed
command line with a missing model file ends in the model's load error (exit 1), not in a
usage error nor a device error.

Usage: test_gpu_bench_usage.py TANDEM_GPU_BENCH
"""
import os
import subprocess
import sys

from faults_support import Checks

gpu_bench = sys.argv[1]
check = Checks("tandem-gpu-bench-usage-")


def run(*args):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no device: flags must not need one
    return subprocess.run([gpu_bench, *args], stdin=subprocess.DEVNULL, capture_output=True, timeout=60, env=env)


tmp = check.tmp
missing = os.path.join(tmp, "no-such-model.gguf")
for args in (["--help"], ["-h"], ["-m", missing, "--help"]):
    p = run(*args)
    check(f"{args}: exit 0, the usage on stdout", p.returncode == 0 and b"usage: tandem-gpu-bench" in p.stdout and
          b"-p" in p.stdout and b"--device" in p.stdout,
          f"rc {p.returncode} {p.stdout[-200:]!r} {p.stderr[-200:]!r}")
for flag, value in [
    ("-p", "abc"),
    ("-p", "12x"),
    ("-p", ""),
    ("-p", "-1"),
    ("-p", "99999999999999999999"),
    ("-n", "x"),
    ("-n", "-3"),
    ("-d", "1e3"),
    ("-r", "0"),
    ("-r", "two"),
    ("--device", "gpu0"),
    ("--device", "-1"),
]:
    args = [flag, value]
    p = run("-m", missing, *args)
    err = p.stderr.decode(errors="replace")
    check(f"{args}: exit 2", p.returncode == 2, f"rc {p.returncode} {err[-300:]!r}")
    check(f"{args}: the reason names {flag} and '{value}'", f"{flag} '{value}'" in err and "usage:" in err,
          repr(err[-300:]))
    check(f"{args}: nothing on stdout", p.stdout == b"", repr(p.stdout[-200:]))
for args, said in [
    (["-m", missing, "-p"], "-p needs a value"),
    (["-m", missing, "--bogus"], "unknown argument '--bogus'"),
    (["-p", "8"], "-m MODEL.gguf is required"),
]:
    p = run(*args)
    err = p.stderr.decode(errors="replace")
    check(f"{args}: exit 2 saying '{said}'", p.returncode == 2 and said in err and "usage:" in err,
          f"rc {p.returncode} {err[-300:]!r}")
# Well-formed flags: the model is loaded next (before the device), so a missing file is
# the error, exit 1.
p = run("-m", missing, "-p", "8", "-n", "4", "-d", "0", "-r", "1", "--device", "0", "--json")
err = p.stderr.decode(errors="replace")
check("good flags, missing model: exit 1 with the load error", p.returncode == 1 and "error:" in err and
      "usage:" not in err and "no-such-model.gguf" in err, f"rc {p.returncode} {err[-300:]!r}")

check.finish()
