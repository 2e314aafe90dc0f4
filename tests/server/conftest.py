"""Fixtures for the tandem-server tests: start a server, wait for /health, stop it.

Environment: TANDEM_SERVER_BIN, TANDEM_CLI_BIN (the built tools), TANDEM_MODELS (the
shared model directory), TANDEM_SERVER_EXECUTORS ("cpu" or "cpu+cpu"), TANDEM_SMOLLM2
(optional chat model; default ~/.cache/tandem/SmolLM2-135M-Instruct.Q4_1.gguf).
"""
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVER_BIN = os.environ.get("TANDEM_SERVER_BIN", str(ROOT / "build/release/examples/tandem-server"))
CLI_BIN = os.environ.get("TANDEM_CLI_BIN", str(ROOT / "build/release/examples/tandem-cli"))
MODELS = Path(os.environ.get("TANDEM_MODELS", str(ROOT.parent / "shared/models")))
EXECUTORS = os.environ.get("TANDEM_SERVER_EXECUTORS", "cpu")
TINY = MODELS / "aidreams260K-q4_0.gguf"
ALIAS = "tiny"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One tandem-server process; `url` is its base URL, `log` its stderr file."""

    def __init__(self, tmp_path, model=TINY, extra=(), alias=ALIAS):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"server-{self.port}.log"
        self._log = open(self.log_path, "w")
        cmd = [SERVER_BIN, "-m", str(model), "--port", str(self.port), "--executors", EXECUTORS,
               "-t", "2", "--alias", alias, *([] if "--log-format" in extra else ["--log-format", "json"]), *extra]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout=60.0):
        """True once /health answers 200; False if the process exited first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"tandem-server not ready in {timeout}s:\n{self.log_path.read_text()}")

    def metrics(self):
        """/metrics as {name{labels}: value} for the samples without le= buckets."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=5.0).text.splitlines():
            if line.startswith("#") or "_bucket{" in line:
                continue
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
        return out

    def metric(self, name, **labels):
        """Sum of a metric's samples whose labels include `labels`."""
        total = 0.0
        for key, v in self.metrics().items():
            base = key.split("{", 1)[0]
            if base == name and all(f'{k}="{val}"' in key for k, val in labels.items()):
                total += v
        return total

    def stop(self, sig=signal.SIGTERM, timeout=60.0):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._log.close()
        return rc


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("srv"), extra=["-np", "4"])
    assert s.wait_ready(), s.log_path.read_text()
    yield s
    assert s.stop() == 0, s.log_path.read_text()


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory):
    """API key, a 4 KiB body limit, one slot, a queue of 2, no prefix cache (so that the
    KV usage of an idle server is exactly 0)."""
    s = Server(tmp_path_factory.mktemp("strict"),
               extra=["--api-key", "secret", "--body-limit", "4096", "-np", "1", "--max-queued", "2",
                      "--prefix-cache", "0"])
    assert s.wait_ready(), s.log_path.read_text()
    yield s
    assert s.stop() == 0, s.log_path.read_text()
