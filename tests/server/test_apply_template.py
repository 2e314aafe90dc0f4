"""tandem-server's POST /apply-template (llama-server's): {"prompt": ...} byte for byte what
`tandem-cli apply-template` prints for the same request file, on the tiny model (no template
in the file: the built-in ChatML) and on SmolLM2 (its own Jinja template); bad bodies and
requests a template cannot render are 400 OpenAI error objects, the server serving on."""
import json
import subprocess

import httpx
import pytest

from conftest import CLI_BIN, TINY, Server
from test_openai_server import smollm2_path

REQUESTS = [
    {"messages": [{"role": "user", "content": "Hello"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a river"}]},
    {"messages": [{"role": "user", "content": "no generation prompt"}], "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "caf\u00e9 \u2603 <|im_end|> </s>"}], "add_generation_prompt": True},
    # Tools on a template that does not render them (the built-in ChatML): Hermes' tool
    # prompt written into the messages, as the chat endpoint does (it was the template's 400).
    {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
]


def cli_apply_template(model, request, tmp_path):
    path = tmp_path / "request.json"
    path.write_text(json.dumps(request))
    out = subprocess.run([CLI_BIN, "apply-template", "-m", str(model), "--messages", str(path)],
                         check=True, capture_output=True)
    return out.stdout.decode("utf-8")


def server_apply_template(server, request):
    r = httpx.post(server.url + "/apply-template", json=request, timeout=60.0)
    assert r.status_code == 200, r.text
    assert set(r.json()) == {"prompt"}
    return r.json()["prompt"]


@pytest.mark.parametrize("i", range(len(REQUESTS)))
def test_apply_template_equals_tandem_cli_tiny(server, tmp_path, i):
    want = cli_apply_template(TINY, REQUESTS[i], tmp_path)
    assert want  # the CLI printed a prompt
    assert server_apply_template(server, REQUESTS[i]) == want


def test_apply_template_add_generation_prompt_changes_the_prompt(server):
    msgs = REQUESTS[0]["messages"]
    with_prompt = server_apply_template(server, {"messages": msgs})
    without = server_apply_template(server, {"messages": msgs, "add_generation_prompt": False})
    assert with_prompt.startswith(without) and len(with_prompt) > len(without)


CHAT_MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ("invalid json", b"{not json", None),
    ("body an array", b"[1, 2]", None),
    ("messages missing", {"add_generation_prompt": True}, "messages"),
    ("messages a string", {"messages": "hi"}, "messages"),
    ("add_generation_prompt a string", {"messages": CHAT_MSG, "add_generation_prompt": "yes"},
     "add_generation_prompt"),
    ("tools an object", {"messages": CHAT_MSG, "tools": {"type": "function"}}, "tools"),
    ("chat_template_kwargs a list", {"messages": CHAT_MSG, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("content a number", {"messages": [{"role": "user", "content": 5}]}, "messages"),
]


@pytest.mark.parametrize("name,body,param", BAD, ids=[b[0] for b in BAD])
def test_apply_template_bad_bodies_are_400(server, name, body, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + "/apply-template", content=content, headers={"Content-Type": "application/json"},
                   timeout=30.0)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    assert httpx.get(server.url + "/health").status_code == 200


def test_apply_template_smollm2(tmp_path):
    path = smollm2_path()
    if not path.exists():
        pytest.skip(f"SmolLM2 not found at {path} (set TANDEM_SMOLLM2)")
    s = Server(tmp_path, model=path, alias="smollm2", extra=["-c", "512", "-np", "1", "--body-limit", "40000000"])
    try:
        assert s.wait_ready(timeout=120), s.log_path.read_text()
        for request in REQUESTS + [
            # Key order kept for the template's tojson; tools (SmolLM2: Hermes' tool prompt) and
            # kwargs passed through.
            {"messages": [{"role": "user", "content": "weather?"}],
             "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                 "type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "string"}}}}}],
             "chat_template_kwargs": {"enable_thinking": False}},
        ]:
            want = cli_apply_template(path, request, tmp_path)
            assert server_apply_template(s, request) == want
        # With tools, the prompt is the one the chat endpoint evaluates: SmolLM2's template
        # does not render tools, so both write Hermes' tool prompt in (it showed the prompt
        # without tools: 37 tokens where the chat endpoint ran 180).
        tools_request = {"messages": [{"role": "user", "content": "What's the weather in Paris?"}],
                         "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                             "type": "object", "properties": {"city": {"type": "string"}}}}}]}
        prompt = server_apply_template(s, tools_request)
        assert "<tools>" in prompt and "get_weather" in prompt
        ids = httpx.post(s.url + "/tokenize", json={"content": prompt}).json()["tokens"]
        chat = httpx.post(s.url + "/v1/chat/completions", json={**tools_request, "max_tokens": 1}, timeout=120.0)
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == len(ids)
        # SmolLM2's own template adds its default system message: the Jinja template ran.
        assert "You are a helpful AI assistant named SmolLM" in server_apply_template(s, REQUESTS[0])
        # A render limit (the 16 MiB output bound) reached: 400, not 500, and the server serves on.
        huge = {"messages": [{"role": "user", "content": "x" * (17 << 20)}]}
        r = httpx.post(s.url + "/apply-template", json=huge, timeout=300.0)
        assert r.status_code == 400, r.text[:500]
        assert r.json()["error"]["param"] == "messages"
        assert server_apply_template(s, REQUESTS[0])
    finally:
        assert s.stop() == 0, s.log_path.read_text()


# --chat-template-file FILE / --chat-template NAME_OR_JINJA (llama-server's): the override
# replaces the model's template for /apply-template and the chat endpoint, /props and the
# startup log name it; both flags, a missing file and a template that does not parse end the
# server with exit 1 and the message before it serves.
OVERRIDE = "{{ bos_token }}X{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}" \
           "{% if add_generation_prompt %}Y{% endif %}"


def test_chat_template_file_overrides_the_models_template(tmp_path):
    path = tmp_path / "override.jinja"
    path.write_text(OVERRIDE)
    s = Server(tmp_path, extra=["-np", "1", "--chat-template-file", str(path)])
    try:
        assert s.wait_ready(), s.log_path.read_text()
        request = REQUESTS[1]
        got = server_apply_template(s, request)
        assert got == "<s>X[system:Be brief.][user:Hi][assistant:Hello!][user:Name a river]Y"
        out = subprocess.run([CLI_BIN, "apply-template", "-m", str(TINY), "--messages", "-", "--chat-template-file",
                              str(path)], input=json.dumps(request).encode(), check=True, capture_output=True)
        assert out.stdout.decode("utf-8") == got  # the library's one choice, in both tools
        props = httpx.get(s.url + "/props", timeout=10.0).json()
        assert props["chat_template"] == OVERRIDE
        assert props["chat_template_jinja"] is True
        assert props["chat_template_origin"] == f"chat template file '{path}'"
        # the chat endpoint evaluates the override's prompt
        ids = httpx.post(s.url + "/tokenize", json={"content": got, "add_special": False}).json()["tokens"]
        chat = httpx.post(s.url + "/v1/chat/completions", json={**request, "max_tokens": 1}, timeout=60.0)
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == len(ids)
    finally:
        assert s.stop() == 0, s.log_path.read_text()
    logged = [json.loads(line) for line in s.log_path.read_text().splitlines() if line.startswith("{")]
    loaded = [e for e in logged if e.get("msg") == "model loaded"]
    assert loaded and loaded[0]["chat_template_origin"] == f"chat template file '{path}'", logged
    assert not [e for e in logged if e.get("msg") == "the model's chat template is not used"]


def test_chat_template_builtin_name(tmp_path):
    s = Server(tmp_path, extra=["-np", "1", "--chat-template", "gemma"])
    try:
        assert s.wait_ready(), s.log_path.read_text()
        assert server_apply_template(s, REQUESTS[0]) == \
            "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"
        props = httpx.get(s.url + "/props", timeout=10.0).json()
        assert props["chat_template"] == "gemma" and props["chat_template_name"] == "gemma"
        assert props["chat_template_jinja"] is False and props["chat_template_origin"] == "--chat-template"
    finally:
        assert s.stop() == 0, s.log_path.read_text()


def test_props_names_the_models_own_template(server):
    props = httpx.get(server.url + "/props", timeout=10.0).json()
    # the tiny model has no template: the built-in ChatML renders
    assert props["chat_template"] == "" and props["chat_template_name"] == "chatml"
    assert props["chat_template_jinja"] is False and props["chat_template_origin"] == "tokenizer.chat_template"


def refused_start(tmp_path, extra):
    s = Server(tmp_path, extra=extra)
    try:
        rc = s.proc.wait(timeout=30)
    finally:
        s.stop()
    return rc, s.log_path.read_text()


def test_chat_template_flags_refused_before_serving(tmp_path):
    good = tmp_path / "t.jinja"
    good.write_text(OVERRIDE)
    rc, log = refused_start(tmp_path, ["--chat-template", "chatml", "--chat-template-file", str(good)])
    assert rc == 2 and "excludes --chat-template" in log, log
    missing = tmp_path / "missing.jinja"
    rc, log = refused_start(tmp_path, ["--chat-template-file", str(missing)])
    assert rc == 1 and f"cannot read chat template file '{missing}'" in log, log
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ bos_token }}\n{% for %}")
    rc, log = refused_start(tmp_path, ["--chat-template-file", str(bad)])
    assert rc == 1 and f"chat template file '{bad}': jinja: line 2" in log, log
    rc, log = refused_start(tmp_path, ["--chat-template", "{% if %}"])
    assert rc == 1 and "--chat-template: jinja: line 1" in log, log
    assert "listening" not in log  # the port never opened
