"""tandem-server's `n` choices and tool calls through the official OpenAI client.

n: choices share the prompt's KV pages (the prompt is computed once: the executor's
prefill counter grows by the prompt's tokens only), choice i samples with seed + i, greedy
choices are identical, streamed choices interleave by `index`, and a client that goes away
mid-stream frees every choice's KV pages.

Tools (SmolLM2-135M-Instruct; skipped without it): its template does not render tools, so
the server describes them in the Hermes format (Qwen2.5's tool prompt) and parses
<tool_call> blocks. The 135M model does not call tools on its own reliably, so the calls
are forced with tool_choice (the prompt ends with the opening of the call) and the rendered
round trip is checked by its token count against Python's jinja2 rendering of the same
template.
"""
import json
import os
from pathlib import Path

import httpx
import openai
import pytest

from conftest import ALIAS, Server

MSG = [{"role": "user", "content": "Tell me a story about a cat"}]


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120.0)


@pytest.fixture(scope="module")
def nserver(tmp_path_factory):
    """Four slots and no prefix cache: an idle server holds zero KV pages."""
    s = Server(tmp_path_factory.mktemp("n"), extra=["-np", "4", "--prefix-cache", "0"])
    assert s.wait_ready(), s.log_path.read_text()
    yield s
    assert s.stop() == 0, s.log_path.read_text()


def kv_used(server):
    return server.metric("tandem:kv_pages", state="used") + server.metric("tandem:kv_pages", state="reserved")


def test_greedy_choices_are_identical_and_prompt_counted_once(nserver):
    c = client(nserver)
    one = c.chat.completions.create(model=ALIAS, messages=MSG, max_tokens=12, temperature=0)
    before = nserver.metric("tandem:executor_prefill_tokens_total")
    r = c.chat.completions.create(model=ALIAS, messages=MSG, max_tokens=12, temperature=0, n=3)
    after = nserver.metric("tandem:executor_prefill_tokens_total")
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert all(ch.message.content == one.choices[0].message.content for ch in r.choices)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt once
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    # One prefill: the prompt's tokens (each later choice feeds only its last prompt token,
    # counted as a decode step).
    assert after - before == one.usage.prompt_tokens


def test_seeded_choices_differ_and_follow_seed_plus_index(nserver):
    c = client(nserver)
    kw = dict(model=ALIAS, messages=MSG, max_tokens=16, temperature=1.0, top_p=1.0, seed=7)
    r = c.chat.completions.create(n=4, **kw)
    texts = [ch.message.content for ch in r.choices]
    assert len(set(texts)) == 4, texts
    again = c.chat.completions.create(n=4, **kw)
    assert [ch.message.content for ch in again.choices] == texts
    for i in range(4):
        single = c.chat.completions.create(**{**kw, "seed": 7 + i})
        assert single.choices[0].message.content == texts[i]
    # completions too
    comp = c.completions.create(model=ALIAS, prompt="Once upon a time", max_tokens=8, temperature=0, n=2)
    assert [ch.index for ch in comp.choices] == [0, 1]
    assert comp.choices[0].text == comp.choices[1].text


def test_streamed_choices_interleave_by_index(nserver):
    c = client(nserver)
    ref = c.chat.completions.create(model=ALIAS, messages=MSG, max_tokens=10, temperature=1.0, seed=3, n=3)
    stream = c.chat.completions.create(model=ALIAS, messages=MSG, max_tokens=10, temperature=1.0, seed=3, n=3,
                                       stream=True, stream_options={"include_usage": True})
    texts, finish, order, usage = ["", "", ""], [None] * 3, [], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            order.append(ch.index)
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert texts == [ch.message.content for ch in ref.choices]
    assert finish == [ch.finish_reason for ch in ref.choices]
    assert sorted(set(order)) == [0, 1, 2]
    assert usage.prompt_tokens == ref.usage.prompt_tokens
    assert usage.completion_tokens == ref.usage.completion_tokens


