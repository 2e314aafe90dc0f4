"""tandem-server's logprobs through the official OpenAI client: OpenAI's shapes (chat:
`logprobs: true` + `top_logprobs`; completions: the legacy `logprobs: N`), streamed and
not, and values checked against truth computed here: a float64 log-softmax of the logits
tandem-cli writes for the same tokens (--prompt-ids ... --logits-out), teacher-forced.

How streamed entries map to chunks (sse_stream.hpp): a chunk that carries text carries the
entries of every token since the previous such chunk; whatever is left rides on the finish
chunk. So the entries of all chunks, in order, are the non-streamed answer's.
"""
import json
import math
import struct
import subprocess

import httpx
import openai
import pytest

from conftest import ALIAS, CLI_BIN, TINY

PROMPT = "Once upon a time"
MSG = [{"role": "user", "content": "Tell me a story"}]
TOL = 2e-5  # float32 rounding of the reported values (and of logits near 10 in magnitude)


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120.0)


def cli_greedy(prompt, n):
    out = subprocess.run([CLI_BIN, "-m", str(TINY), "-p", prompt, "-n", str(n), "--temp", "0", "--json", "-t", "1"],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def cli_logits(ids, tmp_path):
    """tandem-cli's logits for every position of `ids`: a list of rows of floats."""
    path = tmp_path / "logits.f32"
    subprocess.run([CLI_BIN, "-m", str(TINY), "--prompt-ids", ",".join(map(str, ids)), "--logits-out", str(path),
                    "-n", "1", "--temp", "0", "-t", "1", "--json"], check=True, capture_output=True)
    raw = path.read_bytes()
    n_vocab = len(raw) // 4 // len(ids)
    assert n_vocab * 4 * len(ids) == len(raw)
    flat = struct.unpack(f"<{n_vocab * len(ids)}f", raw)
    return [flat[i * n_vocab:(i + 1) * n_vocab] for i in range(len(ids))]


def log_softmax(row):
    """float64, independent of the server: m + log(sum exp(l - m))."""
    m = max(row)
    log_z = m + math.log(math.fsum(math.exp(x - m) for x in row))
    return [x - log_z for x in row]


def detok(server, i):
    return httpx.post(server.url + "/detokenize", json={"tokens": [i]}).json()["content"]


def check_chat_entry(e, n_top, greedy):
    """One chat content entry: OpenAI's fields, bytes, ordering, probabilities."""
    assert isinstance(e.token, str) and isinstance(e.logprob, float) and e.logprob <= 0.0
    assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    assert len(e.top_logprobs) == n_top
    lps = [t.logprob for t in e.top_logprobs]
    assert lps == sorted(lps, reverse=True)
    assert math.fsum(math.exp(x) for x in lps) <= 1.0 + 1e-5
    for t in e.top_logprobs:
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    same = [t for t in e.top_logprobs if t.token == e.token]
    if same:
        assert any(t.logprob == e.logprob for t in same)
    if n_top:
        assert e.logprob <= e.top_logprobs[0].logprob
        if greedy:
            assert e.token == e.top_logprobs[0].token and e.logprob == e.top_logprobs[0].logprob


# --- chat ------------------------------------------------------------------------------------

def test_chat_logprobs_shape(server):
    r = client(server).chat.completions.create(model=ALIAS, messages=MSG, max_tokens=16, temperature=0,
                                               logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert 0 < len(content) == r.usage.completion_tokens
    for e in content:
        check_chat_entry(e, 5, greedy=True)
    assert "".join(e.token for e in content) == r.choices[0].message.content
    raw = r.model_dump()["choices"][0]["logprobs"]
    assert set(raw) == {"content", "refusal"}
    assert set(raw["content"][0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert set(raw["content"][0]["top_logprobs"][0]) == {"token", "logprob", "bytes"}


def test_chat_logprobs_without_top_and_without_logprobs(server):
    c = client(server)
    r = c.chat.completions.create(model=ALIAS, messages=MSG, max_tokens=6, temperature=0, logprobs=True)
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    r = c.chat.completions.create(model=ALIAS, messages=MSG, max_tokens=6, temperature=0, logprobs=False)
    assert r.choices[0].logprobs is None
    r = c.chat.completions.create(model=ALIAS, messages=MSG, max_tokens=6, temperature=0)
    assert r.choices[0].logprobs is None


def test_chat_logprobs_sampled_are_the_models_not_the_samplers(server):
    """At temperature 1.5 with top_k 3 the sampled token's logprob is still the model's
    (before sampling transforms): the twenty alternatives sum to at most 1 and the chosen
    token, when among them, has the same value."""
    r = client(server).chat.completions.create(model=ALIAS, messages=MSG, max_tokens=24, temperature=1.5, seed=7,
                                               logprobs=True, top_logprobs=20, extra_body={"top_k": 3})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        check_chat_entry(e, 20, greedy=False)


def test_chat_stream_logprobs_equal_non_stream(server):
    c = client(server)
    kw = dict(model=ALIAS, messages=MSG, max_tokens=20, temperature=0, logprobs=True, top_logprobs=3)
    whole = c.chat.completions.create(**kw)
    chunks = [ch for ch in c.chat.completions.create(stream=True, **kw) if ch.choices]
    streamed = []
    for ch in chunks:
        lp = ch.choices[0].logprobs
        if ch.choices[0].delta.content:  # a chunk with text accounts for its tokens
            assert lp is not None and lp.content
            assert "".join(e.token for e in lp.content) == ch.choices[0].delta.content
        if lp is not None:
            streamed += lp.content
    assert chunks[0].choices[0].logprobs is None  # the role chunk
    want = whole.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in want]
    for a, b in zip(streamed, want):
        assert a.logprob == pytest.approx(b.logprob, abs=TOL)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]


# --- completions ---------------------------------------------------------------------------

def test_completion_logprobs_equal_log_softmax_of_cli_logits(server, tmp_path):
    n = 12
    ref = cli_greedy(PROMPT, n)
    r = client(server).completions.create(model=ALIAS, prompt=PROMPT, max_tokens=n, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == ref["text"]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(n)]
    # Teacher forcing: the logits that chose ids[i] are the row after prompt + ids[:i].
    ids, prompt_ids = ref["ids"], ref["prompt_ids"]
    rows = cli_logits(prompt_ids + ids[:-1], tmp_path)[len(prompt_ids) - 1:]
    pieces = {}
    for i, (row, tok) in enumerate(zip(rows, ids)):
        want = log_softmax(row)
        assert lp.token_logprobs[i] == pytest.approx(want[tok], abs=TOL)
        assert lp.tokens[i] == detok(server, tok)
        top = sorted(range(len(want)), key=lambda j: (-want[j], j))[:5]
        for j in top:
            pieces.setdefault(j, detok(server, j))
        expect = {}
        for j in top:
            expect.setdefault(pieces[j], want[j])
        assert set(lp.top_logprobs[i]) == set(expect)
        for k, v in expect.items():
            assert lp.top_logprobs[i][k] == pytest.approx(v, abs=TOL)


def test_completion_stream_logprobs_equal_non_stream(server):
    c = client(server)
    kw = dict(model=ALIAS, prompt=PROMPT, max_tokens=20, temperature=0, logprobs=2)
    whole = c.completions.create(**kw).choices[0].logprobs
    tokens, lps, tops, offsets = [], [], [], []
    for ch in c.completions.create(stream=True, **kw):
        lp = ch.choices[0].logprobs
        if ch.choices[0].text:
            assert lp is not None and "".join(lp.tokens) == ch.choices[0].text
        if lp is not None:
            tokens += lp.tokens
            lps += lp.token_logprobs
            tops += lp.top_logprobs
            offsets += lp.text_offset
    assert tokens == whole.tokens and offsets == whole.text_offset
    assert lps == pytest.approx(whole.token_logprobs, abs=TOL)
    assert [set(t) for t in tops] == [set(t) for t in whole.top_logprobs]


def test_stop_string_tokens_are_accounted_for(server):
    """A stop string's tokens (their text cut) keep their entries: one per completion token,
    streamed (on the finish chunk) as not."""
    c = client(server)
    text = c.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = text[10:14]
    assert stop.strip()
    kw = dict(model=ALIAS, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=1, stop=[stop])
    whole = c.completions.create(**kw)
    assert whole.choices[0].finish_reason == "stop"
    assert len(whole.choices[0].logprobs.tokens) == whole.usage.completion_tokens
    assert "".join(whole.choices[0].logprobs.tokens).startswith(whole.choices[0].text + stop[:1])
    streamed = []
    for ch in c.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += ch.choices[0].logprobs.tokens
    assert streamed == whole.choices[0].logprobs.tokens


def test_completion_logprobs_zero_and_none(server):
    c = client(server)
    r = c.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0)
    assert r.choices[0].logprobs.top_logprobs == [{}] * 4
    assert len(r.choices[0].logprobs.token_logprobs) == 4
    r = c.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None


# --- refusals ------------------------------------------------------------------------------

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
REFUSED = [
    ("top_logprobs 21", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("top_logprobs negative", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("top_logprobs a float", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
    ("top_logprobs without logprobs", CHAT, {"messages": MSG, "top_logprobs": 3}, "top_logprobs"),
    ("top_logprobs with logprobs false", CHAT, {"messages": MSG, "logprobs": False, "top_logprobs": 3},
     "top_logprobs"),
    ("chat logprobs a number", CHAT, {"messages": MSG, "logprobs": 5}, "logprobs"),
    ("completion logprobs 21", COMP, {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ("completion logprobs negative", COMP, {"prompt": PROMPT, "logprobs": -1}, "logprobs"),
    ("completion logprobs a boolean", COMP, {"prompt": PROMPT, "logprobs": True}, "logprobs"),
    ("completion logprobs a string", COMP, {"prompt": PROMPT, "logprobs": "5"}, "logprobs"),
]


@pytest.mark.parametrize("name,path,body,param", REFUSED, ids=[x[0] for x in REFUSED])
def test_logprobs_refusals_are_400(server, name, path, body, param):
    r = httpx.post(server.url + path, json={**body, "max_tokens": 2}, timeout=30.0)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_logprobs_refusals_through_the_client(server):
    with pytest.raises(openai.BadRequestError):
        client(server).chat.completions.create(model=ALIAS, messages=MSG, max_tokens=2, logprobs=True,
                                               top_logprobs=21)
    with pytest.raises(openai.BadRequestError):
        client(server).completions.create(model=ALIAS, prompt=PROMPT, max_tokens=2, logprobs=21)
