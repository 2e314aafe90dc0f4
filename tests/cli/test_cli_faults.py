#!/usr/bin/env python3
"""tandem-cli when things go wrong: interrupts keep the work done, concurrent runs of one
--session file lose nothing, full disks and unwritable stdout are errors (never a signal,
never exit 0), saves never damage the target, bad flags exit 2 with the flag named.

Usage: test_cli_faults.py TANDEM_CLI SHARED_DIR   (TANDEM_SHARED, when set, wins)
"""
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time

from faults_support import Checks, model_path

cli = sys.argv[1]
model = model_path(sys.argv[2])
check = Checks("tandem-cli-faults-")
tmp = check.tmp


def run(*args, stdin=None, stdout=subprocess.PIPE, env=None, preexec=None):
    return subprocess.run([cli, "-m", model, *args], stdin=stdin if stdin is not None else subprocess.DEVNULL,
                          stdout=stdout, stderr=subprocess.PIPE, env=env, preexec_fn=preexec, timeout=120)


def restored(session):
    """Tokens a run would restore from `session` (0 when it holds none): the u64 token count
    at byte 128 of the file (the layout in lib/session/session_file.cpp), read without a run, which
    would save the file again."""
    try:
        with open(session, "rb") as f:
            data = f.read(136)
    except OSError:
        return 0
    return int.from_bytes(data[128:136], "little") if len(data) == 136 else 0


# --- bad flags: exit 2, the flag named, nothing written ---------------------------------
usage = [
    (["-p", "x", "--temp", "inf"], b"--temp"),
    (["-p", "x", "--temp", "nan"], b"--temp"),
    (["-p", "x", "--top-p", "inf"], b"--top-p"),
    (["-p", "x", "--seed", "-5"], b"--seed"),
    (["-p", "x", "--seed", "99999999999999999999999"], b"seed"),
    (["-p", "x", "--kv-dir", tmp], b"--kv-dir"),
    (["-p", "x", "-n", "5", "--migrate-after", "5"], b"--migrate-after"),
    (["-p", b"caf\xc3"], b"UTF-8"),
    (["--chat", "--json"], b"--json"),
    (["--chat", "--logits-out", os.path.join(tmp, "l.f32")], b"--logits-out"),
    (["-p", "x", "-t", "-1"], b"threads"),
]
for args, named in usage:
    p = run(*args)
    check(f"usage {args!r} exits 2", p.returncode == 2, f"rc {p.returncode} {p.stderr[-200:]!r}")
    check(f"usage {args!r} names {named!r}", named in p.stderr, repr(p.stderr[-200:]))
check("no stray files from refused flags", os.listdir(tmp) == [], repr(os.listdir(tmp)))
# llama.cpp's -ngl / --n-gpu-layers / --gpu-layers: 0 runs the CPU executor; llama.cpp's
# whole-model values (99, -1, auto, all) the GPU executor in a CUDA build (here with no device
# visible: exit 1 naming it) and a usage error without CUDA; a partial count (1 of aidreams'
# 4 layers) is refused in every build.
version = subprocess.run([cli, "--version"], capture_output=True).stdout.decode()
cuda_build = "gpu executor: cuda" in version
no_device = dict(os.environ, CUDA_VISIBLE_DEVICES="")
plain = run("-p", "Once", "-n", "4", "--temp", "0", "--json")
for flag in ("-ngl", "--n-gpu-layers", "--gpu-layers"):
    p = run("-p", "Once", "-n", "4", "--temp", "0", "--json", flag, "0")
    check(f"{flag} 0: the same tokens as without it", p.returncode == 0 and plain.returncode == 0 and
          json.loads(p.stdout)["ids"] == json.loads(plain.stdout)["ids"], f"rc {p.returncode} {p.stderr[-300:]!r}")
    p = run("-p", "x", flag, "1")
    err = p.stderr.decode(errors="replace")
    check(f"{flag} 1: exit 2, no partial offload, the layer count named",
          p.returncode == 2 and p.stdout == b"" and "no partial offload" in err and "4 layers" in err, repr(err[-300:]))
    for value in ("99", "-1", "auto", "all"):
        p = run("-p", "x", flag, value, env=no_device)
        err = p.stderr.decode(errors="replace")
        if cuda_build:
            check(f"{flag} {value}: the GPU executor is tried; no device: exit 1 naming CUDA, nothing on stdout",
                  p.returncode == 1 and p.stdout == b"" and "CUDA" in err, f"rc {p.returncode} {err[-300:]!r}")
        else:
            check(f"{flag} {value}: exit 2, nothing on stdout", p.returncode == 2 and p.stdout == b"",
                  f"rc {p.returncode} {err[-300:]!r}")
            check(f"{flag} {value}: says this build runs on the CPU and names the GPU tools",
                  "--n-gpu-layers" in err and "CPU" in err and "tandem-server --executors" in err and
                  "tandem-gpu-bench" in err and "not in range" not in err, repr(err[-400:]))
