#!/usr/bin/env python3
"""tandem-cli --session across KV cache types: a session saved with one -ctk/-ctv type and
restored with another is converted on load, and the run says so on stderr in one line
("the session's KV cache was converted from X to Y"); a restore with the saved type says
nothing of a conversion. The continuation is produced either way.

Usage: test_cli_session_kv.py TANDEM_CLI SHARED_DIR   (TANDEM_SHARED, when set, wins)
"""
import os
import subprocess
import sys

from faults_support import Checks, model_path

cli = sys.argv[1]
model = model_path(sys.argv[2])
check = Checks("tandem-cli-session-kv-")


def run(*args):
    return subprocess.run([cli, "-m", model, "--temp", "0", *args], stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)


def types(t):
    return ["-ctk", t, "-ctv", t]


CONVERTED = b"KV cache was converted"
# (saved with, restored with): every pair of the three types, and each type with itself.
for saved in ("f16", "f32", "q8_0"):
    for restored in ("f16", "f32", "q8_0"):
        name = f"saved {saved}, restored {restored}"
        session = os.path.join(check.tmp, f"{saved}-{restored}.session")
        p = run("-p", "Once upon a time", "-n", "4", *types(saved), "--session", session)
        check(f"{name}: first run exits 0", p.returncode == 0, repr(p.stderr[-300:]))
        check(f"{name}: a fresh session converts nothing", CONVERTED not in p.stderr, repr(p.stderr[-300:]))
        p = run("-n", "4", *types(restored), "--session", session)  # no prompt: continue the saved one
        lines = [l for l in p.stderr.splitlines() if CONVERTED in l]
        check(f"{name}: second run exits 0", p.returncode == 0, repr(p.stderr[-300:]))
        check(f"{name}: restored", b"tandem-cli: restored " in p.stderr, repr(p.stderr[-300:]))
        check(f"{name}: continued", len(p.stdout) > 0, repr(p.stdout))
        if saved == restored:
            check(f"{name}: no conversion line", lines == [], repr(lines))
        else:
            want = f"tandem-cli: the session's KV cache was converted from {saved} to {restored} (-ctk/-ctv)"
            check(f"{name}: one conversion line", lines == [want.encode()], repr(lines))

check.finish()
