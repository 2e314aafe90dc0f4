"""Structured outputs through the official OpenAI client: response_format json_schema and
json_object, llama-server's `json_schema` and `grammar` fields, chat and completions,
streamed and not. Every sample (200 over the schemas, temperature 1) is validated with
Python's `jsonschema`, an implementation independent of the grammar engine. A schema or
grammar the engine cannot compile is a 400 with the reason.

What the schemas exercise and xgrammar enforces: nested objects, arrays with minItems /
maxItems, enums, const, integers with minimum / maximum, numbers with minimum / maximum
and exclusiveMinimum, strings with maxLength / minLength, required fields and
additionalProperties false (strict mode generates only the named properties).
"""
import json

import httpx
import jsonschema
import openai
import pytest

from conftest import ALIAS, Server

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {"type": "object",
                     "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                    "name": {"type": "string", "minLength": 1, "maxLength": 6}},
                     "required": ["id", "name"], "additionalProperties": False},
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"], "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                "minItems": 1, "maxItems": 3},
                       "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                  "maxItems": 4}},
        "required": ["tags", "scores"], "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "L"]},
                       "kind": {"const": "shirt"}},
        "required": ["color", "size", "kind"], "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {"temp": {"type": "number", "minimum": -10.5, "maximum": 40},
                       "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                       "count": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["temp", "ratio", "count"], "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 100},
                       "b": {"type": ["string", "null"], "maxLength": 5},
                       "c": {"type": "boolean"}},
        "required": ["a"], "additionalProperties": False,
    },
}
SAMPLES = 40  # per schema: 200 in all


@pytest.fixture(autouse=True)
def needs_grammar_engine(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "grammar": 'root ::= "a"'},
                   timeout=60.0)
    if r.status_code == 400 and "without xgrammar" in r.text:
        pytest.skip("tandem-server was built without xgrammar (cmake/TandemXgrammar.cmake)")


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120.0)


def response_format(name):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_samples_validate(server, name):
    c = client(server)
    schema = SCHEMAS[name]
    jsonschema.Draft202012Validator.check_schema(schema)
    for i in range(SAMPLES):
        if i % 4 == 3:  # a quarter of them streamed
            chunks = c.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": f"item {i}"}],
                                               max_tokens=80, temperature=1.0, seed=i, stream=True,
                                               response_format=response_format(name))
            text, finish = "", None
            for ch in chunks:
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    finish = ch.choices[0].finish_reason or finish
        else:
            r = c.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": f"item {i}"}],
                                          max_tokens=80, temperature=1.0, seed=i,
                                          response_format=response_format(name))
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop", (i, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_llama_server_fields(server):
    c = client(server)
    for i in range(5):
        r = c.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "json"}], max_tokens=80,
                                      temperature=1.0, seed=100 + i, response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":  # any object may run past max_tokens
            assert isinstance(json.loads(r.choices[0].message.content), dict)
    # Completions with llama-server's json_schema (streamed) and grammar fields.
    schema = SCHEMAS["enum"]
    chunks = c.completions.create(model=ALIAS, prompt="Once", max_tokens=60, temperature=1.0, seed=7, stream=True,
                                  extra_body={"json_schema": schema})
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    jsonschema.validate(json.loads(text), schema)
    for i in range(10):
        r = c.completions.create(model=ALIAS, prompt="Once", max_tokens=20, temperature=1.0, seed=i,
                                 extra_body={"grammar": 'root ::= ("yes" | "no") " " [0-9]'})
        assert r.choices[0].finish_reason == "stop"
        word, digit = r.choices[0].text.split(" ")
        assert word in ("yes", "no") and digit.isdigit() and len(digit) == 1


@pytest.mark.parametrize("body,param,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "nope"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}},
     "response_format.json_schema.schema", "missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "must be an object"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
    ({"grammar": "root ::= undefined_rule"}, "grammar", "undefined_rule"),
    ({"grammar": 'start ::= "a"'}, "grammar", "root"),
    ({"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, "grammar", "give one"),
    ({"grammar": "root ::= root"}, "grammar", "allows no token"),
    ({"grammar": "root ::= x\nx ::= x \"a\""}, "grammar", "allows no token"),
    # Constraints xgrammar would drop (the output would end "stop" without validating).
    ({"json_schema": {"type": "object", "required": ["x"]}}, "json_schema", "required property 'x'"),
    ({"json_schema": {"not": {"type": "string"}}}, "json_schema", "'not'"),
    ({"json_schema": {"type": "string", "format": "date", "maxLength": 5}}, "json_schema", "beside a built-in 'format'"),
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}},
     "json_schema", "at '/properties/a'"),
    ({"json_schema": {"type": "number", "multipleOf": 0.5}}, "json_schema", "'multipleOf'"),
])
def test_bad_schema_is_400(server, body, param, needle):
    for path, base in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = httpx.post(server.url + path, json={**base, "max_tokens": 8, **body}, timeout=60.0)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param
        assert needle in err["message"], err["message"]
    # The server still answers afterwards.
    assert httpx.get(server.url + "/health", timeout=5.0).status_code == 200


def test_openai_client_refusal_is_bad_request(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 42}}})
    assert e.value.status_code == 400


def test_grammar_ends_the_choice_even_with_ignore_eos(server):
    """ignore_eos does not outlive a grammar (the library's Generation decides): a GBNF that
    completes ends the choice with "stop" and the same text as without ignore_eos."""
    for path, base in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "Once"})):
        outs = []
        for ignore_eos in (False, True):
            r = httpx.post(server.url + path, json={**base, "max_tokens": 20, "temperature": 0, "ignore_eos": ignore_eos,
                                                    "grammar": 'root ::= ("yes" | "no") " " [0-9]'}, timeout=60.0)
            assert r.status_code == 200, r.text
            ch = r.json()["choices"][0]
            assert ch["finish_reason"] == "stop", ch
            outs.append((ch.get("text") or ch["message"]["content"], r.json()["usage"]["completion_tokens"]))
        assert outs[0] == outs[1]
        assert outs[0][0].split(" ")[0] in ("yes", "no")


