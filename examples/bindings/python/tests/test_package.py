"""Tests of the package-level features: the OpenAI-shaped chat completion, asyncio
requests, abort from another thread, KeyboardInterrupt, argument validation (nothing is
silently truncated), devices, metadata, the log callback and scheduler sessions. Same
running rules as test_tandem.py."""

import _thread
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # golden.py
try:  # the installed package (pip install .), else the sources next to this folder
    import tandem  # noqa: E402
except ImportError:
    sys.path.insert(1, os.path.dirname(HERE))
    import tandem  # noqa: E402

import golden  # noqa: E402

GREEDY = dict(temperature=0, ignore_eos=True)


class PackageTestCase(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.case = golden.load_case("once_upon")
        cls.model = tandem.Model(golden.model_path(), n_threads=1)

    @classmethod
    def tearDownClass(cls):
        cls.model.close()

    def session(self, **kw):
        kw.setdefault("n_threads", 1)
        return tandem.Session(self.model, **kw)

    def assertRefused(self, fn, *args, status=tandem.E_INVALID_ARG, needle=None, **kw):
        with self.assertRaises(tandem.TandemError) as cm:
            fn(*args, **kw)
        self.assertEqual(cm.exception.status, status, cm.exception)
        if needle is not None:
            self.assertIn(needle, cm.exception.message)
        return cm.exception


class TestLibrary(PackageTestCase):
    def test_version_number_and_devices(self):
        major, minor, patch = (int(x) for x in tandem.version().split("."))
        self.assertEqual(tandem.version_number(), major * 10000 + minor * 100 + patch)
        devs = tandem.devices()
        self.assertEqual(devs[0].kind, "cpu")
        self.assertGreaterEqual(devs[0].n_cores, 1)
        self.assertGreater(devs[0].memory_bytes, 0)
        self.assertTrue(devs[0].isa)
        if not any(d.kind == "cuda" for d in devs):
            # A library built without CUDA refuses the kind; one built with it, the absent device.
            with self.assertRaises(tandem.TandemError) as cm:
                tandem.Scheduler(self.model, [tandem.Executor(device="cuda")])
            e = cm.exception
            if e.status == tandem.E_UNSUPPORTED:
                self.assertIn("built without CUDA", e.message)
            else:
                self.assertEqual(e.status, tandem.E_INVALID_ARG, e)
                self.assertIn("CUDA device 0 requested, 0 visible", e.message)
        self.assertRefused(tandem.Scheduler, self.model, [tandem.Executor(device="tpu")], needle="device")

    def test_metadata(self):
        self.assertEqual(self.model.meta("general.architecture"), "llama")
        meta = self.model.metadata
        self.assertEqual(meta["general.architecture"], "llama")
        self.assertEqual(meta["tokenizer.ggml.tokens"], "[512 string]")
        self.assertRefused(self.model.meta, "no.such.key", needle="no.such.key")

    def test_import_without_the_library_names_the_variables(self):
        env = dict(os.environ, TANDEM_LIB="/nonexistent/libtandem.so")
        env.pop("TANDEM_PREFIX", None)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        out = subprocess.run([sys.executable, "-c", "import tandem"], env=env, capture_output=True, text=True)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("ImportError", out.stderr)
        self.assertIn("TANDEM_LIB", out.stderr)
        self.assertIn("TANDEM_PREFIX", out.stderr)


class TestValidation(PackageTestCase):
    """Python integers are unbounded; ctypes would silently keep their low 32 bits."""

    def test_integers_are_never_truncated(self):
        self.assertRefused(tandem.Session, self.model, n_ctx=2**32 + 64, needle="n_ctx")
        self.assertRefused(tandem.Session, self.model, n_threads=True, needle="n_threads")
        self.assertRefused(tandem.Session, self.model, n_batch=1.5, needle="n_batch")
        with self.session(n_ctx=64) as s:
            self.assertRefused(s.complete, "Once", max_tokens=2**32 + 3, needle="max_tokens")
            self.assertRefused(s.complete, "Once", max_tokens=-1, needle="max_tokens")
            self.assertRefused(s.complete, "Once", top_k=2**32 + 1, needle="top_k")
            self.assertRefused(s.complete, "Once", seed=-1, needle="seed")
            self.assertRefused(s.complete, "Once", seed=2**64, needle="seed")
            self.assertRefused(s.complete, "Once", temperature="0", needle="temperature")
            self.assertRefused(s.complete, [1, 2**32 + 5], needle="token id")
            self.assertRefused(s.complete, 123, needle="prompt")
            self.assertRefused(s.complete, "a\0b", needle="NUL")
            # The session was never touched by the refused calls.
            self.assertEqual(s.info.n_tokens, 0)
        self.assertRefused(self.model.token_to_piece, 2**40, needle="token")
        self.assertRefused(self.model.token_to_piece, -1, needle="token")
        self.assertRefused(self.model.detokenize, [2**32 + 1])
        with tandem.Scheduler(self.model, [tandem.Executor(n_threads=1)], max_context=64) as sched:
            self.assertRefused(sched.submit, "Once", max_tokens=2**31, needle="max_tokens")
            self.assertRefused(sched.submit, "Once", deadline_ms=2**40, needle="deadline_ms")
        self.assertRefused(tandem.Scheduler, self.model, [tandem.Executor(max_running=2**32 + 1)],
                           needle="max_running")

    def test_tokenize_refuses_non_text(self):
        self.assertRefused(self.model.tokenize, 123, needle="text")
        self.assertRefused(self.model.tokenize, None, needle="text")
        self.assertEqual(self.model.tokenize(b"Hello"), self.model.tokenize("Hello"))

    def test_a_stop_string_is_one_string(self):
        with self.session() as s:
            full = s.complete(self.case["prompt_text"], max_tokens=64, **GREEDY).text
        # A two-character stop whose characters each appear before the pair does: cut as
        # two separate stops it would end the text earlier.
        pair = next(full[i:i + 2] for i in range(5, len(full) - 2)
                    if full[i:i + 2].strip() == full[i:i + 2] and full.find(full[i:i + 2]) == i
                    and min(full.find(full[i]), full.find(full[i + 1])) < i)
        with self.session() as s:
            r = s.complete(self.case["prompt_text"], max_tokens=64, stop=pair, **GREEDY)
        self.assertEqual(r.finish_reason, "stop_string")
        self.assertEqual(r.text, full[: full.index(pair)])


class TestChatCompletion(PackageTestCase):
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Once upon a time"}]

    def test_openai_shape(self):
        out = self.model.create_chat_completion(self.messages, max_tokens=16, temperature=0, seed=1)
        self.assertEqual(out["object"], "chat.completion")
        self.assertTrue(out["id"].startswith("chatcmpl-"))
        self.assertIsInstance(out["created"], int)
        self.assertEqual(out["model"], self.model.info.name)
        self.assertEqual(len(out["choices"]), 1)
        choice = out["choices"][0]
        self.assertEqual(choice["index"], 0)
        self.assertEqual(choice["message"]["role"], "assistant")
        self.assertIsInstance(choice["message"]["content"], str)
        self.assertIn(choice["finish_reason"], ("stop", "length"))
        usage = out["usage"]
        self.assertEqual(usage["prompt_tokens"], len(self.model.chat_tokenize(self.messages)))
        self.assertLessEqual(usage["completion_tokens"], 16)
        self.assertEqual(usage["total_tokens"], usage["prompt_tokens"] + usage["completion_tokens"])
        if choice["finish_reason"] == "length":
            self.assertEqual(usage["completion_tokens"], 16)

        # Streaming: role first, content deltas, then the finish; same text (greedy).
        chunks = list(self.model.create_chat_completion(self.messages, max_tokens=16, temperature=0, stream=True))
        self.assertTrue(all(c["object"] == "chat.completion.chunk" for c in chunks))
        self.assertEqual(len({c["id"] for c in chunks}), 1)
        self.assertEqual(chunks[0]["choices"][0]["delta"], {"role": "assistant"})
        self.assertIsNone(chunks[0]["choices"][0]["finish_reason"])
        self.assertEqual(chunks[-1]["choices"][0]["delta"], {})
        self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], choice["finish_reason"])
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        self.assertEqual(text, choice["message"]["content"])

    def test_render_and_bad_messages(self):
        text = self.model.chat_render([{"role": "user", "content": "Hi"}])
        self.assertEqual(text, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")  # ChatML fallback
        self.assertRefused(self.model.chat_render, [{"role": "wizard", "content": "x"}])
        self.assertRefused(self.model.chat_render, [{"role": "user"}], needle="messages[0]")
        self.assertRefused(self.model.create_chat_completion, [{"role": "user", "content": 5}])
        # the OpenAI-shaped path (llama-server's /apply-template): the same built-in ChatML here
        self.assertEqual(self.model.apply_chat_template([{"role": "user", "content": "Hi"}]), text)
        self.assertEqual(self.model.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False),
                         "<|im_start|>user\nHi<|im_end|>\n")
        self.assertRefused(self.model.apply_chat_template, [{"role": "user", "content": "Hi"}],
                           tools=[{"type": "function", "function": {"name": "f"}}])


    def test_chat_template_replaces_the_models(self):
        """Model(chat_template=...) (tandem_model_params.chat_template): Jinja source or a
        built-in name used by every chat function instead of the model's own."""
        hi = [{"role": "user", "content": "Hi"}]
        m = tandem.Model(golden.model_path(), chat_template="{{ bos_token }}{% for m in messages %}"
                                                               "<{{ m.role }}>{{ m.content }}{% endfor %}")
        try:
            self.assertEqual(m.apply_chat_template(hi), "<s><user>Hi")
            self.assertEqual(m.chat_render(hi), "<s><user>Hi")
        finally:
            m.close()
        m = tandem.Model(golden.model_path(), chat_template="zephyr")
        try:
            self.assertEqual(m.apply_chat_template(hi), "<|user|>\nHi</s>\n<|assistant|>\n")
        finally:
            m.close()
        with self.assertRaises(tandem.TandemError) as cm:
            tandem.Model(golden.model_path(), chat_template="{% if %}")
        self.assertIn("chat_template: jinja: line 1", str(cm.exception))
        with self.assertRaises(ValueError):  # the C string would end at the NUL
            tandem.Model(golden.model_path(), chat_template="{{ bos_token }}\x00tail")


