"""tandem-server through the official OpenAI Python client (and raw HTTP for bad input).

Truth is independent of the server: tandem-cli's greedy output for the same prompt, the
server's own solo runs for concurrent ones, hand-written expectations for shapes and
statuses. No timing assertions: waits poll with a timeout.
"""
import concurrent.futures as cf
import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from conftest import ALIAS, CLI_BIN, SERVER_BIN, TINY, Server

PROMPT = "Once upon a time"


def client(server, key="none"):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120.0)


def cli_greedy(prompt, n):
    out = subprocess.run([CLI_BIN, "-m", str(TINY), "-p", prompt, "-n", str(n), "--temp", "0", "--json", "-t", "1"],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def greedy_completion(c, prompt, n, **kw):
    return c.completions.create(model=ALIAS, prompt=prompt, max_tokens=n, temperature=0, **kw)


# --- OpenAI shapes and answers -------------------------------------------------------------

def test_models_and_health(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = client(server).models.list()
    assert [m.id for m in models.data] == [ALIAS]
    assert models.data[0].object == "model"


def test_completion_text_equals_tandem_cli(server):
    ref = cli_greedy(PROMPT, 24)
    r = greedy_completion(client(server), PROMPT, 24)
    assert r.object == "text_completion"
    assert r.choices[0].text == ref["text"]
    assert r.choices[0].finish_reason == ref["finish_reason"]
    assert r.usage.prompt_tokens == len(ref["prompt_ids"])
    assert r.usage.completion_tokens == len(ref["ids"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_token_ids_equal_text(server):
    ref = cli_greedy(PROMPT, 16)
    c = client(server)
    by_ids = greedy_completion(c, ref["prompt_ids"], 16)
    assert by_ids.choices[0].text == ref["text"]
    assert by_ids.usage.prompt_tokens == len(ref["prompt_ids"])


def cli_tokenize(text, parse_special):
    out = subprocess.run([CLI_BIN, "tokenize", "-m", str(TINY), "-p", text, *(["--parse-special"] if parse_special else [])],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def test_completion_prompt_parses_special_tokens(server):
    """A completion prompt's special tokens are parsed, as llama-server and vLLM do ("<s>" is
    one token here, "<|im_start|>" in a ChatML model): usage and text equal those of the ids
    tandem-cli tokenize --parse-special gives."""
    text = "<s>" + PROMPT
    special, plain = cli_tokenize(text, True), cli_tokenize(text, False)
    assert len(special) < len(plain)
    c = client(server)
    r = greedy_completion(c, text, 12)
    assert r.usage.prompt_tokens == len(special)
    assert r.choices[0].text == greedy_completion(c, special, 12).choices[0].text


def test_chat_content_stays_plain_text(server):
    """Chat message content is never parsed for special tokens: "<s>" in it is several tokens."""
    c = client(server)

    def prompt_tokens(content):
        return c.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": content}],
                                         max_tokens=1).usage.prompt_tokens

    assert prompt_tokens("<s>hi") - prompt_tokens("hi") >= 2


def test_completion_prompt_lists(server):
    """vLLM's prompt shapes: token ids, a one-element list of ids or of a string; a batch of
    several prompts is refused with a 400 that says so."""
    ids = cli_greedy(PROMPT, 8)["prompt_ids"]
    c = client(server)
    want = greedy_completion(c, PROMPT, 8).choices[0].text
    assert greedy_completion(c, ids, 8).choices[0].text == want
    assert greedy_completion(c, [ids], 8).choices[0].text == want
    assert greedy_completion(c, [PROMPT], 8).choices[0].text == want
    for batch in ([ids, ids], [PROMPT, PROMPT]):
        with pytest.raises(openai.BadRequestError) as e:
            greedy_completion(c, batch, 8)
        assert e.value.body["param"] == "prompt"
        assert "one prompt per request" in e.value.body["message"]


def test_completion_stream_equals_non_stream(server):
    c = client(server)
    whole = greedy_completion(c, PROMPT, 20).choices[0].text
    chunks = list(greedy_completion(c, PROMPT, 20, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_chat_non_stream_and_stream(server):
    c = client(server)
    msgs = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A story, please."}]
    r = c.chat.completions.create(model=ALIAS, messages=msgs, max_tokens=12, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 12
    stream = c.chat.completions.create(model=ALIAS, messages=msgs, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # The route reaches the client as a header.
    raw = c.chat.completions.with_raw_response.create(model=ALIAS, messages=msgs, max_tokens=2,
                                                      extra_body={"sla": "interactive"})
    assert "prefill=" in raw.headers["x-tandem-route"]
    assert "sla interactive" in raw.headers["x-tandem-route-reason"]
    raw = c.chat.completions.with_raw_response.create(model=ALIAS, messages=msgs, max_tokens=2,
                                                      extra_headers={"x-tandem-sla": "batch"})
    assert "sla batch" in raw.headers["x-tandem-route-reason"]


def test_stop_string(server):
    c = client(server)
    full = greedy_completion(c, PROMPT, 24).choices[0].text
    stop = full[8:11]
    assert len(stop) == 3
    r = greedy_completion(c, PROMPT, 24, stop=[stop, "\u2603never"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.find(stop)]


def test_seed_reproducible(server):
    c = client(server)
    run = lambda seed: c.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=24, temperature=1.0,
                                            top_p=1.0, seed=seed).choices[0].text
    assert run(42) == run(42)
    assert any(run(s) != run(42) for s in (43, 44, 45))


def test_tokenize_detokenize(server):
    ref = cli_greedy(PROMPT, 1)
    t = httpx.post(server.url + "/tokenize", json={"content": PROMPT, "add_special": True}).json()
    assert t["tokens"] == ref["prompt_ids"]
    pieces = httpx.post(server.url + "/tokenize", json={"content": PROMPT, "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces).strip() == PROMPT
    d = httpx.post(server.url + "/detokenize", json={"tokens": ref["ids"]}).json()
    assert d["content"] == cli_greedy(PROMPT, 1)["text"]


# --- concurrency ---------------------------------------------------------------------------

def test_32_concurrent_streams_equal_solo_runs(server):
    c = client(server)
    prompts = [f"Story {i}: the {w} went" for i, w in enumerate(["cat", "dog", "king", "boat"] * 8)]
    solo = [greedy_completion(c, p, 24).choices[0].text for p in prompts]

    def streamed(p):
        return "".join(ch.choices[0].text for ch in greedy_completion(c, p, 24, stream=True) if ch.choices)

    with cf.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(streamed, prompts))
    assert got == solo


def wait_idle(server, timeout=10.0):
    """Poll until running, waiting and KV usage are all 0; returns the last readings."""
    deadline = time.monotonic() + timeout
    while True:
        vals = (server.metric("vllm:num_requests_running"), server.metric("vllm:num_requests_waiting"),
                server.metric("vllm:kv_cache_usage_perc"))
        if vals == (0, 0, 0) or time.monotonic() > deadline:
            return vals
        time.sleep(0.05)


def test_random_disconnects_free_everything(tmp_path):
    s = Server(tmp_path, extra=["-np", "1", "--prefix-cache", "0"])
    assert s.wait_ready()
    try:
        rng = random.Random(7)

        def disconnect_after(k):
            body = {"model": ALIAS, "messages": [{"role": "user", "content": f"tell me story {k}"}],
                    "stream": True, "max_tokens": 64}
            with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60.0) as r:
                assert r.status_code == 200
                for i, _ in enumerate(r.iter_lines()):
                    if i >= k:
                        break  # leaving the block closes the connection mid-stream

        with cf.ThreadPoolExecutor(16) as pool:
            list(pool.map(disconnect_after, [rng.randrange(0, 6) for _ in range(16)]))
        assert wait_idle(s, timeout=10.0) == (0, 0, 0)
        assert s.metric("vllm:request_success_total", finished_reason="abort") >= 1
        # Still serving.
        assert greedy_completion(client(s), PROMPT, 4).choices[0].finish_reason == "length"
    finally:
        assert s.stop() == 0


# --- OpenAI values only, and the client's other calls -----------------------------------

def test_timeout_is_finish_reason_length_with_tandem_timeout(server):
    """A request's `timeout` ends it with OpenAI's "length" (strict clients know no
    "timeout"), the timeout said by the extension field "tandem_timeout": true. 1 ms for
    ~100 tokens: tried until one request times out (every answer checked)."""
    c = client(server)
    timed_out = 0
    for _ in range(20):
        r = c.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=100, temperature=0,
                                 extra_body={"timeout": 0.001})
        choice = r.choices[0].model_dump()
        assert choice["finish_reason"] in ("stop", "length")
        if choice.get("tandem_timeout"):
            assert choice["finish_reason"] == "length"
            timed_out += 1
            break
    assert timed_out == 1
    for _ in range(20):  # streaming: the last choice chunk the same
        chunks = list(c.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=100, temperature=0, stream=True,
                                           extra_body={"timeout": 0.001}))
        last = chunks[-1].choices[0].model_dump()
        assert all(ch.choices[0].finish_reason in (None, "stop", "length") for ch in chunks)
        if last.get("tandem_timeout"):
            assert last["finish_reason"] == "length"
            return
    pytest.fail("no streamed request timed out in 20 tries of 1 ms for 100 tokens")


def test_models_retrieve(server):
    c = client(server)
    m = c.models.retrieve(ALIAS)
    assert m.id == ALIAS and m.object == "model"
    assert httpx.get(server.url + "/v1/models/" + ALIAS).json()["id"] == ALIAS
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"


def test_help_shows_defaults_and_aliases():
    out = subprocess.run([SERVER_BIN, "--help"], check=True, capture_output=True, text=True).stdout
    assert out.startswith("tandem-server")
    for expected in ("-np", "-ctk", "-ctv", "--port INT", "=8080", "=127.0.0.1", "=8388608", "--max-connections",
                     "--header-timeout"):
        assert expected in out, expected


# --- vLLM's metric semantics ----------------------------------------------------------------

def test_idle_kv_usage_is_zero_with_the_prefix_cache_holding_pages(tmp_path):
    """vllm:kv_cache_usage_perc counts pages held by running or waiting requests: pages only
    the prefix cache holds are evictable, free as vLLM counts them; an idle server says 0."""
    s = Server(tmp_path, extra=["-np", "2", "--prefix-cache", "4"])
    assert s.wait_ready()
    try:
        c = client(s)
        for i in range(3):  # prompts of several 16-token pages, so that finished ones are cached
            greedy_completion(c, f"{PROMPT} there was a little girl called Lily number {i}", 8)
        assert wait_idle(s) == (0, 0, 0)
        cached = s.metric("tandem:kv_pages", state="used")
        assert cached > 0, "the prefix cache should hold the finished prompts' pages"
        # ... and they are reused: the test is about pages that are really kept.
        greedy_completion(c, f"{PROMPT} there was a little girl called Lily number 0", 8)
        assert s.metric("tandem:prefix_cache_hit_tokens_total") > 0
        assert wait_idle(s) == (0, 0, 0)
    finally:
        assert s.stop() == 0


def test_cache_config_info(server):
    """vllm:cache_config_info as vLLM exports it: an info gauge (value 1) whose labels are the
    cache configuration; num_gpu_blocks is the compute tier's capacity in pages."""
    text = httpx.get(server.url + "/metrics").text
    assert "# TYPE vllm:cache_config_info gauge" in text
    [line] = [l for l in text.splitlines() if l.startswith("vllm:cache_config_info{")]
    labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.rindex("}")].split(","))
    labels = {k: v.strip('"') for k, v in labels.items()}
    assert line.endswith("} 1")
    assert labels["block_size"] == "16"
    assert labels["cache_dtype"] == "f16"
    assert labels["enable_prefix_caching"] == "True"
    capacity = sum(server.metric("tandem:kv_pages", tier="host", state=st) for st in ("used", "reserved", "free"))
    assert int(labels["num_gpu_blocks"]) == capacity > 0
    assert labels["num_cpu_blocks"] == "0"  # no --kv-tier file


# --- bad input -----------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
MALFORMED = [
    ("invalid json", CHAT, b"{not json", 400, None),
    ("body is an array", CHAT, [1, 2], 400, None),
    ("messages missing", CHAT, {"model": ALIAS}, 400, "messages"),
    ("messages not an array", CHAT, {"messages": "hi"}, 400, "messages"),
    ("messages empty", CHAT, {"messages": []}, 400, "messages"),
    ("message not an object", CHAT, {"messages": ["hi"]}, 400, "messages[0]"),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("content a number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("image content part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content"),
    ("temperature a string", CHAT, {"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ("temperature out of range", CHAT, {"messages": MSG, "temperature": 7}, 400, "temperature"),
    ("top_p out of range", CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    ("top_k negative", CHAT, {"messages": MSG, "top_k": -1}, 400, "top_k"),
    ("max_tokens zero", CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens a string", CHAT, {"messages": MSG, "max_tokens": "ten"}, 400, "max_tokens"),
    ("max_tokens over the context", CHAT, {"messages": MSG, "max_tokens": 1000000}, 400, "max_tokens"),
    ("n over 128", CHAT, {"messages": MSG, "n": 129}, 400, "n"),
    ("n 0", CHAT, {"messages": MSG, "n": 0}, 400, "n"),
    ("best_of > 1", COMP, {"prompt": "x", "best_of": 2}, 400, "best_of"),
    ("best_of 0", COMP, {"prompt": "x", "best_of": 0}, 400, "best_of"),
    ("logit_bias", CHAT, {"messages": MSG, "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("top_logprobs over 20", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("a tool without a function", CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools[0]"),
    ("tools on completions", COMP, {"prompt": "x", "tools": [{"type": "function"}]}, 400, "tools"),
    ("stop a number", CHAT, {"messages": MSG, "stop": 3}, 400, "stop"),
    ("stop empty string", CHAT, {"messages": MSG, "stop": [""]}, 400, "stop"),
    ("stream not a boolean", CHAT, {"messages": MSG, "stream": "yes"}, 400, "stream"),
    ("stream_options without stream", CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("unknown sla", CHAT, {"messages": MSG, "sla": "urgent"}, 400, "sla"),
    ("negative timeout", CHAT, {"messages": MSG, "timeout": -1}, 400, "timeout"),
    ("seed a float", CHAT, {"messages": MSG, "seed": 1.5}, 400, "seed"),
    ("unknown model", CHAT, {"model": "gpt-4o", "messages": MSG}, 404, "model"),
    ("prompt missing", COMP, {"max_tokens": 2}, 400, "prompt"),
    ("prompt a number", COMP, {"prompt": 7}, 400, "prompt"),
    ("token id outside the vocabulary", COMP, {"prompt": [1, 99999999]}, 400, "prompt"),
    ("token id negative", COMP, {"prompt": [-3]}, 400, "prompt"),
    ("two prompts", COMP, {"prompt": ["a", "b"]}, 400, "prompt"),
    ("prompt longer than the context", COMP, {"prompt": [1] * 5000}, 400, "prompt"),
    ("tokenize without content", "/tokenize", {"text": "x"}, 400, "content"),
    ("detokenize with strings", "/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("unknown route", "/v1/embeddings", {"input": "x"}, 404, None),
]


def post_raw(url, body, **kw):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url, content=content, headers={"Content-Type": "application/json", **kw.pop("headers", {})},
                      timeout=30.0, **kw)


def assert_error_object(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


@pytest.mark.parametrize("name,path,body,status,param", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_request(server, name, path, body, status, param):
    err = assert_error_object(post_raw(server.url + path, body), status)
    if param is not None:
        assert err["param"] == param


def test_malformed_matrix_leaves_server_serving(server):
    assert len(MALFORMED) >= 20
    for _, path, body, _, _ in MALFORMED:
        post_raw(server.url + path, body)
    assert greedy_completion(client(server), PROMPT, 4).choices[0].finish_reason == "length"
    assert wait_idle(server) == (0, 0, 0)


def test_api_key_and_body_limit(strict_server):
    url = strict_server.url + COMP
    body = {"prompt": PROMPT, "max_tokens": 2}
    assert assert_error_object(post_raw(url, body), 401)["type"] == "authentication_error"
    assert_error_object(post_raw(url, body, headers={"Authorization": "Bearer wrong"}), 401)
    with pytest.raises(openai.AuthenticationError):
        client(strict_server, key="wrong").completions.create(model=ALIAS, prompt=PROMPT, max_tokens=2)
    assert client(strict_server, key="secret").completions.create(model=ALIAS, prompt=PROMPT, max_tokens=2)
    big = {"prompt": "x" * 10000, "max_tokens": 2}
    assert_error_object(post_raw(url, big, headers={"Authorization": "Bearer secret"}), 413)
    # /health and /metrics stay open to probes and scrapers.
    assert httpx.get(strict_server.url + "/health").status_code == 200
    assert httpx.get(strict_server.url + "/metrics").status_code == 200


def test_full_queue_is_429_with_retry_after(strict_server):
    c = client(strict_server, key="secret")
    statuses, retry_after = [], []
    lock = threading.Lock()

    def one(i):
        try:
            c.completions.create(model=ALIAS, prompt=f"{PROMPT} {i}", max_tokens=100)
            code = 200
        except openai.RateLimitError as e:
            code = 429
            assert e.body["type"] == "rate_limit_error" if "type" in e.body else True
            with lock:
                retry_after.append(e.response.headers.get("retry-after"))
        with lock:
            statuses.append(code)

    for _ in range(5):  # bursts until the queue overflows (one slot, two queue places)
        with cf.ThreadPoolExecutor(24) as pool:
            list(pool.map(one, range(24)))
        if 429 in statuses:
            break
    assert 429 in statuses and 200 in statuses
    assert retry_after and all(v == "1" for v in retry_after)
    assert wait_idle(strict_server) == (0, 0, 0)


# --- shutdown ------------------------------------------------------------------------------

def test_sigterm_during_load_exits_0_and_loses_nothing(tmp_path):
    DONE = ("stop", "length")  # a complete answer: end-of-generation or max_tokens
    s = Server(tmp_path, extra=["-np", "2", "--shutdown-grace", "60"])
    assert s.wait_ready()
    results = []
    lock = threading.Lock()
    started = threading.Semaphore(0)

    def one(i):
        body = {"model": ALIAS, "prompt": f"{PROMPT} {i}", "max_tokens": 100, "temperature": 0,
                "stream": i % 2 == 0}
        got_headers = False
        try:
            with httpx.stream("POST", s.url + COMP, json=body, timeout=120.0) as r:
                got_headers = True
                started.release()
                data = r.read().decode()
                status = r.status_code
            if status == 200 and body["stream"]:
                events = [l[6:] for l in data.splitlines() if l.startswith("data: ")]
                ok = events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] in DONE
            elif status == 200:
                ok = json.loads(data)["choices"][0]["finish_reason"] in DONE
            else:
                ok = status == 503 and json.loads(data)["error"]["message"] != ""
            res = ("answered", status, ok)
        except httpx.HTTPError as e:
            if not got_headers:
                started.release()
            # Refused, or reset in the accept backlog when the listening socket closed: never
            # processed (the server-log count below proves it). A cut after the headers is a loss.
            res = ("unanswered", repr(e), not got_headers)
        with lock:
            results.append(res)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(48)]
    for t in threads:
        t.start()
    for _ in range(8):
        started.acquire(timeout=60)
    rc = s.stop(signal.SIGTERM)
    for t in threads:
        t.join(timeout=120)
    assert rc == 0, s.log_path.read_text()
    assert len(results) == 48
    assert all(ok for _, _, ok in results), [r for r in results if not r[2]]
    answered_200 = sum(1 for kind, status, _ in results if kind == "answered" and status == 200)
    assert answered_200 >= 8
    # Every request the server finished with 200 reached its client whole.
    logged = [json.loads(l) for l in s.log_path.read_text().splitlines() if l.startswith("{")]
    assert sum(1 for e in logged if e.get("msg") == "request" and e.get("status") == 200) == answered_200


def test_a_second_sigterm_ends_the_grace_at_once(tmp_path):
    """SIGTERM starts the drain (--shutdown-grace 600 here); a second SIGTERM cancels what is
    left at once, as llama-server and uvicorn do (it was ignored: the server waited the whole
    grace). The stream in flight ends with an error event, the server exits 0."""
    path = smollm2_path()
    if not path.exists():
        pytest.skip(f"SmolLM2 not found at {path} (set TANDEM_SMOLLM2)")
    s = Server(tmp_path, model=path, extra=["-c", "4096", "-np", "1", "--shutdown-grace", "600"])
    assert s.wait_ready(timeout=120), s.log_path.read_text()
    body = {"model": ALIAS, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120.0) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # generating
        s.proc.send_signal(signal.SIGTERM)
        # Two signals sent together would merge into one pending signal: the second goes
        # once the drain has begun (its log line).
        while "shutting down" not in s.log_path.read_text():
            time.sleep(0.05)
        s.proc.send_signal(signal.SIGTERM)
        rest = list(lines)
    rc = s.stop(timeout=120.0)
    assert rc == 0, s.log_path.read_text()
    assert any('"error"' in l for l in rest), rest[-3:]
    logged = [json.loads(l) for l in s.log_path.read_text().splitlines() if l.startswith("{")]
    assert any(e.get("msg") == "second signal: cancelling the requests left" for e in logged)
    assert next(e for e in logged if e.get("msg") == "stopped")["cancelled"] == 1


def test_model_that_fails_to_load_exits_1(tmp_path):
    # The HTTP listener starts before the model loads (/health answers 503 meanwhile); a
    # file that is not a GGUF must still end the process with exit 1, not leave it listening.
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(bytes(range(256)) * 16)
    s = Server(tmp_path, model=bad)
    try:
        rc = s.proc.wait(timeout=60)  # a hang guard, not a speed check
    except subprocess.TimeoutExpired:
        s.proc.kill()
        pytest.fail("tandem-server kept running after the model failed to load")
    finally:
        s._log.close()
    assert rc == 1
    assert "cannot load the model" in s.log_path.read_text()


# --- a real chat model ---------------------------------------------------------------------

def smollm2_path():
    return Path(os.environ.get("TANDEM_SMOLLM2",
                               str(Path.home() / ".cache/tandem/SmolLM2-135M-Instruct.Q4_1.gguf")))


def test_smollm2_chat_template(tmp_path):
    path = smollm2_path()
    if not path.exists():
        pytest.skip(f"SmolLM2 not found at {path} (set TANDEM_SMOLLM2)")
    s = Server(tmp_path, model=path, alias="smollm2", extra=["-c", "512", "-np", "1"])
    try:
        if not s.wait_ready(timeout=120):
            errors = [json.loads(l).get("error", "") for l in s.log_path.read_text().splitlines() if l.startswith("{")]
            pytest.skip("tandem-server cannot load SmolLM2 yet: " + " ".join(e for e in errors if e))
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300.0)
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        r = c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=48, temperature=0)
        # The same conversation rendered by hand as the model's own (Jinja) template renders it
        # (transformers/jinja2: its default system message when there is none), tokenized
        # with its control tokens.
        chatml = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                  "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
        ids = httpx.post(s.url + "/tokenize", json={"content": chatml, "parse_special": True}).json()["tokens"]
        assert r.usage.prompt_tokens == len(ids)
        by_ids = c.completions.create(model="smollm2", prompt=ids, max_tokens=48, temperature=0)
        assert r.choices[0].message.content == by_ids.choices[0].text
        # The template rendered by the client and sent as a completion prompt: its control
        # tokens are parsed (one token each, as llama-server and vLLM), the answer the same.
        by_text = c.completions.create(model="smollm2", prompt=chatml, max_tokens=48, temperature=0)
        assert by_text.usage.prompt_tokens == len(ids)
        assert by_text.choices[0].text == r.choices[0].message.content
        # llama.cpp's greedy answer on this file, whose Q4_1 weights both run as they are:
        # llama-server --jinja (llama-cpp-python 0.3.17's build 49bfdde), temperature 0, the same
        # request: "L'Étoile, la Marseillaise, la femme au roi, ..." (its Q4_0 conversion, the
        # goldens' file, answers "The capital of France is Paris").
        assert r.choices[0].message.content.startswith("L'Étoile, la Marseillaise")
        assert (r.choices[0].finish_reason == "length") == (r.usage.completion_tokens == 48)
        assert "<|im_end|>" not in r.choices[0].message.content
    finally:
        s.stop()


def test_non_streaming_clients_that_disconnect_cancel_their_requests(tmp_path):
    """A client that gives up on a non-streamed request cancels it, as a closed stream does
    (vLLM aborts, llama-server checks the connection): 8 requests of 200 tokens on one slot,
    every client gone after 0.3 s; the server ends idle with aborted requests, not with 8
    answers nobody reads. SmolLM2 keeps the work (seconds) far above the clients' patience."""
    path = smollm2_path()
    if not path.exists():
        pytest.skip(f"SmolLM2 not found at {path} (set TANDEM_SMOLLM2)")
    s = Server(tmp_path, model=path, extra=["-c", "512", "-np", "1", "--prefix-cache", "0"])
    assert s.wait_ready(timeout=120), s.log_path.read_text()
    try:
        def give_up(k):
            body = {"model": ALIAS, "prompt": f"Story {k}:", "max_tokens": 200, "ignore_eos": True}
            try:
                httpx.post(s.url + "/v1/completions", json=body, timeout=0.3)
            except httpx.TimeoutException:
                pass

        with cf.ThreadPoolExecutor(8) as pool:
            list(pool.map(give_up, range(8)))
        assert wait_idle(s, timeout=60.0) == (0, 0, 0)
        assert s.metric("vllm:request_success_total", finished_reason="abort") >= 7
        assert s.metric("vllm:request_success_total", finished_reason="length") <= 1
    finally:
        assert s.stop() == 0


def test_a_model_without_a_chat_template_is_warned_about(server):
    """The tiny model's GGUF has no tokenizer.chat_template: the server says at load that the
    built-in template is used instead, and why (as tandem-cli --chat does; it only logged
    chat_template=chatml)."""
    logged = [json.loads(l) for l in server.log_path.read_text().splitlines() if l.startswith("{")]
    warn = [e for e in logged if e.get("msg") == "the model's chat template is not used"]
    assert len(warn) == 1 and warn[0]["level"] == "warn", logged[:5]
    assert "chat_template" in warn[0]["reason"] and warn[0]["built_in_template"]


def test_top_k_beyond_the_vocabulary_is_no_cut(server):
    """top_k larger than any vocabulary (even past int32) is what vLLM and llama.cpp make of
    it, no top-k cut: the same sampled text as top_k 0 (it was 400 "'top_k' must be >= 0")."""
    def sample(k):
        r = httpx.post(server.url + COMP, json={"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 7,
                                                "top_k": k})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    assert sample(99999999999) == sample(0)


def test_an_error_message_keeps_a_nul_the_client_sent(server):
    """GET /v1/models/%00abc: 404 whose message names the whole id, NUL included (it
    stopped at the NUL: "the model '")."""
    r = httpx.get(server.url + "/v1/models/%00abc")
    assert r.status_code == 404
    assert "\x00abc" in r.json()["error"]["message"], r.text


def test_a_half_closed_client_reads_499_client_disconnected_not_a_shutdown(tmp_path):
    """A client that shuts down its sending side after a whole request looks, from the
    server, like one that left (a FIN either way): its request is cancelled, as Go's
    net/http does, and what it can still read is 499 client_disconnected (nginx's "client
    closed request"); the log says "client disconnected", never "shutting down" (it said
    503 server_shutting_down). SmolLM2 keeps the work long enough for the FIN to arrive."""
    path = smollm2_path()
    if not path.exists():
        pytest.skip(f"SmolLM2 not found at {path} (set TANDEM_SMOLLM2)")
    s = Server(tmp_path, model=path, extra=["-c", "512", "-np", "1", "--prefix-cache", "0"])
    assert s.wait_ready(timeout=120), s.log_path.read_text()
    try:
        body = json.dumps({"model": ALIAS, "prompt": "Once upon a time", "max_tokens": 200,
                           "ignore_eos": True}).encode()
        with socket.create_connection(("127.0.0.1", s.port), timeout=60) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
                      + body)
            c.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := c.recv(65536):
                reply += chunk
        head, _, payload = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 499"), reply
        assert json.loads(payload)["error"]["code"] == "client_disconnected"
        assert wait_idle(s, timeout=30.0) == (0, 0, 0)
        assert s.metric("vllm:request_success_total", finished_reason="abort") == 1
        log = s.log_path.read_text()
        assert "client disconnected" in log and "shutting down" not in log, log
    finally:
        assert s.stop() == 0


def test_text_log_lines_cannot_be_forged_by_a_client(tmp_path):
    """--log-format text writes a value with a control character JSON-quoted: a "model"
    with a newline and a fake log line in it stays inside its own line (it started a
    forged "tandem-server: info FAKE" line)."""
    s = Server(tmp_path, extra=["--log-format", "text"])
    assert s.wait_ready()
    try:
        forged = "x\ntandem-server: info FAKE status=200"
        r = httpx.post(s.url + "/v1/chat/completions",
                       json={"model": forged, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404, r.text
    finally:
        assert s.stop() == 0
    lines = s.log_path.read_text().splitlines()
    assert not any(line.startswith("tandem-server: info FAKE") for line in lines), lines
    assert any("FAKE" in line and "\\n" in line for line in lines), lines


@pytest.mark.parametrize("method,path,allow", [
    ("GET", "/v1/completions", "POST"),
    ("PUT", "/v1/chat/completions", "POST"),
    ("DELETE", "/tokenize", "POST"),
    ("POST", "/health", "GET, HEAD"),
    ("POST", "/v1/models", "GET, HEAD"),
    ("POST", "/v1/models/tiny", "GET, HEAD"),
    ("DELETE", "/models/anything", "GET, HEAD"),
    ("GET", "/apply-template", "POST"),
    ("PATCH", "/detokenize", "POST"),
    ("GET", "/chat/completions", "POST"),
    ("POST", "/metrics", "GET, HEAD"),
])
def test_wrong_method_on_a_route_is_405_with_allow(server, method, path, allow):
    r = httpx.request(method, server.url + path)
    assert r.status_code == 405, r.text
    assert r.headers["allow"] == allow
    assert r.json()["error"]["code"] == "method_not_allowed"
    assert httpx.request(method, server.url + "/no/such/route").status_code == 404


def test_post_without_a_body_is_invalid_json_not_a_read_error(server):
    r = httpx.post(server.url + "/v1/completions")  # no Content-Length, no Transfer-Encoding
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json"