# llama.cpp's -ngl=N and -ctk=T spellings (CLI11 alone reads them as -n gl=N and -c tk=T).
p = run("-p", "Once", "-n", "4", "--temp", "0", "--json", "-ngl=0")
check("-ngl=0: the same tokens as without it", p.returncode == 0 and plain.returncode == 0 and
      json.loads(p.stdout)["ids"] == json.loads(plain.stdout)["ids"], f"rc {p.returncode} {p.stderr[-300:]!r}")
p = run("-p", "x", "-ngl=1")
check("-ngl=1: read as -ngl 1 (no partial offload)", p.returncode == 2 and b"no partial offload" in p.stderr,
      repr(p.stderr[-300:]))
p = run("-p", "Once", "-n", "4", "--temp", "0", "--json", "-ctk=f16", "-ctv=f16")
check("-ctk=f16 -ctv=f16: the same tokens as without them", p.returncode == 0 and plain.returncode == 0 and
      json.loads(p.stdout)["ids"] == json.loads(plain.stdout)["ids"], f"rc {p.returncode} {p.stderr[-300:]!r}")
p = run("-p", "x", "-ngl", "abc")
check("-ngl abc: exit 2 naming the flag and the value",
      p.returncode == 2 and b"--n-gpu-layers" in p.stderr and b"'abc'" in p.stderr, repr(p.stderr[-300:]))
# Inputs that never end (/dev/zero) or are directories: a clear error, bounded memory.
sanitized = subprocess.run(["sh", "-c", f"nm -D '{cli}' 2>/dev/null | grep -q __asan_init"]).returncode == 0
for args, what in ((["apply-template", "-m", model, "--messages", "/dev/zero"], b"more than 64 MiB"),
                   (["apply-template", "-m", model, "--messages", tmp], b"is a directory"),
                   (["-m", model, "-f", "/dev/zero", "-n", "1"], b"more than 64 MiB"),
                   (["-m", model, "-f", tmp, "-n", "1"], b"is a directory")):
    # 2 GB of address space (not under a sanitizer, whose shadow memory needs far more):
    # reading /dev/zero whole would be killed, not refused.
    limit = [] if sanitized else ["prlimit", "--as=2000000000"]
    p = subprocess.run([*limit, cli, *args], capture_output=True, timeout=120)
    check(f"{args[-3:]!r}: exit 1 naming the problem, bounded memory",
          p.returncode == 1 and what in p.stderr, f"rc {p.returncode} {p.stderr[-300:]!r}")
p = subprocess.run([cli, "--version"], capture_output=True)
check("--version", p.returncode == 0 and re.match(rb"tandem-cli \d+\.\d+\.\d+", p.stdout) is not None, repr(p.stdout))
p = subprocess.run([cli, "--help"], capture_output=True)
check("--help shows defaults", p.returncode == 0 and b"=128" in p.stdout, repr(p.stdout[:300]))

# -f FILE reads the prompt; a long prompt shows progress on stderr.
with open(os.path.join(tmp, "prompt.txt"), "w") as f:
    f.write("Once upon a time")
p = run("-f", os.path.join(tmp, "prompt.txt"), "-n", "4", "--temp", "0", "--json")
check("-f FILE reads the prompt", b'"prompt_ids":[1,429,491,433,295,429,444,445,265,262,263,342,430]' in p.stdout,
      repr(p.stdout[:200]))