def test_refusals(nserver):
    c = client(nserver)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=ALIAS, messages=MSG, max_tokens=4, n=0)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=ALIAS, prompt="x", max_tokens=4, n=2, best_of=3)
    assert e.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as e:  # more choices than the queue holds (--max-queued 64)
        c.chat.completions.create(model=ALIAS, messages=MSG, max_tokens=4, n=100)
    assert "max_queued" in e.value.body["message"]
    ok = c.completions.create(model=ALIAS, prompt="x", max_tokens=4, n=2, best_of=2)
    assert len(ok.choices) == 2


def test_disconnect_mid_stream_frees_every_choice(nserver):
    body = {"model": ALIAS, "messages": MSG, "max_tokens": 200, "ignore_eos": True, "n": 3, "stream": True}
    with httpx.stream("POST", nserver.url + "/v1/chat/completions", json=body, timeout=60.0) as r:
        seen = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    if ch["delta"].get("content"):
                        seen.add(ch["index"])
            if seen == {0, 1, 2}:
                break  # every choice holds pages now; closing the connection cancels them
    # The cancellation is asynchronous (next write, next step): wait for the store to empty.
    for _ in range(600):
        if kv_used(nserver) == 0:
            break
        httpx.get(nserver.url + "/health", timeout=5.0)
    assert kv_used(nserver) == 0


# --- tools (SmolLM2) ---------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}}


def smollm2_q4_0():
    return Path(os.environ.get("TANDEM_SMOLLM2_Q4_0",
                               Path.home() / ".cache/tandem/SmolLM2-135M-Instruct-Q4_0.gguf"))


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    path = smollm2_q4_0()
    if not path.exists():
        pytest.skip(f"SmolLM2 Q4_0 not found at {path} (set TANDEM_SMOLLM2_Q4_0)")
    s = Server(tmp_path_factory.mktemp("smol"), model=path, alias="smollm2", extra=["-c", "1024", "-np", "2"])
    assert s.wait_ready(), s.log_path.read_text()
    yield s
    assert s.stop() == 0, s.log_path.read_text()


def hermes_messages(messages, tools):
    """The server's rewrite for a template without tools (tool_calls.hpp), in Python."""
    def tojson(v):
        return json.dumps(v, ensure_ascii=False)
    prompt = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
              "with function signatures within <tools></tools> XML tags:\n<tools>"
              + "".join("\n" + tojson(t) for t in tools)
              + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
              "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
              "<args-json-object>}\n</tool_call>")
    out = []
    for i, m in enumerate(messages):
        text = m.get("content") or ""
        if m["role"] == "tool":
            block = "<tool_response>\n" + text + "\n</tool_response>"
            if i > 0 and messages[i - 1]["role"] == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            continue
        for tc in m.get("tool_calls") or []:
            fn = tc["function"]
            text += ("\n" if text else "") + "<tool_call>\n{\"name\": " + tojson(fn["name"]) + ", \"arguments\": " \
                + tojson(json.loads(fn["arguments"])) + "}\n</tool_call>"
        out.append({"role": m["role"], "content": text})
    return [{"role": "system", "content": prompt}] + out


