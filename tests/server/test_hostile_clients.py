"""tandem-server against hostile or broken clients (127.0.0.1 only): bodies bounded while
they are read (chunked or not, before authentication), bounded headers, a connection cap,
and a header deadline that keeps /health and /metrics answering under a slow-client flood.

Memory is measured from /proc (VmHWM, the peak resident set), never timed; the flood test
asserts only that the probes answer while every slow connection is still held open, i.e.
before the slow clients' deadline.
"""
import json
import socket
import subprocess
import time

import httpx
import pytest

from conftest import ALIAS, Server

MIB = 1 << 20


def vm_kib(server, field):
    with open(f"/proc/{server.proc.pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{server.proc.pid}/status")


def reset_peak(server):
    """Start VmHWM afresh (writing 5 to clear_refs resets the peak, Linux >= 4.0), so that an
    earlier test's peak cannot hide this one's."""
    with open(f"/proc/{server.proc.pid}/clear_refs", "w") as f:
        f.write("5")


def connect(server):
    return socket.create_connection(("127.0.0.1", server.port), timeout=60)


def read_response(sock):
    """(status, headers dict, body bytes) of one HTTP/1.1 response read until the server closes."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            break
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines and lines[0].startswith("HTTP/1.1 "), repr(data[:200])
    headers = {k.strip().lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:] if ":" in l)}
    return int(lines[0].split()[1]), headers, body


def send_chunked(server, path, total_bytes, headers=""):
    """POST `total_bytes` of chunked body (1 MiB chunks) until the server stops reading, then
    return its response."""
    s = connect(server)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
              "Transfer-Encoding: chunked\r\n\r\n".encode())
    chunk = b"%x\r\n" % MIB + b"x" * MIB + b"\r\n"
    try:
        for _ in range(total_bytes // MIB):
            s.sendall(chunk)
        s.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed: what follows is the response
    try:
        return read_response(s)
    finally:
        s.close()


def assert_openai_error(status, body, want):
    assert status == want, body[:300]
    err = json.loads(body)["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"] and err["code"]
    return err


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """An API key and a 1 MiB body limit."""
    s = Server(tmp_path_factory.mktemp("guarded"), extra=["--api-key", "secret", "--body-limit", str(MIB)])
    assert s.wait_ready(), s.log_path.read_text()
    yield s
    assert s.stop() == 0, s.log_path.read_text()


def test_chunked_oversize_body_is_413_with_bounded_memory(guarded):
    """200 MB chunked to a generation route: 413 (an OpenAI error object), the peak resident
    set grows by far less than the body (it used to be read whole: +1 GB)."""
    reset_peak(guarded)
    before = vm_kib(guarded, "VmHWM")
    status, headers, body = send_chunked(guarded, "/v1/chat/completions", 200 * MIB,
                                         headers="Authorization: Bearer secret\r\n")
    grown = vm_kib(guarded, "VmHWM") - before
    assert grown < 64 * 1024, f"peak RSS grew by {grown} KiB for a 1 MiB limit"
    err = assert_openai_error(status, body, 413)
    assert err["code"] == "request_too_large"
    assert headers.get("connection") == "close"
    assert httpx.get(guarded.url + "/health").status_code == 200


def test_chunked_oversize_on_unguarded_route_is_413_with_bounded_memory(guarded):
    """POST /metrics (no API key needed, no POST handler) and an unknown route (with the key:
    without it, 401 comes first and nothing is read): the body is read within the limit
    too, then 413; a small body gets 405 (the route answers GET only)."""
    reset_peak(guarded)
    before = vm_kib(guarded, "VmHWM")
    answers = [send_chunked(guarded, path, 200 * MIB, headers=headers)
               for path, headers in (("/metrics", ""), ("/no/such/route", "Authorization: Bearer secret\r\n"))]
    grown = vm_kib(guarded, "VmHWM") - before
    assert grown < 64 * 1024, f"peak RSS grew by {grown} KiB for a 1 MiB limit"
    for status, _, body in answers:
        assert_openai_error(status, body, 413)
    status, _, body = send_chunked(guarded, "/metrics", 0)
    assert_openai_error(status, body, 405)


def test_declared_oversize_body_is_413_before_authentication(guarded):
    """A Content-Length over the limit is refused from the headers alone, before the API key
    is checked and without the body being sent."""
    s = connect(guarded)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 300000000\r\n\r\n")
        status, headers, body = read_response(s)
    finally:
        s.close()
    assert_openai_error(status, body, 413)
    assert headers.get("connection") == "close"
    assert "keep-alive" not in headers, headers  # a response that closes offers no keep-alive


def test_chunked_body_without_key_is_401_unread(guarded):
    status, _, body = send_chunked(guarded, "/v1/completions", 50 * MIB)
    assert_openai_error(status, body, 401)


def test_chunked_body_within_limit_is_served(guarded):
    """Chunked uploads are still accepted: a small chunked request gets its completion."""
    payload = json.dumps({"model": ALIAS, "prompt": "Once upon a time", "max_tokens": 2}).encode()
    s = connect(guarded)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer secret\r\n"
                  b"Content-Type: application/json\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n" +
                  b"%x\r\n" % len(payload) + payload + b"\r\n0\r\n\r\n")
        status, _, body = read_response(s)
    finally:
        s.close()
    assert status == 200, body[:300]
    assert json.loads(body)["usage"]["completion_tokens"] == 2


def test_header_size_and_count_bounded(guarded):
    many = "".join(f"X-H{i}: v\r\n" for i in range(500))
    s = connect(guarded)
    try:
        s.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\n{many}\r\n".encode())
        status, _, body = read_response(s)
    finally:
        s.close()
    assert_openai_error(status, body, 431)
    # 1 MiB of one header line: refused once the cap (64 KiB) is reached, not buffered whole.
    s = connect(guarded)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        try:
            for _ in range(16):
                s.sendall(b"y" * (64 << 10))
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, _, body = read_response(s)
    finally:
        s.close()
    assert_openai_error(status, body, 431)


def test_slow_client_flood_leaves_health_and_metrics_answering(tmp_path):
    """500 connections that send part of a request line and stall. /health and /metrics
    answer while all of them are still open, i.e. before their header deadline (300 s here);
    afterwards every slow connection is still held (none was dropped to make room)."""
    n = 500
    s = Server(tmp_path, extra=["--header-timeout", "300"])
    assert s.wait_ready(), s.log_path.read_text()
    slow = []
    try:
        for _ in range(n):
            c = connect(s)
            c.sendall(b"GET /hea")
            slow.append(c)
        assert httpx.get(s.url + "/health", timeout=300).json() == {"status": "ok"}
        assert "vllm:num_requests_running" in httpx.get(s.url + "/metrics", timeout=300).text
        still_open = 0
        for c in slow:
            c.setblocking(False)
            try:
                c.recv(1)  # b"" (closed) or data would both mean the server let go of it
            except BlockingIOError:
                still_open += 1
        assert still_open == n
    finally:
        for c in slow:
            c.close()
        assert s.stop() == 0, s.log_path.read_text()


def test_header_deadline_closes_a_stalled_connection(tmp_path):
    s = Server(tmp_path, extra=["--header-timeout", "0.5"])
    assert s.wait_ready(), s.log_path.read_text()
    try:
        c = connect(s)
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        status, headers, body = read_response(c)  # read until the server closes (60 s socket timeout)
        c.close()
        assert_openai_error(status, body, 408)
        assert headers.get("connection") == "close" and "keep-alive" not in headers, headers
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        assert s.stop() == 0, s.log_path.read_text()


def test_body_deadline_closes_a_trickling_upload(tmp_path):
    """A client that sends its headers at once and then its body a byte at a time (each byte
    well within the per-read timeout) is cut off at the body deadline, for a declared length
    and for chunked encoding alike: 408, and the connection is closed."""
    s = Server(tmp_path, extra=["--body-timeout", "0.5"])
    assert s.wait_ready(), s.log_path.read_text()
    try:
        for framing, first in [("Content-Length: 1000\r\n", b"{"), ("Transfer-Encoding: chunked\r\n", b"3e8\r\n{")]:
            c = connect(s)
            c.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"{framing}\r\n".encode() + first)
            sent = 0
            try:
                while sent < 999:  # far more time than the deadline, one byte per 50 ms
                    time.sleep(0.05)
                    c.sendall(b" ")
                    sent += 1
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered and closed
            status, headers, body = read_response(c)
            c.close()
            assert sent < 999, "the whole body was accepted"
            assert_openai_error(status, body, 408)
            assert headers.get("connection") == "close"
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        assert s.stop() == 0, s.log_path.read_text()


def test_connection_cap_answers_503_beyond_it_but_health_and_metrics(tmp_path):
    s = Server(tmp_path, extra=["--max-connections", "8", "--header-timeout", "300"])
    assert s.wait_ready(), s.log_path.read_text()

    def hold():
        c = connect(s)
        c.sendall(b"GET /hea")
        return c

    def answered(c):  # the server wrote to or closed a held connection (a 503: it came over the cap)
        c.setblocking(False)
        try:
            c.recv(1)
            return True
        except BlockingIOError:
            return False
        finally:
            c.setblocking(True)

    held = [hold() for _ in range(8)]
    try:
        # The connections of wait_ready() may still count for a moment, so a held one can come
        # over the cap: replace those until the 8 held are what the server counts (they are
        # held for 300 s), then a 9th connection gets 503.
        deadline = time.monotonic() + 60
        while True:
            held = [hold() if answered(c) and not c.close() else c for c in held]
            r = httpx.get(s.url + "/v1/models", timeout=60)
            if r.status_code == 503:
                break
            assert time.monotonic() < deadline, "a 9th connection was still served with 8 held"
            time.sleep(0.05)
        assert r.json()["error"]["code"] == "too_many_connections"
        assert r.headers.get("retry-after") == "1"
        assert r.headers.get("connection") == "close"
        # The liveness probe and the metrics scrape are served beyond the cap (a reserve of
        # connections for GET /health and GET /metrics only), while the 8 are still held.
        assert httpx.get(s.url + "/health", timeout=60).json() == {"status": "ok"}
        assert "vllm:num_requests_running" in httpx.get(s.url + "/metrics", timeout=60).text
        assert httpx.get(s.url + "/v1/models", timeout=60).status_code == 503
        assert not any(answered(c) for c in held), "a held connection was dropped to make room"
        for c in held:
            c.close()
        held = []
        deadline = time.monotonic() + 60  # the server notices the closes on its own threads
        while httpx.get(s.url + "/health", timeout=60).status_code != 200:
            assert time.monotonic() < deadline, "the cap was not released after the connections closed"
            time.sleep(0.05)
    finally:
        for c in held:
            c.close()
        assert s.stop() == 0, s.log_path.read_text()


def test_expect_continue_with_oversize_body_is_413_before_the_body(guarded):
    s = connect(guarded)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer secret\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 300000000\r\nExpect: 100-continue\r\n\r\n")
        status, _, body = read_response(s)  # no "100 Continue": the body is never asked for
    finally:
        s.close()
    assert_openai_error(status, body, 413)


def test_sigterm_does_not_wait_for_slow_clients_deadline(tmp_path):
    """Slow connections do not hold a shutdown until their header deadline (300 s here): the
    server exits 0 while they are still open."""
    s = Server(tmp_path, extra=["--header-timeout", "300"])
    assert s.wait_ready(), s.log_path.read_text()
    slow = []
    try:
        for _ in range(50):
            c = connect(s)
            c.sendall(b"GET /hea")
            slow.append(c)
        assert httpx.get(s.url + "/health").status_code == 200
        assert s.stop(timeout=240) == 0, s.log_path.read_text()
    finally:
        for c in slow:
            c.close()
        s.stop()


def test_a_port_in_use_is_refused(tmp_path):
    """A second server on a port another one listens on exits 1 saying it cannot listen
    (llama-server: "couldn't bind HTTP server socket"), instead of sharing the port and
    taking part of its connections."""
    first = Server(tmp_path)
    assert first.wait_ready(), first.log_path.read_text()
    try:
        cmd = [*first.proc.args]
        second = subprocess.run(cmd, capture_output=True, timeout=60)
        log = (second.stdout + second.stderr).decode(errors="replace")
        assert second.returncode == 1, log
        assert "cannot listen" in log and "in use" in log, log
        assert httpx.get(first.url + "/health").status_code == 200
    finally:
        assert first.stop() == 0, first.log_path.read_text()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Default limits (a 5 s read timeout, 60 s body deadline)."""
    s = Server(tmp_path_factory.mktemp("plain"))
    assert s.wait_ready(), s.log_path.read_text()
    yield s
    assert s.stop() == 0, s.log_path.read_text()