def nested_schema(levels):
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def nested_gbnf(levels):
    return "root ::= " + "(" * levels + '"a"' + ")" * levels


BIG_ENUM = {"type": "object", "properties": {"e": {"enum": [f"value-{i:05d}" for i in range(2000)]}}}
WIDE_SCHEMA = {"type": "object", "properties": {f"{i:x}": {} for i in range(300)}}  # 2.5 KB


@pytest.mark.parametrize("body,param,code,limit", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BIG_ENUM}}},
     "response_format.json_schema.schema", "grammar_too_large", "16384 bytes"),
    ({"json_schema": BIG_ENUM}, "json_schema", "grammar_too_large", "16384 bytes"),
    ({"json_schema": WIDE_SCHEMA}, "json_schema", "grammar_too_large", "300 properties; the limit is 256"),
    ({"json_schema": {"type": "object", "properties": {f"o{j}": WIDE_SCHEMA for j in range(1)},
                      "$defs": {"d": {"type": "object", "properties": {f"{i}": {} for i in range(10)}}}}},
     "json_schema", "grammar_too_large", "311 properties"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": nested_schema(20)}}},
     "response_format.json_schema.schema", "grammar_too_deep", "32 levels"),
    ({"grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(6000))}, "grammar", "grammar_too_large",
     "16384 bytes"),
    ({"grammar": nested_gbnf(40)}, "grammar", "grammar_too_deep", "32 levels"),
])
def test_oversized_schemas_and_grammars_are_400_naming_the_limit(server, body, param, code, limit):
    """Schemas and grammars are bounded before xgrammar compiles them (its compile time grows
    with them, without a limit of its own): 16 KiB as compact JSON or GBNF text, 32 levels of
    nesting, 256 properties in all of a schema's objects (optional ones cost xgrammar far more
    than their bytes); beyond, 400 with the OpenAI error object naming the limit."""
    for path, base in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = httpx.post(server.url + path, json={**base, "max_tokens": 8, **body}, timeout=60.0)
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")
        assert limit in err["message"], err["message"]


def test_schemas_within_the_bounds_still_compile(server):
    """The bounds leave room for real schemas: 15 nested properties (30 JSON levels) and a
    GBNF with 30 nested groups compile and generate."""
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4,
                                                        "json_schema": nested_schema(15)}, timeout=60.0)
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "grammar": nested_gbnf(30)},
                   timeout=60.0)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "a"


def test_deeply_nested_body_is_400_not_a_crash(server):
    """A body nested far deeper than any request needs (100000 arrays) is 400: what reads
    the parsed body (copies, dumps, the template) may recurse. A json_schema nested so deep
    overflowed the stack of the thread that serialised it for the grammar engine (the
    server died)."""
    deep = "[" * 100000 + "]" * 100000
    for path, field in (("/v1/chat/completions", "x"), ("/v1/completions", "x"), ("/apply-template", "x"),
                        ("/v1/completions", "json_schema"), ("/v1/chat/completions", "json_schema")):
        value = deep if field == "x" else '{"type": "object", "x": ' + deep + "}"
        raw = '{"messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "' + field + '": ' + value + "}"
        r = httpx.post(server.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60.0)
        assert r.status_code == 400, r.text[:300]
        assert "128" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=5.0).status_code == 200


def test_left_recursive_grammar_generates_its_language(server):
    """xgrammar (an Earley parser) takes left recursion, which llama.cpp's grammar engine
    refuses: `root ::= root "a" | "b"` is b a*, and every seeded sample is one of its
    sentences. A grammar with no sentence at all (`root ::= root`) is refused as above."""
    import re
    for seed in range(8):
        r = httpx.post(server.url + "/v1/completions",
                       json={"prompt": "Once", "max_tokens": 12, "temperature": 1.0, "seed": seed,
                             "grammar": 'root ::= root "a" | "b"'}, timeout=60.0)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert re.fullmatch("ba*", ch["text"]), ch


def test_grammar_compile_deadline_is_400_then_busy_503(tmp_path):
    """--grammar-deadline bounds how long a request waits for its grammar. A GBNF inside the
    size bounds can still take xgrammar minutes (optional three-way alternatives: 1080 of
    them, 16 KB, ran over 6 minutes on SmolLM2's vocabulary and held every grammar request
    and SIGTERM meanwhile). At a 1 ms deadline such a grammar is 400 grammar_too_complex at
    once; while it finishes compiling in the background another grammar request gets 503
    grammar_compiler_busy, requests without a grammar and /health answer, and SIGTERM exits
    0 without waiting for the compile."""
    s = Server(tmp_path, extra=["--grammar-deadline", "0.001"])
    try:
        assert s.wait_ready(), s.log_path.read_text()
        slow = "root ::= " + '("a" | "a" | "a")? ' * 400 + '"b"'
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "grammar": slow},
                       timeout=60.0)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("grammar", "grammar_too_complex"), err
        assert "compile deadline (1 ms)" in err["message"], err
        r = httpx.post(s.url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                             "response_format": {"type": "json_object"}}, timeout=60.0)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("response_format", "grammar_compiler_busy"), err
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60.0)
        assert r.status_code == 200, r.text
        assert httpx.get(s.url + "/health", timeout=5.0).status_code == 200
    finally:
        rc = s.stop(timeout=30.0)
    assert rc == 0, s.log_path.read_text()