def test_tool_round_trip_renders_as_jinja2_does(smol):
    jinja2 = pytest.importorskip("jinja2")
    c = client(smol)
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "{\"temperature_c\": 21, \"sky\": \"clear\"}"},
    ]
    r = c.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], max_tokens=24, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The prompt the server rendered, counted: the template (from /apply-template's source
    # model, rendered by jinja2 with transformers' options) over the Hermes rewrite.
    source = (Path(__file__).resolve().parents[1] / "data/chat_templates/smollm2.jinja").read_text()
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(source).render(messages=hermes_messages(messages, [WEATHER]), add_generation_prompt=True)
    ids = httpx.post(smol.url + "/tokenize", json={"content": text, "add_special": True, "parse_special": True},
                     timeout=10).json()["tokens"]
    assert r.usage.prompt_tokens == len(ids)


HISTORY = [  # one worked example, so that the 135M model has the call's shape in front of it
    {"role": "user", "content": "What is the weather in London?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"London\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "15C, rain"},
    {"role": "assistant", "content": "It is 15C and raining in London."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
PREFIX = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "  # forced_call_prefix, Hermes


def has_grammar_engine(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "grammar": 'root ::= "a"'},
                   timeout=60.0)
    return not (r.status_code == 400 and "without xgrammar" in r.text)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_always_parse_under_the_grammar(smol, choice, parallel):
    """With the grammar engine a forced call is decoded under the JSON schema of one
    {"name", "arguments": the tool's parameters} (also with parallel_tool_calls, where an
    array of calls let the model run on until max_tokens): every one of 8 seeded choices at
    temperature 1 is one tool call whose arguments validate against the tool's parameters
    (checked with Python's jsonschema), streamed and not."""
    if not has_grammar_engine(smol):
        pytest.skip("tandem-server was built without xgrammar")
    import jsonschema
    c = client(smol)
    kw = dict(model="smollm2", messages=HISTORY, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=parallel,
              max_tokens=64, temperature=1.0, seed=3, n=8)
    r = c.chat.completions.create(**kw)
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls", ch
        assert ch.message.content is None and len(ch.message.tool_calls) == 1
        call = ch.message.tool_calls[0]
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    stream = c.chat.completions.create(stream=True, **kw)
    args = {}
    for chunk in stream:
        for d in chunk.choices:
            for tc in d.delta.tool_calls or []:
                args[d.index] = tc.function.arguments
    assert args == {i: ch.message.tool_calls[0].function.arguments for i, ch in enumerate(r.choices)}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_parse_or_come_back_as_text(smol, choice):
    """Without a grammar the 135M model does not always close its JSON (greedy it writes
    `15C` unquoted and drops a brace): a call that parses is a tool call, one that does not
    comes back as the text, forced prefix included, never an error. Seeded, 8 choices."""
    c = client(smol)
    if has_grammar_engine(smol):
        pytest.skip("forced calls are decoded under the grammar (the test above)")
    kw = dict(model="smollm2", messages=HISTORY, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False,
              max_tokens=30, temperature=0.7, seed=0, n=8)
    r = c.chat.completions.create(**kw)
    calls = []
    for ch in r.choices:
        if ch.finish_reason == "tool_calls":
            assert ch.message.content is None
            assert len(ch.message.tool_calls) == 1
            call = ch.message.tool_calls[0]
            assert call.id.startswith("call_") and len(call.id) == 29 and call.type == "function"
            assert call.function.name == "get_weather"
            calls.append(json.loads(call.function.arguments))
        else:
            assert ch.message.tool_calls is None
            assert ch.message.content.startswith(PREFIX)
    assert {"city": "Paris"} in calls, r  # the model can do it: at least one choice is the real call

    # Streamed: content before a call streams, the call arrives whole in one delta (id,
    # name, arguments), then finish_reason "tool_calls"; per choice as the non-streamed.
    stream = c.chat.completions.create(stream=True, **kw)
    got = {i: {"content": "", "calls": [], "finish": None} for i in range(8)}
    for chunk in stream:
        for d in chunk.choices:
            g = got[d.index]
            g["content"] += d.delta.content or ""
            g["calls"] += d.delta.tool_calls or []
            g["finish"] = d.finish_reason or g["finish"]
    for i, ch in enumerate(r.choices):
        g = got[i]
        assert g["finish"] == ch.finish_reason
        if ch.finish_reason == "tool_calls":
            assert g["content"] == ""
            assert len(g["calls"]) == 1 and g["calls"][0].index == 0 and g["calls"][0].id.startswith("call_")
            assert g["calls"][0].function.name == "get_weather"
            assert g["calls"][0].function.arguments == ch.message.tool_calls[0].function.arguments
        else:
            assert g["calls"] == [] and g["content"] == ch.message.content


def test_weather_round_trip(smol):
    """call -> tool message -> final answer: the answer is content, not another call."""
    c = client(smol)
    msgs = HISTORY + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "21C, clear"},
    ]
    r = c.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER], max_tokens=30, temperature=0)
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")


def test_tool_choice_none_and_bad_tools(smol):
    c = client(smol)
    msgs = [{"role": "user", "content": "Hi"}]
    plain = c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8, temperature=0)
    none = c.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER], tool_choice="none",
                                     max_tokens=8, temperature=0)
    assert none.choices[0].message.content == plain.choices[0].message.content  # tools not rendered
    assert none.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER],
                                  tool_choice={"type": "function", "function": {"name": "nope"}}, max_tokens=4)
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="smollm2", messages=msgs, tools=[{"type": "function"}], max_tokens=4)
    assert e.value.body["param"] == "tools[0]"