@pytest.mark.parametrize("framing", [
    "Content-Length: -1\r\n",
    "Content-Length: abc\r\n",
    "Content-Length: 12abc\r\n",
    "Content-Length: +5\r\n",
    "Content-Length: 0x10\r\n",
    "Content-Length: 5\r\nContent-Length: 6\r\n",
    "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
])
def test_malformed_content_length_is_400_and_closes(plain, framing):
    """A Content-Length that is not digits only, repeated with another value, or sent with
    Transfer-Encoding (RFC 9112 6.3) is 400 naming the framing, before any body is read (not
    413 because httplib reads "-1" as 2^64 - 1, nor a wait for a body of "12abc" = 12
    bytes), and the connection is closed."""
    s = plain
    c = connect(s)
    c.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{framing}\r\n".encode()
              + b'{"prompt": "a"}')
    status, headers, body = read_response(c)  # read until the server closes
    c.close()
    err = assert_openai_error(status, body, 400)
    assert "Content-Length" in err["message"], err
    assert headers.get("connection") == "close"
    assert "keep-alive" not in headers, headers
    assert httpx.get(s.url + "/health").status_code == 200


@pytest.mark.parametrize("coding", ["gzip", "gzip, chunked", "identity", "chunked\r\nTransfer-Encoding: chunked"])
def test_unknown_transfer_coding_is_501_at_once_and_closes(plain, coding):
    """A transfer coding other than a lone `chunked` is 501 naming it (RFC 9112 6.1), from the
    headers alone: the server never waits for a body it cannot decode (it used to wait for the
    body deadline and answer 408). The client sends no body; a timeout here means it waited."""
    s = plain
    c = connect(s)
    c.settimeout(3)  # far below the 5 s read timeout the old behaviour waited for
    c.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Transfer-Encoding: {coding}\r\n\r\n".encode())
    status, headers, body = read_response(c)
    c.close()
    err = assert_openai_error(status, body, 501)
    assert "Transfer-Encoding" in err["message"] and err["code"] == "unsupported_transfer_encoding", err
    assert headers.get("connection") == "close"
    assert httpx.get(s.url + "/health").status_code == 200