class TestToolCalls(PackageTestCase):
    def test_parse_tool_calls(self):
        text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        self.assertEqual(self.model.parse_tool_calls(text),
                         {"content": "Sure.", "tool_calls": [{"name": "get_weather", "arguments": '{"city":"Paris"}'}]})
        self.assertEqual(self.model.parse_tool_calls("no call"), {"content": "no call", "tool_calls": []})


def smollm2_path() -> str:
    return os.environ.get("TANDEM_SMOLLM2",
                          os.path.expanduser("~/.cache/tandem/SmolLM2-135M-Instruct.Q4_1.gguf"))


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}


class TestChatCompletionChoicesAndTools(PackageTestCase):
    """create_chat_completion's n, tools and tool_choice, as llama-cpp-python / OpenAI take
    them: n choices (greedy identical to one, seeded ones as Scheduler.submit_n's), tools
    checked as OpenAI checks them, forced calls decoded under their schema (SmolLM2, whose
    template renders no tools: the call is the grammar's work), a call cut by max_tokens."""
    hi = [{"role": "user", "content": "Once upon a time"}]

    def test_n_choices(self):
        one = self.model.create_chat_completion(self.hi, max_tokens=12, temperature=0)
        three = self.model.create_chat_completion(self.hi, max_tokens=12, temperature=0, n=3)
        self.assertEqual([c["index"] for c in three["choices"]], [0, 1, 2])
        for c in three["choices"]:
            self.assertEqual(c["message"], one["choices"][0]["message"])
            self.assertEqual(c["finish_reason"], one["choices"][0]["finish_reason"])
        self.assertEqual(three["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"])
        self.assertEqual(three["usage"]["completion_tokens"], 3 * one["usage"]["completion_tokens"])
        # Seeded: choice i is what the scheduler's submit_n gives for choice i.
        kw = dict(max_tokens=12, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=11)
        r = self.model.create_chat_completion(self.hi, n=3, **kw)
        ids = self.model.chat_tokenize(self.hi)
        with tandem.Scheduler(self.model, log_routing=False) as sched:
            want = [q.wait().text for q in sched.submit_n(ids, 3, **kw)]
        self.assertEqual([c["message"]["content"] for c in r["choices"]], want)
        self.assertGreater(len(set(want)), 1)
        chunks = list(self.model.create_chat_completion(self.hi, n=3, stream=True, **kw))
        text = {}
        for ch in chunks:
            c = ch["choices"][0]
            text[c["index"]] = text.get(c["index"], "") + c["delta"].get("content", "")
        self.assertEqual([text[i] for i in range(3)], want)
        with self.assertRaises(tandem.TandemError):
            self.model.create_chat_completion(self.hi, n=0)

    def test_bad_tools_are_refused(self):
        def bad(**kw):
            with self.assertRaises(ValueError) as e:
                self.model.create_chat_completion(self.hi, max_tokens=2, **kw)
            return str(e.exception)
        fn = WEATHER["function"]
        self.assertIn("1 to 64", bad(tools=[{"type": "function", "function": {**fn, "name": "get weather"}}]))
        self.assertIn("1 to 64", bad(tools=[{"type": "function", "function": {**fn, "name": "x" * 65}}]))
        self.assertIn("object", bad(tools=[{"type": "function", "function": {**fn, "parameters": {"type": "string"}}}]))
        self.assertIn("tools[0]", bad(tools=[{"type": "function"}]))
        self.assertIn("not in tools", bad(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}))
        self.assertIn("needs tools", bad(tool_choice="required"))
        self.assertIn("tool_choice", bad(tools=[WEATHER], tool_choice="sometimes"))
        # tool_choice "none": the tools are neither rendered nor parsed (this model's built-in
        # ChatML renders none at all): the plain completion.
        plain = self.model.create_chat_completion(self.hi, max_tokens=8, temperature=0)
        none = self.model.create_chat_completion(self.hi, max_tokens=8, temperature=0, tools=[WEATHER],
                                                 tool_choice="none")
        self.assertEqual(none["choices"][0]["message"], plain["choices"][0]["message"])

    def test_forced_tool_calls_on_smollm2(self):
        path = smollm2_path()
        if not os.path.exists(path):
            self.skipTest(f"SmolLM2 not found at {path} (set TANDEM_SMOLLM2)")
        try:
            import jsonschema
        except ImportError:
            jsonschema = None
        msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
        with tandem.Model(path, n_threads=1) as smol:
            try:
                smol.create_completion("x", max_tokens=1, grammar='root ::= "a"')
            except tandem.TandemError as e:
                if "grammar engine" in str(e):
                    self.skipTest("libtandem built without xgrammar")
                raise
            for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
                r = smol.create_chat_completion(msgs, tools=[WEATHER], tool_choice=choice, max_tokens=48,
                                                temperature=1.0, seed=4, n=3)
                self.assertEqual(len(r["choices"]), 3)
                for c in r["choices"]:
                    self.assertEqual(c["finish_reason"], "tool_calls", c)
                    self.assertIsNone(c["message"]["content"])
                    (call,) = c["message"]["tool_calls"]
                    self.assertTrue(call["id"].startswith("call_"))
                    self.assertEqual(call["type"], "function")
                    self.assertEqual(call["function"]["name"], "get_weather")
                    args = json.loads(call["function"]["arguments"])
                    self.assertEqual(set(args), {"city"})
                    self.assertLessEqual(len(args["city"]), 40)
                    if jsonschema is not None:
                        jsonschema.validate(args, WEATHER["function"]["parameters"])
                # n = 1 streamed: the call arrives whole in one delta, then "tool_calls".
                chunks = list(smol.create_chat_completion(msgs, tools=[WEATHER], tool_choice=choice, max_tokens=48,
                                                          temperature=0, stream=True))
                deltas = [c["choices"][0]["delta"] for c in chunks]
                calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
                self.assertEqual(len(calls), 1)
                self.assertEqual(calls[0]["index"], 0)
                self.assertEqual(json.loads(calls[0]["function"]["arguments"]).keys(), {"city"})
                self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "tool_calls")
                self.assertEqual("".join(d.get("content") or "" for d in deltas), "")
            # Cut by max_tokens: "length", and the unfinished call is neither a call nor content.
            cut = smol.create_chat_completion(msgs, tools=[WEATHER], tool_choice="required", max_tokens=4,
                                              temperature=0, n=2)
            for c in cut["choices"]:
                self.assertEqual(c["finish_reason"], "length")
                self.assertEqual(c["message"], {"role": "assistant", "content": None})
            with self.assertRaises(ValueError):
                smol.create_chat_completion(msgs, tools=[WEATHER], tool_choice="required", max_tokens=4,
                                            response_format={"type": "json_object"})


