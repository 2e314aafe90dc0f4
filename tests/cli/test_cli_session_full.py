#!/usr/bin/env python3
"""tandem-cli --session saved when the context is full: the file restores (the KV positions
fit n_ctx; the last sampled token, which has no position, waits as in the live run) and
every way of going on behaves as a full context does without a restore:
  plain continuation (no -p): stops at once with the live run's "context ... is full" line;
  -p (prompt cache): the common prefix is reused and generation runs;
  --chat: the restored conversation is dropped to make room; the reply is a fresh chat's.
The file is then saved again and still restores.

Usage: test_cli_session_full.py TANDEM_CLI SHARED_DIR   (TANDEM_SHARED, when set, wins)
"""
import os
import subprocess
import sys

from faults_support import Checks, model_path

cli = sys.argv[1]
model = model_path(sys.argv[2])
check = Checks("tandem-cli-session-full-")


def run(*args, stdin=subprocess.DEVNULL):
    return subprocess.run([cli, "-m", model, "--temp", "0", *args], stdin=stdin,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)


def fill(name):
    session = os.path.join(check.tmp, name)
    p = run("-p", "Once upon a time", "-n", "500", "--ignore-eos", "-c", "128", "--session", session)
    check(f"{name}: the first run exits 0", p.returncode == 0, repr(p.stderr[-300:]))
    check(f"{name}: it fills the context", b"the context of 128 tokens is full" in p.stderr, repr(p.stderr[-300:]))
    check(f"{name}: it saves 128 tokens", b"saved 128 tokens" in p.stderr, repr(p.stderr[-300:]))
    return session


# Plain continuation: nothing fits; the same line as the live run, exit 0, the file intact.
session = fill("plain.session")
p = run("-n", "20", "-c", "128", "--session", session)
check("continue: exits 0", p.returncode == 0, repr(p.stderr[-300:]))
check("continue: restored 128 tokens", b"restored 128 tokens" in p.stderr, repr(p.stderr[-300:]))
check("continue: the context-full line", b"the context of 128 tokens is full; generation stopped" in p.stderr,
      repr(p.stderr[-300:]))
check("continue: nothing generated", p.stdout.strip() == b"", repr(p.stdout))
p = run("-n", "20", "-c", "128", "--session", session)
check("continue again: exits 0 (the re-saved file restores)", p.returncode == 0, repr(p.stderr[-300:]))

# A smaller context than the saved positions is still refused, naming them.
p = run("-n", "20", "-c", "64", "--session", session)
check("-c 64: refused", p.returncode != 0, repr(p.stderr[-300:]))
check("-c 64: names 128 positions", b"128 positions do not fit n_ctx 64" in p.stderr, repr(p.stderr[-300:]))

# Prompt cache: the common prefix is reused, the rest generated as a fresh run does.
session = fill("cache.session")
p = run("-p", "Once upon a time", "-n", "8", "-c", "128", "--session", session)
fresh = run("-p", "Once upon a time", "-n", "8", "-c", "128")
check("-p: exits 0", p.returncode == 0, repr(p.stderr[-300:]))
check("-p: reuses the prefix", b"prompt cache: reused " in p.stderr, repr(p.stderr[-300:]))
check("-p: the same text as a fresh run", p.stdout == fresh.stdout and len(p.stdout) > 0,
      repr((p.stdout, fresh.stdout)))

# Chat: the restored conversation leaves no room and is dropped; the reply runs.
session = fill("chat.session")
p = run("--chat", "-p", "Hello", "-n", "8", "-c", "128", "--session", session)
check("--chat: exits 0", p.returncode == 0, repr(p.stderr[-300:]))
check("--chat: drops the restored conversation", b"the restored conversation did not leave room" in p.stderr,
      repr(p.stderr[-300:]))
fresh = run("--chat", "-p", "Hello", "-n", "8", "-c", "128")
check("--chat: the reply of a fresh chat", fresh.returncode == 0 and p.stdout == fresh.stdout and len(p.stdout) > 0,
      repr((p.stdout, fresh.stdout)))

check.finish()