with open(os.path.join(tmp, "long.txt"), "w") as f:
    f.write("Once upon a time " * 300)
p = run("-f", os.path.join(tmp, "long.txt"), "-n", "2", "-c", "4096", "-b", "64", "--temp", "0")
check("long prefill shows progress", p.returncode == 0 and b"tokens (100%)" in p.stderr, repr(p.stderr[-300:]))
p = run("-p", "Once", "-n", "200", "--temp", "0", "--ignore-eos", "-c", "32")
check("a full context says so", b"context of 32 tokens is full" in p.stderr, repr(p.stderr[-300:]))

# --- write errors on stdout ---------------------------------------------------------------
with open("/dev/full", "wb") as full:
    for args in (["-p", "Once", "-n", "4"], ["-p", "Once", "-n", "4", "--json"]):
        p = run(*args, stdout=full)
        check(f"{args} > /dev/full fails", p.returncode == 1 and b"cannot write standard output" in p.stderr,
              f"rc {p.returncode} {p.stderr[-200:]!r}")
    p = subprocess.run([cli, "tokenize", "-m", model, "-p", "Once"], stdout=full, stderr=subprocess.PIPE)
    check("tokenize > /dev/full fails", p.returncode == 1 and b"cannot write standard output" in p.stderr,
          f"rc {p.returncode}")

# --- saves never damage the target ----------------------------------------------------------
# A closed stdout pipe (`tandem-cli ... --session s | head`): EPIPE is a failed write, exit 1,
# never a kill by SIGPIPE (141) and never a 0-byte session file. The read end is closed
# before the run starts, so the first write fails whatever the speed.
def closed_pipe_run(*args):
    r, w = os.pipe()
    os.close(r)
    try:
        return run(*args, stdout=w)
    finally:
        os.close(w)


pipe_sess = os.path.join(tmp, "pipe.session")
p = closed_pipe_run("-p", "Once upon a time", "-n", "16", "--session", pipe_sess)
check("closed stdout pipe, first run: exit 1 naming the broken pipe, not SIGPIPE",
      p.returncode == 1 and b"cannot write standard output: Broken pipe" in p.stderr,
      f"rc {p.returncode} {p.stderr[-200:]!r}")
first = restored(pipe_sess)
check("closed stdout pipe, first run: the session saved whole", first >= 13, f"restored {first}")
p = run("-n", "4", "--session", pipe_sess, "--temp", "0")
check("closed stdout pipe: the saved session restores", p.returncode == 0 and b"restored %d tokens" % first in p.stderr,
      f"rc {p.returncode} {p.stderr[-300:]!r}")
before = restored(pipe_sess)
p = closed_pipe_run("-n", "16", "--session", pipe_sess)
after = restored(pipe_sess)
check("closed stdout pipe, existing session: exit 1, the session kept or extended",
      p.returncode == 1 and after >= before, f"rc {p.returncode} restored {before} -> {after}")
r, w = os.pipe()
os.close(r)
p = subprocess.run([cli, "tokenize", "-m", model, "-p", "Once"], stdout=w, stderr=subprocess.PIPE)
os.close(w)
check("tokenize to a closed pipe exits 1", p.returncode == 1, f"rc {p.returncode}")

p = run("-p", "Once", "-n", "4", "--session", "/dev/full")
check("--session /dev/full refused", p.returncode == 1 and b"not a regular file" in p.stderr, repr(p.stderr[-200:]))
check("/dev/full still a device", os.path.exists("/dev/full") and not os.path.isfile("/dev/full"))
os.mkdir(os.path.join(tmp, "real"))
link = os.path.join(tmp, "link.session")
os.symlink("real/story.session", link)
p = run("-p", "Once upon a time", "-n", "8", "--temp", "0", "--session", link)
check("session through a symlink", p.returncode == 0 and os.path.islink(link)
      and os.path.getsize(os.path.join(tmp, "real", "story.session")) > 0, repr(p.stderr[-200:]))
check("session symlink restores", restored(link) == 20)

# A file size limit (ulimit -f) stands in for a full disk: the old session survives.
story = os.path.join(tmp, "real", "story.session")
before = open(story, "rb").read()


def limit(n):
    return lambda: __import__("resource").setrlimit(__import__("resource").RLIMIT_FSIZE, (n, n))


