#!/usr/bin/env python3
"""tandem-server --executors gpu (and cpu+gpu) where no GPU can be used: the model loads,
the GPU executor cannot be created, and the log says that (with the underlying reason),
not that the model cannot be loaded; the process exits 1. No GPU is needed:
CUDA_VISIBLE_DEVICES="" hides every device (a build without CUDA refuses the executor too).
A file that is not a GGUF still says "cannot load the model".

Usage: test_server_executors.py TANDEM_SERVER SHARED_DIR   (TANDEM_SHARED wins)
"""
import json
import os
import socket
import subprocess
import sys

from faults_support import Checks, model_path

server = sys.argv[1]
model = model_path(sys.argv[2])
check = Checks("tandem-server-executors-")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(model_file, executors):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([server, "-m", model_file, "--port", str(free_port()), "--executors", executors, "-t", "1",
                        "--log-format", "json"], stdin=subprocess.DEVNULL, capture_output=True, timeout=120, env=env)
    lines = (p.stdout + p.stderr).decode(errors="replace").splitlines()
    return p.returncode, [json.loads(line) for line in lines if line.startswith("{")]


for executors in ("gpu", "cpu+gpu"):
    rc, log = run(model, executors)
    errors = [e for e in log if e.get("level") == "error"]
    check(f"--executors {executors} without a GPU: exit 1", rc == 1, f"rc {rc} {log!r}")
    check(f"--executors {executors}: one error, the executor could not be created",
          len(errors) == 1 and errors[0].get("msg") == "cannot create the executors" and
          errors[0].get("executors") == executors and "GPU" in errors[0].get("error", ""), repr(errors))
    check(f"--executors {executors}: the model is not blamed",
          not any("cannot load the model" in e.get("msg", "") for e in log), repr(log))

garbage = os.path.join(check.tmp, "garbage.gguf")
with open(garbage, "wb") as f:
    f.write(bytes(range(256)) * 16)
rc, log = run(garbage, "cpu")
check("a file that is not a GGUF: exit 1, cannot load the model",
      rc == 1 and any(e.get("msg") == "cannot load the model" for e in log), f"rc {rc} {log!r}")
check.finish()