@pytest.mark.parametrize("line", ["NoColonHere", " folded-continuation", "\tfolded"])
def test_header_line_without_colon_or_folded_is_400(plain, line):
    """A header line without a colon, or an obsolete line fold, is 400 (RFC 9112 5.1, 5.2):
    httplib skipped such a line, and a proxy in front that reads it otherwise is a request
    smuggling vector. A colon in a value, or a value with spaces, stays a header line."""
    s = plain
    c = connect(s)
    c.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\n{line}\r\n\r\n".encode())
    status, headers, body = read_response(c)
    c.close()
    err = assert_openai_error(status, body, 400)
    assert err["code"] == "invalid_header_line", err
    assert headers.get("connection") == "close"
    c = connect(s)
    c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Note: a b:c\r\nConnection: close\r\n\r\n")
    status, _, body = read_response(c)
    c.close()
    assert status == 200 and json.loads(body) == {"status": "ok"}


def test_malformed_content_length_with_expect_continue_is_400(plain):
    s = plain
    c = connect(s)
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: -1\r\nExpect: 100-continue\r\n\r\n")
    status, headers, body = read_response(c)
    c.close()
    assert_openai_error(status, body, 400)
    assert headers.get("connection") == "close"


def test_stalled_body_is_408_and_closes(plain):
    """A body that stops arriving (a part sent, then nothing) is a timeout whichever deadline
    passes first, the per-read timeout (5 s) or --body-timeout: 408 and Connection: close."""
    s = plain
    c = connect(s)
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"prompt\"")
    status, headers, body = read_response(c)  # the server answers and closes; never the rest
    c.close()
    assert_openai_error(status, body, 408)
    assert headers.get("connection") == "close"
    assert httpx.get(s.url + "/health").status_code == 200