p = run("-p", " The", "-n", "40", "--temp", "0", "--ignore-eos", "--session", link, preexec=limit(len(before)))
check("a full disk during the save: exit 1", p.returncode == 1 and b"File too large" in p.stderr,
      f"rc {p.returncode} {p.stderr[-300:]!r}")
check("a full disk during the save: old file intact", open(story, "rb").read() == before)
check("a full disk during the save: no temporary left", sorted(os.listdir(os.path.join(tmp, "real"))) == ["story.session"],
      repr(os.listdir(os.path.join(tmp, "real"))))

# --- the File KV tier on a full disk: an error, not SIGBUS, and no page file left ----------
kvdir = os.path.join(tmp, "kv")
os.mkdir(kvdir)
for attempt in range(2):  # the second run must not be hurt by the first
    p = run("-p", "Once", "-n", "3000", "-c", "4096", "--ignore-eos", "--kv-tier", "file", "--kv-dir", kvdir,
            preexec=limit(64 * 1024))
    check(f"full disk under the File tier exits 1 (run {attempt})", p.returncode == 1 and b"File too large" in p.stderr,
          f"rc {p.returncode} {p.stderr[-300:]!r}")
check("no page file left behind", os.listdir(kvdir) == [], repr(os.listdir(kvdir)))
with open(os.path.join(kvdir, "tandem-kv-999999999-0.pages"), "wb") as f:  # a crashed run's (no such PID)
    f.write(b"\0" * 4096)
p = run("-p", "Once", "-n", "8", "--kv-tier", "file", "--kv-dir", kvdir)
check("stale page file cleaned at start", p.returncode == 0 and os.listdir(kvdir) == [], repr(os.listdir(kvdir)))
p = run("-p", "Once", "-n", "4", env=dict(os.environ, TMPDIR="/nonexistent/tandem"))
check("a bad TMPDIR does not matter without the File tier", p.returncode == 0, repr(p.stderr[-200:]))
p = run("-p", "Once", "-n", "4", "--kv-tier", "file", env=dict(os.environ, TMPDIR="/nonexistent/tandem"))
check("a bad TMPDIR is named for the File tier", p.returncode == 1 and b"TMPDIR" in p.stderr, repr(p.stderr[-200:]))

# --- --session FILE -p PROMPT is a prompt cache (llama.cpp's --prompt-cache) ---------------
def generate(*args):
    p = run(*args, "-n", "16", "--temp", "0", "--ignore-eos", "--json")
    return p, (json.loads(p.stdout) if p.returncode == 0 else {"ids": None, "prompt_ids": []})


def reused_of(stderr):
    m = re.search(rb"prompt cache: reused (\d+) of (\d+) prompt tokens", stderr)
    return (int(m.group(1)), int(m.group(2))) if m else None


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


cache = os.path.join(tmp, "cache.session")
story = "Once upon a time there was a little girl who"
_, fresh = generate("-p", story)
p, first = generate("-p", story, "--session", cache)
check("prompt cache: first run as fresh", first["ids"] == fresh["ids"] and reused_of(p.stderr) is None,
      repr(p.stderr[-300:]))
check("prompt cache: saved prompt + output", restored(cache) == len(fresh["prompt_ids"]) + 16 - 1, restored(cache))
p, again = generate("-p", story, "--session", cache)
n_prompt = len(fresh["prompt_ids"])
check("prompt cache: same prompt reuses all but its last token", reused_of(p.stderr) == (n_prompt - 1, n_prompt),
      repr(p.stderr[-300:]))
check("prompt cache: same prompt, same output as a fresh run", again["ids"] == fresh["ids"], f"{again['ids']}")
check("prompt cache: the prompt is not appended again", restored(cache) == n_prompt + 16 - 1, restored(cache))
other = "Once upon a time there was a big dog"
_, fresh2 = generate("-p", other)
want = common_prefix(fresh["prompt_ids"], fresh2["prompt_ids"])
p, diverged = generate("-p", other, "--session", cache)
check("prompt cache: a diverging prompt reuses the common prefix",
      0 < want < len(fresh2["prompt_ids"]) and reused_of(p.stderr) == (want, len(fresh2["prompt_ids"])),
      f"want {want}: {p.stderr[-300:]!r}")