def fn_tool(name="get_weather", parameters=WEATHER["function"]["parameters"], **extra):
    f = {"name": name, **extra}
    if parameters is not None:
        f["parameters"] = parameters
    return {"type": "function", "function": f}


@pytest.mark.parametrize("tool,param,needle", [
    (fn_tool("get weather"), "tools[0].function.name", "1 to 64"),
    (fn_tool("x" * 65), "tools[0].function.name", "1 to 64"),
    (fn_tool(""), "tools[0].function.name", "1 to 64"),
    (fn_tool("wetter.heute"), "tools[0].function.name", "1 to 64"),
    (fn_tool("caf\u00e9"), "tools[0].function.name", "1 to 64"),
    (fn_tool(parameters={"type": "string"}), "tools[0].function.parameters", "type \"object\""),
    (fn_tool(parameters=["city"]), "tools[0].function.parameters", "JSON schema object"),
    (fn_tool(description=42), "tools[0].function.description", "string"),
    (fn_tool(parameters={"type": "object", "properties": {f"p{i:05d}": {"type": "integer"} for i in range(2000)}}),
     "tools[0].function.parameters", "the limit is 256 properties"),
    (fn_tool(parameters={"type": "object", "properties": {"e": {"enum": [f"v-{i:05d}" for i in range(2000)]}}}),
     "tools[0].function.parameters", "16384 bytes"),
])
def test_bad_tool_definitions_are_400(nserver, tool, param, needle):
    """Tools are checked as OpenAI checks them (function name ^[a-zA-Z0-9_-]{1,64}$,
    parameters a JSON schema object of type "object") and bounded as response schemas are,
    with every tool_choice (auto renders them, required compiles them): 400 naming the field."""
    for choice in ("auto", "required", "none"):
        with pytest.raises(openai.BadRequestError) as e:
            client(nserver).chat.completions.create(model=ALIAS, messages=MSG, tools=[tool], tool_choice=choice,
                                                    max_tokens=4)
        assert e.value.body["param"] == param, e.value.body
        assert needle in e.value.body["message"], e.value.body
    # Names at the rule's edges are accepted: the tools pass and are rendered, whose prompt
    # then outgrows the tiny model's 128-token context.
    with pytest.raises(openai.BadRequestError) as e:
        client(nserver).chat.completions.create(model=ALIAS, messages=MSG, max_tokens=2,
                                                tools=[fn_tool("ok_tool-1"), fn_tool("A" * 64),
                                                       fn_tool("a_b-C9", parameters=None)])
    assert e.value.body["code"] == "context_length_exceeded", e.value.body


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_cut_by_max_tokens_is_length_without_a_call(smol, choice):
    """A forced call that max_tokens cuts off: finish_reason "length" as OpenAI's, and the
    unfinished call is neither a tool call (its arguments would not parse) nor content
    (never the raw "<tool_call>" text), streamed and not; never a 500."""
    if not has_grammar_engine(smol):
        pytest.skip("tandem-server was built without xgrammar")
    c = client(smol)
    kw = dict(model="smollm2", messages=HISTORY, tools=[WEATHER], tool_choice=choice, max_tokens=4,
              temperature=1.0, seed=5, n=3)
    r = c.chat.completions.create(**kw)
    for ch in r.choices:
        assert ch.finish_reason == "length", ch
        assert ch.message.tool_calls is None and ch.message.content is None, ch
    got = {}
    for chunk in c.chat.completions.create(stream=True, **kw):
        for d in chunk.choices:
            g = got.setdefault(d.index, {"content": "", "calls": [], "finish": None})
            g["content"] += d.delta.content or ""
            g["calls"] += d.delta.tool_calls or []
            g["finish"] = d.finish_reason or g["finish"]
    assert got == {i: {"content": "", "calls": [], "finish": "length"} for i in range(3)}
    # With room to finish, the same request is a call.
    full = c.chat.completions.create(**{**kw, "max_tokens": 64, "n": 1})
    assert full.choices[0].finish_reason == "tool_calls"