def test_request_line_over_64k_is_answered(plain):
    """A request line over the 64 KiB header cap is answered (414, an OpenAI error object)
    and closed, not dropped without a response; one under it but over 8 KiB is 414 too."""
    for size in (70 << 10, 16 << 10):
        c = connect(plain)
        try:
            c.sendall(b"GET /" + b"a" * size + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, headers, body = read_response(c)
        c.close()
        assert_openai_error(status, body, 414)
        assert headers.get("connection") == "close" and "keep-alive" not in headers, headers
    assert httpx.get(plain.url + "/health").status_code == 200


@pytest.mark.parametrize("method", ["FOO", "BREW", "get"])
def test_unknown_method_is_501(plain, method):
    """A method the server does not know is 501 Not Implemented (RFC 9110 15.6.2) with the
    OpenAI error object naming it, and the connection closes; a known method on a route that
    does not answer it stays 405."""
    c = connect(plain)
    c.sendall(f"{method} /health HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    status, headers, body = read_response(c)
    c.close()
    err = assert_openai_error(status, body, 501)
    assert method in err["message"] and err["code"] == "method_not_implemented", err
    assert headers.get("connection") == "close"
    assert httpx.delete(plain.url + "/health").status_code == 405


def hold_body(server, declared, sent, path="/v1/completions"):
    """A connection that declares a `declared`-byte body and sends `sent` bytes of it."""
    c = connect(server)
    c.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {declared}\r\n\r\n".encode())
    try:
        c.sendall(b" " * sent)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused and closed
    return c


def assert_budget_503(status, headers, body):
    err = assert_openai_error(status, body, 503)
    assert err["code"] == "body_budget_exhausted", err
    assert headers.get("retry-after") == "1" and headers.get("connection") == "close", headers


def test_body_budget_bounds_memory_of_held_bodies(tmp_path):
    """64 connections each declare a 1 MiB body (the limit) and send all of it but the last
    byte. The server-wide body budget (4 MiB + 256 KiB here) holds 4 such bodies at a time;
    the others get 503 (OpenAI error object, Retry-After) from their headers, before a byte of
    the body is read, so the peak resident set grows by far less than the 64 MiB the clients
    hold out (without the budget every body is read: +64 MiB or more). Meanwhile a small
    request is served. A held body ends with 408 (the 5 s read timeout) and frees its part."""
    n, limit = 64, MIB
    s = Server(tmp_path, extra=["--body-limit", str(limit), "--body-budget", str(4 * limit + 256 * 1024)])
    assert s.wait_ready(), s.log_path.read_text()
    conns = []
    try:
        reset_peak(s)
        before = vm_kib(s, "VmHWM")
        conns = [hold_body(s, limit, limit - 1) for _ in range(n)]
        r = httpx.post(s.url + "/v1/completions", json={"model": ALIAS, "prompt": "Once upon a time", "max_tokens": 2},
                       timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        statuses = []
        for c in conns:
            status, headers, body = read_response(c)
            statuses.append(status)
            if status == 503:
                assert_budget_503(status, headers, body)
        grown = vm_kib(s, "VmHWM") - before
        assert grown < 24 * 1024, f"peak RSS grew by {grown} KiB with a 4.25 MiB body budget"
        # 4 admitted at a time (more only if one timed out while the 64 were still connecting).
        assert statuses.count(503) >= n // 2 and set(statuses) == {408, 503}, statuses
        # All released when their connections ended: a body the size of the limit fits again.
        r = httpx.post(s.url + "/v1/completions", content=b'{"prompt": "a", "max_tokens": 1}' + b" " * (limit - 64),
                       headers={"Content-Type": "application/json"}, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        for c in conns:
            c.close()
        assert s.stop() == 0, s.log_path.read_text()


def test_body_budget_grows_with_chunked_bodies(tmp_path):
    """A chunked body takes from the budget as its chunks arrive: with 1 MiB of a 1.25 MiB
    budget held by a stalled upload, a chunked body of 1 MiB (within the limit) is cut off
    with 503 once it outgrows what is left; a small chunked one still fits."""
    s = Server(tmp_path, extra=["--body-limit", str(MIB), "--body-budget", str(MIB + MIB // 4)])
    assert s.wait_ready(), s.log_path.read_text()
    held = None
    try:
        held = hold_body(s, MIB, MIB - 1)
        assert_budget_503(*send_chunked(s, "/v1/completions", MIB))
        payload = json.dumps({"model": ALIAS, "prompt": "Once", "max_tokens": 1}).encode()
        c = connect(s)
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nTransfer-Encoding: chunked\r\n\r\n" +
                  b"%x\r\n" % len(payload) + payload + b"\r\n0\r\n\r\n")
        status, _, body = read_response(c)
        c.close()
        assert status == 200, body[:300]
        assert read_response(held)[0] == 408
    finally:
        if held:
            held.close()
        assert s.stop() == 0, s.log_path.read_text()