check("prompt cache: diverging prompt, same output as a fresh run", diverged["ids"] == fresh2["ids"],
      f"{diverged['ids']} != {fresh2['ids']}")
check("prompt cache: the file holds the new prompt and output", restored(cache) == len(fresh2["prompt_ids"]) + 15)
# A prompt that extends the saved conversation reuses all of it.
longer = other + " and the dog was happy"
_, fresh3 = generate("-p", longer)
p, extended = generate("-p", longer, "--session", cache)
want = common_prefix(fresh2["prompt_ids"], fresh3["prompt_ids"])
check("prompt cache: an extended prompt reuses the saved prefix", reused_of(p.stderr) == (want, len(fresh3["prompt_ids"]))
      and extended["ids"] == fresh3["ids"], f"want {want}: {p.stderr[-300:]!r}")
# Without -p the run continues the saved conversation.
before_n = restored(cache)
p = run("-n", "5", "--temp", "0", "--ignore-eos", "--session", cache)
check("no -p continues the saved conversation", p.returncode == 0 and restored(cache) == before_n + 5,
      f"{before_n} -> {restored(cache)} {p.stderr[-200:]!r}")
# Damaged or foreign session files are refused, named, and left as they were.
damaged = os.path.join(tmp, "damaged.session")
data = bytearray(open(cache, "rb").read())
data[len(data) // 2] ^= 0x40
open(damaged, "wb").write(bytes(data))
p = run("-p", story, "-n", "4", "--session", damaged)
check("prompt cache: a damaged file is refused", p.returncode == 1 and b"checksum mismatch" in p.stderr
      and open(damaged, "rb").read() == bytes(data), f"rc {p.returncode} {p.stderr[-300:]!r}")
saved = open(cache, "rb").read()
p = subprocess.run([cli, "-m", model_path(sys.argv[2], "stories260K-q4_0.gguf"), "-p", story, "-n", "4", "--session",
                    cache], stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
check("prompt cache: another model's file is refused", p.returncode == 1 and b"saved with model" in p.stderr
      and open(cache, "rb").read() == saved, f"rc {p.returncode} {p.stderr[-300:]!r}")

# --- an interrupt during a long prompt stops at the next chunk; the session file loads -------
sess = os.path.join(tmp, "prefill.session")
long_prompt = os.path.join(tmp, "long.txt")  # about 3600 tokens: 225 chunks of -b 16
r, w = os.pipe()
fcntl.fcntl(w, 1031, 4096)  # F_SETPIPE_SZ: the progress lines on stderr fill it and block the prefill
proc = subprocess.Popen([cli, "-m", model, "-f", long_prompt, "-n", "8", "-c", "4096", "-b", "16", "--temp", "0",
                         "--session", sess], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=w)
os.close(w)
err = b""
while b" tokens (" not in err:  # the first chunk is done; at most one pipe more can follow before we read on
    err += os.read(r, 256)
total = int(re.search(rb"prompt \d+ / (\d+) tokens", err).group(1))
proc.send_signal(signal.SIGINT)
while True:
    chunk = os.read(r, 65536)
    if not chunk:
        break
    err += chunk
os.close(r)
rc = proc.wait(timeout=120)
check("SIGINT during the prompt exits 130", rc == 130, f"rc {rc} {err[-300:]!r}")
check("SIGINT during the prompt says so", b"interrupted during the prompt" in err, repr(err[-300:]))
n = restored(sess)
check("SIGINT during the prompt saved whole chunks of it", 0 < n < total and n % 16 == 0, f"{n} of {total}")
_, fresh_long = generate("-f", long_prompt, "-c", "4096")
p, resumed = generate("-f", long_prompt, "-c", "4096", "--session", sess)
check("the interrupted prompt's session loads and resumes", reused_of(p.stderr) == (n, total), repr(p.stderr[-300:]))
check("the resumed prompt generates as a fresh run", resumed["ids"] == fresh_long["ids"], repr(resumed["ids"]))

# --- chat on a small context: the oldest turns go, the system prompt stays, /clear ---------
turns = b"Hello there\nTell me a story\nAnd another one\nOnce more please\n" + b"story " * 80 + b"\n/clear\nHi\n"
p = subprocess.run([cli, "-m", model, "--chat", "-sys", "Be kind.", "-c", "128", "-n", "24", "--temp", "0",
                    "--ignore-eos"], input=turns, capture_output=True, timeout=120)
check("small-context chat: exit 0, no error", p.returncode == 0 and b"error" not in p.stderr,
      f"rc {p.returncode} {p.stderr[-400:]!r}")
shift = re.search(rb"context shift: dropped the (\d+) oldest messages; kept (\d+) tokens", p.stderr)
check("small-context chat: context shift said", shift is not None and int(shift.group(2)) > 0, repr(p.stderr[-600:]))
check("small-context chat: a message too long alone is refused, named",
      b"this message does not fit the context" in p.stderr, repr(p.stderr[-600:]))
check("small-context chat: /clear", b"conversation cleared" in p.stderr, repr(p.stderr[-300:]))

# --- concurrent runs of one session file lose nothing --------------------------------------
conc = os.path.join(tmp, "shared.session")
args = ["-n", "20", "--temp", "0", "--ignore-eos", "-c", "2048", "--session", conc]  # no -p: each run continues
run("-p", " x", *args)
base = restored(conc)
run(*args)
delta = restored(conc) - base
procs = [subprocess.Popen([cli, "-m", model, *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE) for _ in range(4)]
codes = [pr.wait(timeout=120) for pr in procs]
check("four concurrent runs all succeed", codes == [0, 0, 0, 0], repr(codes))
check("four concurrent runs: every run's tokens kept", restored(conc) == base + 5 * delta,
      f"{restored(conc)} != {base} + 5 x {delta}")

# --- interrupts: stop at a token boundary, save, exit 130 -----------------------------------
sess = os.path.join(tmp, "interrupted.session")
r, w = os.pipe()
fcntl.fcntl(w, 1031, 4096)  # F_SETPIPE_SZ: one page, so generation blocks on a reader that waits
proc = subprocess.Popen([cli, "-m", model, "-p", "Once upon a time", "-n", "8000", "-c", "8192", "--temp", "0",
                         "--ignore-eos", "--session", sess], stdin=subprocess.DEVNULL, stdout=w,
                        stderr=subprocess.PIPE)
os.close(w)
out = b""
while len(out) < 2000:  # a few hundred tokens generated; the pipe fills again and blocks the writer
    out += os.read(r, 2000 - len(out))
proc.send_signal(signal.SIGINT)
deadline = time.monotonic() + 60
while restored(sess) == 0 and time.monotonic() < deadline:  # stopped and saved; now blocked on stdout
    time.sleep(0.05)
proc.send_signal(signal.SIGINT)  # the second signal: exit at once, without waiting for the reader
try:
    rc = proc.wait(timeout=30)
except subprocess.TimeoutExpired:
    proc.kill()
    rc = "still running after the second SIGINT"
os.close(r)
err = proc.stderr.read()
check("SIGINT exits 130 (second one at once)", rc == 130, f"rc {rc} {err[-300:]!r}")
n = restored(sess)
check("SIGINT saved the tokens generated so far", 13 + 100 < n < 13 + 8000, f"restored {n}; {err[-300:]!r}")
check("SIGINT said it was interrupted", b"interrupted" in err, repr(err[-300:]))

# --chat: the session is written at the end of input and on an interrupt.
chat_sess = os.path.join(tmp, "chat.session")
r, w = os.pipe()
proc = subprocess.Popen([cli, "-m", model, "--chat", "-n", "8", "--temp", "0", "--session", chat_sess],
                        stdin=r, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
os.close(r)
os.write(w, b"Hello\n")
err = b""
deadline = time.monotonic() + 60
while err.count(b"> ") < 2 and time.monotonic() < deadline:  # the second prompt: the first turn is done
    err += os.read(proc.stderr.fileno(), 4096)
proc.send_signal(signal.SIGTERM)
rc = proc.wait(timeout=60)
os.close(w)
check("SIGTERM in --chat exits 143", rc == 143, f"rc {rc}")
check("SIGTERM in --chat saved the session", restored(chat_sess) > 5)

check.finish()