class TestStructuredOutput(PackageTestCase):
    """response_format / grammar through the C ABI (llama-cpp-python's argument of
    create_chat_completion): the outputs parse and fit the schema, checked here by hand."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                                "w": {"enum": ["yes", "no"]}},
              "required": ["n", "w"], "additionalProperties": False}

    def setUp(self):
        try:
            with self.session() as s:
                s.complete("x", max_tokens=1, grammar='root ::= "a"')
        except tandem.TandemError as e:
            if "grammar engine" in str(e):
                self.skipTest("libtandem built without xgrammar")
            raise

    def check(self, text):
        obj = json.loads(text)
        self.assertEqual(set(obj), {"n", "w"})
        self.assertIsInstance(obj["n"], int)
        self.assertTrue(0 <= obj["n"] <= 9)
        self.assertIn(obj["w"], ("yes", "no"))

    def test_chat_completion_response_format(self):
        for seed in range(8):
            fmt = ({"type": "json_object", "schema": self.schema} if seed % 2 else
                   {"type": "json_schema", "json_schema": {"name": "t", "schema": self.schema}})
            r = self.model.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=40,
                                                  temperature=1.0, seed=seed, response_format=fmt)
            self.assertEqual(r["choices"][0]["finish_reason"], "stop")
            self.check(r["choices"][0]["message"]["content"])
        chunks = list(self.model.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=40,
                                                        temperature=1.0, seed=3, stream=True,
                                                        response_format={"type": "json_object",
                                                                         "schema": self.schema}))
        self.check("".join(c["choices"][0]["delta"].get("content", "") for c in chunks))

    def test_gbnf_and_errors(self):
        r = self.model.create_completion("Once", max_tokens=10, temperature=1.0, seed=2, grammar='root ::= [a-c] "."')
        self.assertIn(r["choices"][0]["text"], ("a.", "b.", "c."))
        with self.session() as s:
            r = s.complete("Once", max_tokens=10, temperature=1.0, seed=1, grammar='root ::= ("cat" | "dog") "!"')
        self.assertIn(r.text, ("cat!", "dog!"))
        self.assertEqual(r.finish_reason, "stop")
        with self.session() as s:
            with self.assertRaises(tandem.TandemError) as e:
                s.complete("Once", max_tokens=4, response_format={"type": "json_schema",
                                                                  "json_schema": {"schema": {"type": "nope"}}})
        self.assertIn("nope", str(e.exception))
        with self.assertRaises(ValueError):
            self.model.create_chat_completion([{"role": "user", "content": "hi"}], response_format={"type": "yaml"})


class TestLogprobs(PackageTestCase):
    """logprobs through the C ABI: values equal a float64 log-softmax of the logits
    Session.eval gives for the same tokens (teacher-forced); OpenAI / llama-cpp-python shapes."""
    messages = [{"role": "user", "content": "Once upon a time"}]

    @staticmethod
    def log_softmax(row):
        m = max(row)
        log_z = m + math.log(math.fsum(math.exp(x - m) for x in row))
        return [x - log_z for x in row]

    def test_values_equal_log_softmax_of_the_logits(self):
        prompt = self.case["prompt_ids"]
        with self.session() as s:
            r = s.complete(prompt, max_tokens=8, logprobs=4, **GREEDY)
        self.assertEqual(len(r.logprobs), len(r.tokens))
        with self.session() as replay:
            rows = replay.eval(prompt + r.tokens[:-1], all_logits=True)[len(prompt) - 1:]
        for e, tok, row in zip(r.logprobs, r.tokens, rows):
            want = self.log_softmax(list(row))
            self.assertEqual(e.token, tok)
            self.assertAlmostEqual(e.logprob, want[tok], delta=2e-5)
            order = sorted(range(len(want)), key=lambda j: (-want[j], j))[:4]
            self.assertEqual([t for t, _ in e.top], order)
            for t, lp in e.top:
                self.assertAlmostEqual(lp, want[t], delta=2e-5)
        # The scheduler gives the same entries.
        with tandem.Scheduler(self.model, executors=[tandem.Executor(n_threads=1)]) as sched:
            rr = sched.submit(prompt, max_tokens=8, logprobs=4, **GREEDY).wait()
        self.assertEqual(rr.tokens, r.tokens)
        self.assertEqual([e.token for e in rr.logprobs], r.tokens)
        for a, b in zip(rr.logprobs, r.logprobs):
            self.assertAlmostEqual(a.logprob, b.logprob, delta=2e-5)
            self.assertEqual([t for t, _ in a.top], [t for t, _ in b.top])
        with self.session() as s:
            self.assertEqual(s.complete(prompt, max_tokens=4, **GREEDY).logprobs, [])
            self.assertRaises(tandem.TandemError, s.complete, prompt, max_tokens=4, logprobs=21)

    def test_chat_completion_logprobs_shape(self):
        out = self.model.create_chat_completion(self.messages, max_tokens=12, temperature=0, logprobs=True,
                                                top_logprobs=3)
        choice = out["choices"][0]
        content = choice["logprobs"]["content"]
        self.assertEqual(len(content), out["usage"]["completion_tokens"])
        self.assertEqual("".join(e["token"] for e in content), choice["message"]["content"])
        for e in content:
            self.assertEqual(set(e), {"token", "logprob", "bytes", "top_logprobs"})
            self.assertEqual(bytes(e["bytes"]).decode("utf-8", "replace"), e["token"])
            self.assertEqual(len(e["top_logprobs"]), 3)
            self.assertEqual(e["top_logprobs"][0]["token"], e["token"])  # greedy
            self.assertEqual(e["top_logprobs"][0]["logprob"], e["logprob"])
            self.assertLessEqual(math.fsum(math.exp(t["logprob"]) for t in e["top_logprobs"]), 1.0 + 1e-5)
        self.assertIsNone(self.model.create_chat_completion(self.messages, max_tokens=2)["choices"][0]["logprobs"])
        chunks = list(self.model.create_chat_completion(self.messages, max_tokens=12, temperature=0, logprobs=True,
                                                        top_logprobs=3, stream=True))
        streamed = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
        self.assertEqual(streamed, content)

    def test_completion_logprobs_shape(self):
        out = self.model.create_completion(self.case["prompt_text"], max_tokens=10, temperature=0, logprobs=2)
        self.assertEqual(out["object"], "text_completion")
        choice = out["choices"][0]
        lp = choice["logprobs"]
        self.assertEqual(set(lp), {"tokens", "token_logprobs", "top_logprobs", "text_offset"})
        self.assertEqual(len(lp["tokens"]), out["usage"]["completion_tokens"])
        self.assertEqual("".join(lp["tokens"]), choice["text"])
        self.assertEqual(lp["text_offset"], [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))])
        for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            self.assertLessEqual(len(top), 2)
            self.assertEqual(top[tok], value)  # greedy: the token is the most likely
        chunks = list(self.model.create_completion(self.case["prompt_text"], max_tokens=10, temperature=0,
                                                   logprobs=2, stream=True))
        self.assertEqual("".join(c["choices"][0]["text"] for c in chunks), choice["text"])
        self.assertEqual(chunks[-1]["choices"][0]["logprobs"], lp)
        self.assertIsNone(self.model.create_completion(self.case["prompt_text"], max_tokens=2)["choices"][0]["logprobs"])


class TestAbortAndInterrupt(PackageTestCase):
    def test_abort_from_another_thread_ends_a_long_generation(self):
        with self.session(n_ctx=1024) as s:
            # lookahead 1: the worker runs at most a piece ahead of this loop.
            gen = s.generate(self.case["prompt_text"], max_tokens=1000, lookahead=1, **GREEDY)
            for i, _ in enumerate(gen):
                if i == 4:
                    t = threading.Thread(target=s.abort)
                    t.start()
                    t.join()
            r = gen.result
            self.assertEqual(r.finish_reason, "cancelled")
            # Ended right after the abort: 5 pieces consumed, at most a few in flight.
            self.assertLess(len(r.tokens), 16)
            self.assertEqual(s.complete("", max_tokens=3, **GREEDY).finish_reason, "length")  # usable

    def interrupt_after(self, n_pieces, consume):
        """Run consume(on_piece); on_piece raises KeyboardInterrupt in this (main)
        thread through _thread.interrupt_main() from a helper, after n_pieces."""
        count = [0]

        def on_piece(*_):
            count[0] += 1
            if count[0] == n_pieces:
                threading.Thread(target=_thread.interrupt_main).start()
            return False

        # A process started with SIGINT ignored (a background job of a script, nohup) has
        # no Python handler, and interrupt_main() then does nothing: install Python's own.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            with self.assertRaises(KeyboardInterrupt):
                consume(on_piece)
                for _ in range(100000):  # the interrupt is delivered at the next bytecode boundary
                    pass
        finally:
            signal.signal(signal.SIGINT, previous)
        return count[0]

    def test_keyboard_interrupt_during_generate_leaves_the_session_usable(self):
        if threading.current_thread() is not threading.main_thread():
            self.skipTest("KeyboardInterrupt is delivered to the main thread")
        with self.session(n_ctx=1024) as s:
            gens = []

            def consume(on_piece):
                gen = s.generate(self.case["prompt_text"], max_tokens=1000, lookahead=1, **GREEDY)
                gens.append(gen)
                for piece in gen:
                    on_piece(piece)

            self.interrupt_after(3, consume)
            # The next call works (the stream is stopped, never left BUSY) and a fresh
            # conversation gives the golden text.
            s.reset()
            self.assertTrue(gens[0].finished)
            self.assertLess(len(gens[0].result.tokens), 1000)
            r = s.complete(self.case["prompt_text"], max_tokens=64, **GREEDY)
            golden.check(self.case, r.tokens, r.text)

    def test_keyboard_interrupt_during_complete_leaves_the_session_usable(self):
        if threading.current_thread() is not threading.main_thread():
            self.skipTest("KeyboardInterrupt is delivered to the main thread")
        with self.session(n_ctx=1024) as s:
            n = self.interrupt_after(
                3, lambda on_piece: s.complete(self.case["prompt_text"], max_tokens=1000, on_piece=on_piece, **GREEDY))
            self.assertLess(n, 1000)
            self.assertEqual(s.complete("", max_tokens=2, **GREEDY).finish_reason, "length")


class TestSchedulerAsync(PackageTestCase):
    prompts = ["Once upon a time", "The little dog", "One day, a girl named Lily", "Tom had a red ball",
               "The sun was", "A big bird", "There was a cat", "Sam and Sue", "In the park", "Mom said",
               "The boy saw a", "Once there was a tree", "The fish", "Lily liked to", "It was a sunny day",
               "The old man"]

    def test_sixteen_async_requests_each_equal_their_solo_run(self):
        with tandem.Scheduler(self.model, [tandem.Executor(n_threads=1, max_running=16)], max_context=256) as sched:
            solo = []
            for p in self.prompts:
                r = sched.submit(p, max_tokens=24, **GREEDY)
                solo.append(r.wait())
                r.close()

            async def one(prompt):
                req = sched.submit(prompt, max_tokens=24, **GREEDY)
                texts, tokens, finish = [], [], None
                async for event in req:
                    texts.append(event.text)
                    if event.kind == "token":
                        tokens.append(event.token)
                    else:
                        finish = event.finish_reason
                result = await req.wait_async()
                req.close()
                return "".join(texts), tokens, finish, result

            async def main():
                return await asyncio.gather(*(one(p) for p in self.prompts))

            together = asyncio.run(main())
            for s, (text, tokens, finish, result) in zip(solo, together):
                self.assertEqual(finish, "length")
                self.assertEqual(tokens, s.tokens)
                self.assertEqual(result.tokens, s.tokens)
                self.assertEqual(text, s.text)
            self.assertEqual(len(solo[0].tokens), 24)

    def test_submit_n_choices_share_the_prompt_and_follow_seed_plus_index(self):
        with tandem.Scheduler(self.model, [tandem.Executor(n_threads=1, max_running=4)], max_context=256) as sched:
            prompt = self.case["prompt_text"]
            greedy = [r.wait().tokens for r in sched.submit_n(prompt, 3, max_tokens=12, **GREEDY)]
            solo = sched.submit(prompt, max_tokens=12, **GREEDY).wait().tokens
            self.assertEqual(greedy, [solo] * 3)
            kw = dict(max_tokens=12, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
            sampled = [r.wait().tokens for r in sched.submit_n(prompt, 3, seed=5, **kw)]
            for i, toks in enumerate(sampled):
                self.assertEqual(toks, sched.submit(prompt, seed=5 + i, **kw).wait().tokens)
            self.assertEqual(len({tuple(t) for t in sampled}), 3)
            with self.assertRaises(tandem.TandemError):
                sched.submit_n(prompt, 0)

    def test_scheduler_session_over_three_requests_equals_one_generation(self):
        lines = []
        tandem.set_log_callback(lambda level, message: lines.append((level, message)), "debug")
        try:
            with tandem.Scheduler(self.model, [tandem.Executor(n_threads=1, accelerator=True),
                                               tandem.Executor(n_threads=1)], max_context=256) as sched:
                tokens, text = [], ""
                with sched.open_session() as conv:
                    for prompt, n in ((self.case["prompt_text"], 20), ("", 20), ("", 24)):
                        req = conv.submit(prompt, max_tokens=n, **GREEDY)
                        text += req.text()
                        r = req.wait()
                        self.assertEqual(r.finish_reason, "length")
                        tokens += r.tokens
                print(golden.check(self.case, tokens, text))
        finally:
            tandem.set_log_callback(None)
        self.assertTrue(any(level == "debug" and "route" in message for level, message in lines), lines[:5])
        self.assertTrue(any(level == "info" for level, _ in lines))

    def test_parked_scheduler_session_continues_into_the_golden_continuation(self):
        with tempfile.TemporaryDirectory(prefix="tandem-park-") as kv_dir:
            ex = tandem.Executor(n_threads=1, max_running=1, kv_file_pages=64, kv_dir=kv_dir)
            with tandem.Scheduler(self.model, [ex], max_context=256, prefix_cache_entries=0) as sched:
                tokens, text = [], ""
                with sched.open_session() as conv:
                    self.assertEqual(conv.info.executor, -1)
                    for i, (prompt, n) in enumerate(((self.case["prompt_text"], 20), ("", 20), ("", 24))):
                        req = conv.submit(prompt, max_tokens=n, **GREEDY)
                        text += req.text()
                        tokens += req.wait().tokens
                        info = conv.info
                        self.assertFalse(info.busy)
                        self.assertEqual(info.kv_tokens, info.n_tokens - 1)
                        self.assertEqual(info.pages_file, 0)
                        pages = info.pages_host
                        self.assertGreater(pages, 0)
                        conv.park()  # every page to the File tier, bit-exact
                        info = conv.info
                        self.assertEqual((info.pages_host, info.pages_file), (0, pages))
                        if i == 1:
                            conv.unpark()
                            self.assertEqual((conv.info.pages_host, conv.info.pages_file), (pages, 0))
                print(golden.check(self.case, tokens, text))
                with sched.open_session() as conv:  # park needs a File tier: only this one has it
                    conv.submit("Once", max_tokens=2, **GREEDY).wait()
                    conv.park()
                    conv.close()
                    self.assertRefused(conv.park)
        with tandem.Scheduler(self.model, [tandem.Executor(n_threads=1)], max_context=64) as sched:
            with sched.open_session() as conv:
                conv.submit("Once", max_tokens=2, **GREEDY).wait()
                with self.assertRaises(tandem.TandemError) as cm:
                    conv.park()
                self.assertEqual(cm.exception.name, "INVALID_ARG")
                self.assertIn("File tier", cm.exception.message)

    def test_sessions_on_one_pool_add_no_threads(self):
        def threads():
            return len(os.listdir("/proc/self/task"))

        before = threads()
        pool = tandem.Pool(2)
        self.assertEqual(pool.n_threads, 2)
        self.assertEqual(threads(), before + 1)  # the caller's thread is the pool's first
        sessions = [tandem.Session(self.model, n_ctx=128, pool=pool) for _ in range(3)]
        self.assertEqual(threads(), before + 1)
        self.assertEqual(sessions[0].info.n_threads, 2)
        pool.close()  # the sessions keep it
        outs = [s.complete(self.case["prompt_text"], max_tokens=16, **GREEDY) for s in sessions]
        self.assertEqual(len({tuple(o.tokens) for o in outs}), 1)
        with self.session() as solo:  # a pool of its own
            self.assertEqual(outs[0].tokens, solo.complete(self.case["prompt_text"], max_tokens=16, **GREEDY).tokens)
        self.assertRefused(tandem.Session, self.model, n_threads=2, pool=tandem.Pool(1))
        for s in sessions:
            s.close()
        self.assertEqual(threads(), before)

    def test_blocking_wait_returns_none_on_timeout_only_while_unfinished(self):
        with tandem.Scheduler(self.model, [tandem.Executor(n_threads=1)], max_context=64) as sched:
            r = sched.submit("Once", max_tokens=4, **GREEDY)
            events = list(r)
            self.assertEqual(events[-1].kind, "finish")
            self.assertEqual(r.next_event(timeout=0).kind, "finish")  # repeated after the finish
            self.assertRefused(r.next_event, timeout=-1)


if __name__ == "__main__":
    unittest.main()
