"""Tandem from Python: the C ABI (cabi/include/tandem.h) through ctypes, no third-party
packages.

``pip install .`` in a Tandem checkout builds libtandem and puts it inside this package.
Otherwise the library is found from TANDEM_LIB (the .so itself), TANDEM_PREFIX (an
install prefix) or the system loader path; ``import tandem`` names these variables when
it finds none.

    import tandem
    model = tandem.Model("aidreams260K-q4_0.gguf")
    with tandem.Session(model, n_threads=2) as session:
        for piece in session.generate("Once upon a time", max_tokens=64, temperature=0):
            print(piece, end="", flush=True)
    reply = model.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=32)
    print(reply["choices"][0]["message"]["content"])

Errors raise TandemError (``.status`` the tandem_status number, ``.name``, ``.message``);
an argument Python cannot pass without changing it (an integer outside its C type, a
number given as text, a NUL byte in a prompt) is refused with TandemError(E_INVALID_ARG)
before the call, never truncated. Thread-safety is the C ABI's: a Model may be shared by
threads; a Session serves one call at a time and refuses a concurrent one with
TandemError(E_BUSY); Scheduler and Request may be used from any thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import json
import os
import queue
import re
import threading
import time
import uuid
import weakref
from array import array
from dataclasses import dataclass, field
from typing import (Any, AsyncIterator, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Union)

from . import _capi as _c
from ._capi import (E_BAD_POSITION, E_BUFFER_TOO_SMALL, E_BUSY, E_CONTEXT_OVERFLOW, E_GGUF_BAD_MAGIC, E_INTERNAL,
                    E_INVALID_ARG, E_INVALID_HANDLE, E_IO, E_KV_CHECKSUM, E_KV_LEASE_EXPIRED, E_KV_MISMATCH,
                    E_KV_TOKEN_RANGE, E_OUT_OF_MEMORY, E_SESSION_CORRUPT, E_SESSION_MODEL_MISMATCH, E_SESSION_VERSION,
                    E_TOKENIZER, E_UNSUPPORTED, OK, TandemError, library_path)

__all__ = [
    "TandemError", "Model", "ModelInfo", "Session", "SessionInfo", "Generation", "GenerateResult", "Device",
    "devices", "set_log_callback", "version", "version_number", "library_path", "Scheduler", "SchedulerSession",
    "SchedulerSessionInfo", "Pool",
    "Request", "RequestEvent", "RequestResult", "Executor", "TokenLogprob", "OK", "E_INVALID_ARG", "E_IO", "E_OUT_OF_MEMORY",
    "E_GGUF_BAD_MAGIC", "E_TOKENIZER", "E_CONTEXT_OVERFLOW", "E_BAD_POSITION", "E_KV_MISMATCH", "E_KV_CHECKSUM",
    "E_KV_LEASE_EXPIRED", "E_KV_TOKEN_RANGE", "E_SESSION_CORRUPT", "E_SESSION_MODEL_MISMATCH", "E_SESSION_VERSION",
    "E_INTERNAL", "E_INVALID_HANDLE", "E_BUSY", "E_BUFFER_TOO_SMALL", "E_UNSUPPORTED",
]

Prompt = Union[str, bytes, Sequence[int]]
Message = Dict[str, str]


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (a float64 log-softmax of the
    step's logits before sampling transforms, rounded to float) and the most likely
    alternatives of that step, most likely first: `top` is [(token id, logprob), ...]."""
    token: int
    logprob: float
    top: List[Any] = field(default_factory=list)


def _logprobs_out(arr, n: int) -> List[TokenLogprob]:
    return [TokenLogprob(e.token, e.logprob, [(e.top_tokens[k], e.top_logprobs[k]) for k in range(e.n_top)])
            for e in arr[:n]]


def _openai_logprob(lp: float) -> float:
    return lp if lp == lp and lp > float("-inf") else -9999.0  # OpenAI's value for -inf


def _chat_logprobs(model: "Model", entries: List[TokenLogprob]) -> Dict[str, Any]:
    """OpenAI's chat shape: {"content": [{"token", "logprob", "bytes", "top_logprobs"}], "refusal"}."""
    def one(token: int, lp: float) -> Dict[str, Any]:
        b = model.token_to_piece(token)
        return {"token": b.decode("utf-8", "replace"), "logprob": _openai_logprob(lp), "bytes": list(b)}

    return {"content": [dict(one(e.token, e.logprob), top_logprobs=[one(t, lp) for t, lp in e.top])
                        for e in entries], "refusal": None}


def _completion_logprobs(model: "Model", entries: List[TokenLogprob], offset: int = 0) -> Dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs [{token: logprob}],
    text_offset (code points from the completion's start, as vLLM)."""
    out: Dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        piece = model.token_to_piece(e.token)
        out["tokens"].append(piece.decode("utf-8", "replace"))
        out["token_logprobs"].append(_openai_logprob(e.logprob))
        top: Dict[str, float] = {}
        for t, lp in e.top:
            top.setdefault(model.token_to_piece(t).decode("utf-8", "replace"), _openai_logprob(lp))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += sum(1 for c in piece if (c & 0xC0) != 0x80)
    return out


# ---- library-wide ---------------------------------------------------------------------------

def version() -> str:
    """Version of the loaded library ("MAJOR.MINOR.PATCH")."""
    return _c.version().decode()


def version_number() -> int:
    """Version of the loaded library as major * 10000 + minor * 100 + patch."""
    return int(_c.version_number())


@dataclass(frozen=True)
class Device:
    """A processor Tandem can compute on (tandem_device_info)."""
    kind: str                # "cpu" or "cuda"
    device_id: int           # CUDA ordinal; 0 for the CPU
    name: str                # "cpu" or the CUDA device name
    isa: str                 # CPU kernels' instruction set ("avx2", ...) or "sm_90"
    memory_bytes: int        # physical memory / device memory
    n_cores: int             # CPU hardware threads / CUDA multiprocessors
    compute_capability: int  # CUDA major * 10 + minor; 0 for the CPU


def devices() -> List[Device]:
    """The CPU (first) and, in a library built with CUDA, every CUDA device."""
    n = _c.size_t()
    _c.check(_c.device_count(ctypes.byref(n)))
    out = []
    for i in range(n.value):
        d = _c.init(_c.DeviceInfo, _c.device_info_init)
        _c.check(_c.device_get_info(i, ctypes.byref(d)))
        out.append(Device("cuda" if d.kind == _c.DEVICE_CUDA else "cpu", d.device_id, d.name.decode(),
                          d.isa.decode(), d.memory_bytes, d.n_cores, d.compute_capability))
    return out


_log_callback_ref: Optional[Any] = None  # the ctypes thunk must outlive its registration


def set_log_callback(callback: Optional[Callable[[str, str], None]], level: str = "info") -> None:
    """Receive the library's log lines as callback(level, message), level one of "debug"
    (routing decisions with their reasons, preemptions, hand-offs), "info", "warn",
    "error"; lines below `level` are not delivered. None: discard (the default). The
    callback runs on library threads (scheduler step loops): keep it short and
    thread-safe; an exception in it is printed and dropped."""
    global _log_callback_ref
    if level not in _c.LOG_LEVELS:
        raise TandemError(E_INVALID_ARG, f"level {level!r} is not one of {sorted(_c.LOG_LEVELS)}")
    names = {v: k for k, v in _c.LOG_LEVELS.items()}
    if callback is None:
        thunk = _c.LOG_CALLBACK()
    else:
        def deliver(lvl, message, _user):
            try:
                callback(names.get(lvl, "info"), message.decode("utf-8", "replace"))
            except Exception as e:  # never unwind through C
                print(f"tandem log callback raised {e!r}")

        thunk = _c.LOG_CALLBACK(deliver)
    _c.check(_c.log_set(thunk, None, _c.LOG_LEVELS[level]))
    _log_callback_ref = thunk


# ---- handles --------------------------------------------------------------------------------

class _Handle:
    """A library handle owned by a Python object: `handle` (raises once closed), close()
    (idempotent), context manager, closed on garbage collection. Subclasses set `_kind`
    (for the message) and `_free` (the tandem_*_free function)."""

    _kind = "handle"
    _free: Callable[[int], int]
    _h: Optional[int] = None

    @property
    def handle(self) -> int:
        if self._h is None:
            raise TandemError(E_INVALID_HANDLE, f"the {self._kind} is closed")
        return self._h

    def close(self) -> None:
        """Release the handle. Idempotent."""
        if self._h is not None:
            h, self._h = self._h, None
            _c.check(type(self)._free(h))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---- model ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelInfo:
    """tandem_model_info: architecture and sizes."""
    arch: str
    name: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    token_bos: int
    token_eos: int
    weight_bytes: int


_OPENAI_FINISH = {"stop": "stop", "stop_string": "stop", "length": "length", "cancelled": "stop"}


_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def _tool_choice(tools, tool_choice):
    """(tools checked as OpenAI checks them or None, "none" / "auto" / "required" /
    "function", the forced function's name, "" for any tool, or None)."""
    if tools is not None:
        if not isinstance(tools, list):
            raise TypeError("tools must be a list of {'type': 'function', 'function': {...}}")
        for i, t in enumerate(tools):
            f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
            if not _TOOL_NAME.fullmatch(f["name"]):
                raise ValueError(f"tools[{i}].function.name {f['name']!r}: 1 to 64 of a-z, A-Z, 0-9, '_' and '-'")
            p = f.get("parameters")
            if p is not None and (not isinstance(p, dict) or p.get("type", "object") != "object"):
                raise ValueError(f"tools[{i}].function.parameters must be a JSON schema of type \"object\"")
        if not tools:
            tools = None
    if tool_choice is None:
        return tools, ("auto" if tools else "none"), None
    if tool_choice in ("none", "auto", "required"):
        choice, name = tool_choice, ("" if tool_choice == "required" else None)
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(
            tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str):
        choice, name = "function", tool_choice["function"]["name"]
        if not any(t["function"]["name"] == name for t in tools or []):
            raise ValueError(f"tool_choice names {name!r}, which is not in tools")
    else:
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                         "{'name': ...}}")
    if choice != "none" and not tools:
        raise ValueError("tool_choice needs tools")
    return tools, choice, name


def _forced_call_schema(tools: List[Dict[str, Any]], name: str) -> Dict[str, Any]:
    """The JSON schema of one call, {"name", "arguments": the tool's parameters}, of the tool
    `name` ("" = any of them: anyOf), as tandem-server's forced_tool_call_schema."""
    def one(f):
        return {"type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}
    picked = [one(t["function"]) for t in tools if not name or t["function"]["name"] == name]
    return picked[0] if len(picked) == 1 else {"anyOf": picked}


def _messages(messages: Iterable[Message]):
    """(roles, contents) ctypes arrays of OpenAI-style messages, checked."""
    roles, contents = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TandemError(E_INVALID_ARG, f"messages[{i}] must be a dict with str 'role' and 'content'")
        roles.append(_c.text_bytes(f"messages[{i}]['role']", m["role"]))
        contents.append(_c.text_bytes(f"messages[{i}]['content']", m["content"]))
    n = len(roles)
    return (ctypes.c_char_p * max(n, 1))(*roles), (ctypes.c_char_p * max(n, 1))(*contents), n


class Model(_Handle):
    """An immutable loaded GGUF model. Safe to share between threads. Closing it leaves the
    sessions created from it working."""

    _kind = "model"
    _free = _c.model_free

    def __init__(self, path: Union[str, os.PathLike], check_block_scales: bool = True, n_threads: int = 0,
                 chat_template: Optional[str] = None):
        """Load, validate and map `path`. `n_threads` (0 = physical cores) is used by the
        sessions create_chat_completion makes. `chat_template` replaces the model's own
        (tandem-server's --chat-template): a built-in name ("chatml", "llama3", ...) or Jinja
        source, used by create_chat_completion, apply_chat_template and the tool-call format.
        Raises TandemError (E_IO, E_GGUF_*, ...; E_INVALID_ARG for a template that does not
        parse); ValueError for a template holding a NUL (the C string would end there)."""
        params = _c.init(_c.ModelParams, _c.model_params_init)
        params.check_block_scales = 1 if check_block_scales else 0
        if chat_template is not None:
            if "\x00" in chat_template:
                raise ValueError("chat_template holds a NUL character")
            params.chat_template = chat_template.encode("utf-8")  # copied by the load
        self.n_threads = _c.check_int("n_threads", n_threads, 0, 512)
        handle = _c.handle_t()
        _c.check(_c.model_load(os.fsencode(path), ctypes.byref(params), ctypes.byref(handle)))
        self._h = handle.value

    @property
    def info(self) -> ModelInfo:
        i = _c.init(_c.ModelInfo, _c.model_info_init)
        _c.check(_c.model_get_info(self.handle, ctypes.byref(i)))
        return ModelInfo(i.arch.decode(), i.name.decode("utf-8", "replace"), i.n_vocab, i.n_ctx_train, i.n_embd,
                         i.n_layer, i.n_head, i.n_head_kv, i.token_bos, i.token_eos, i.weight_bytes)

    def identity_hash(self) -> int:
        """xxHash3-64 of the hyper-parameters and every tensor (equal = same weights)."""
        h = ctypes.c_uint64()
        _c.check(_c.model_identity_hash(self.handle, ctypes.byref(h)))
        return h.value

    @property
    def metadata(self) -> Dict[str, str]:
        """Every GGUF metadata key with its value as text (arrays as "[n type]")."""
        h = self.handle
        n = _c.size_t()
        _c.check(_c.model_meta_count(h, ctypes.byref(n)))
        out = {}
        for i in range(n.value):
            key = _c.read_text(lambda b, c, o: _c.model_meta_key_by_index(h, i, b, c, o))
            out[key.decode("utf-8", "replace")] = self.meta(key.decode("utf-8", "replace"))
        return out

    def meta(self, key: str) -> str:
        """The value of GGUF metadata `key` as text; TandemError(E_INVALID_ARG) if absent."""
        h, k = self.handle, _c.text_bytes("key", key)
        return _c.read_text(lambda b, c, o: _c.model_meta_value(h, k, b, c, o)).decode("utf-8", "replace")

    def tokenize(self, text: Union[str, bytes], add_special: bool = True, parse_special: bool = False) -> List[int]:
        """Token ids of `text` (str or UTF-8 bytes; BOS added when add_special and the
        vocabulary asks for it)."""
        data = _c.text_bytes("text", text, allow_nul=True)
        flags = (_c.TOKENIZE_ADD_SPECIAL if add_special else 0) | (_c.TOKENIZE_PARSE_SPECIAL if parse_special else 0)
        n = _c.size_t()
        _c.check(_c.tokenize(self.handle, data, len(data), flags, None, 0, ctypes.byref(n)))  # size query
        out = (ctypes.c_int32 * max(n.value, 1))()
        _c.check(_c.tokenize(self.handle, data, len(data), flags, out, n.value, ctypes.byref(n)))
        return list(out[: n.value])

    def detokenize_bytes(self, ids: Sequence[int], remove_special: bool = False,
                         unparse_special: bool = False) -> bytes:
        """Raw bytes of `ids` (may end inside a UTF-8 character)."""
        arr, n_ids = _c.ids_array(ids)
        flags = (_c.DETOKENIZE_REMOVE_SPECIAL if remove_special else 0) | (
            _c.DETOKENIZE_UNPARSE_SPECIAL if unparse_special else 0)
        h = self.handle
        return _c.read_text(lambda b, c, o: _c.detokenize(h, arr, n_ids, flags, b, c, o))

    def detokenize(self, ids: Sequence[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        """Text of `ids` (bytes that are not valid UTF-8 become U+FFFD)."""
        return self.detokenize_bytes(ids, remove_special, unparse_special).decode("utf-8", "replace")

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """Raw bytes of one token; control tokens give b"" unless `special`."""
        token = _c.check_int("token", token, 0, _c.INT32_MAX)
        flags = _c.DETOKENIZE_UNPARSE_SPECIAL if special else 0
        h = self.handle
        return _c.read_text(lambda b, c, o: _c.token_to_piece(h, token, flags, b, c, o))

    # -- chat --

    def chat_render(self, messages: Iterable[Message], add_generation_prompt: bool = True,
                    template: Optional[str] = None) -> str:
        """The conversation rendered with the model's chat template (or the family named by
        `template`: "chatml", "llama3", ...), markers included; with
        add_generation_prompt it ends with the opening of an assistant turn."""
        roles, contents, n = _messages(messages)
        h, t = self.handle, _c.optional_text(template)
        return _c.read_text(lambda b, c, o: _c.chat_render(h, t, roles, contents, n, int(add_generation_prompt), b,
                                                           c, o)).decode("utf-8", "replace")

    def chat_tokenize(self, messages: Iterable[Message], add_generation_prompt: bool = True,
                      template: Optional[str] = None) -> List[int]:
        """Token ids of the rendered conversation: template markers become control tokens,
        message text never does (a user typing "<|im_end|>" cannot end a turn)."""
        roles, contents, n = _messages(messages)
        h, t = self.handle, _c.optional_text(template)
        count = _c.size_t()
        _c.check(_c.chat_tokenize(h, t, roles, contents, n, int(add_generation_prompt), None, 0, ctypes.byref(count)))
        out = (ctypes.c_int32 * max(count.value, 1))()
        _c.check(_c.chat_tokenize(h, t, roles, contents, n, int(add_generation_prompt), out, count.value,
                                  ctypes.byref(count)))
        return list(out[: count.value])

    def apply_chat_template(self, messages: List[dict], tools: Optional[List[dict]] = None,
                            add_generation_prompt: bool = True, **template_kwargs) -> str:
        """The prompt the model's own (Jinja) chat template makes of OpenAI-shaped messages
        and tools, exactly as transformers' apply_chat_template(tokenize=False) renders it
        (llama-server's /apply-template); template_kwargs are more template variables (e.g.
        enable_thinking=False). Raises TandemError (E_INVALID_ARG: the template's
        raise_exception or a type error; E_OUT_OF_MEMORY: a render limit)."""
        req = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        if tools is not None:
            req["tools"] = tools
        if template_kwargs:
            req["chat_template_kwargs"] = template_kwargs
        body = json.dumps(req, ensure_ascii=False).encode("utf-8")
        h = self.handle
        return _c.read_text(lambda b, c, o: _c.chat_apply_template(h, body, b, c, o)).decode("utf-8", "replace")

    def parse_tool_calls(self, text: str) -> Dict[str, Any]:
        """Tool calls in generated text, in the format this model's chat template asks for
        (tandem_chat_parse_tool_calls): {"content": the rest or None, "tool_calls":
        [{"name", "arguments": JSON text}]}; text without a well-formed call comes back
        as the content with no calls. Render the tools with apply_chat_template(messages,
        tools) and generate first."""
        data = _c.text_bytes("text", text)
        h = self.handle
        return json.loads(_c.read_text(lambda b, c, o: _c.chat_parse_tool_calls(h, data, b, c, o)).decode("utf-8"))

    def create_chat_completion(self, messages: List[Message], *, max_tokens: Optional[int] = None,
                               temperature: float = 0.2, top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                               stop: Union[None, str, List[str]] = None, seed: Optional[int] = None,
                               stream: bool = False, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                               repeat_penalty: float = 1.0, n_ctx: int = 0, template: Optional[str] = None,
                               model: Optional[str] = None, logprobs: bool = False,
                               top_logprobs: Optional[int] = None, response_format: Optional[Dict[str, Any]] = None,
                               grammar: Optional[str] = None, tools: Optional[List[Dict[str, Any]]] = None,
                               tool_choice: Union[None, str, Dict[str, Any]] = None,
                               n: int = 1) -> Union[Dict[str, Any], Iterator[Dict[str, Any]]]:
        """An OpenAI-shaped chat completion, with the field names and defaults of
        llama-cpp-python's ``Llama.create_chat_completion``: returns a "chat.completion"
        dict (choices[i].message.content, finish_reason "stop" / "length" / "tool_calls",
        usage), or with stream=True an iterator of "chat.completion.chunk" dicts (a first
        delta with the role, then content deltas, then an empty delta with the finish_reason).
        max_tokens None: until the context (n_ctx; 0 = the model's, capped at 4096) is
        full. Runs on a session of its own (any number of calls may run at once).
        logprobs=True (top_logprobs 0..20 alternatives, ignored without it): choices[i]
        ["logprobs"] is OpenAI's {"content": [{"token", "logprob", "bytes", "top_logprobs"}]};
        streamed, every entry rides on the finish chunk (the entries are known at the end).
        response_format / grammar: structured output, as Session.generate (llama-cpp-python's
        {"type": "json_object", "schema": {...}} and OpenAI's json_schema shape).

        tools (OpenAI function tools: a name of 1 to 64 of a-z A-Z 0-9 _ -, `parameters` a
        JSON schema of type "object"; else ValueError) are rendered by the model's own chat
        template (apply_chat_template; a template that does not render tools gets none, and
        messages may carry tool_calls and "tool" results) and the output is parsed into
        message.tool_calls ({"id", "type": "function", "function": {"name", "arguments"}},
        finish_reason "tool_calls"; parse_tool_calls). tool_choice: "auto" (default with
        tools), "none" (tools neither rendered nor parsed), "required" or {"type":
        "function", "function": {"name": ...}}: the call is decoded under the JSON schema of
        {"name", "arguments": the tool's parameters}, so one that completes always parses
        (not combined with response_format / grammar). An output cut by max_tokens has
        finish_reason "length", and a call it was inside is dropped (neither a call nor
        content), as tandem-server. Streamed with tools, content and calls arrive whole
        before the finish chunk.

        n (1..128): that many choices; choice i samples with seed + i. With n > 1 the prompt
        is computed once on a Scheduler of its own (Scheduler.submit_n) and, streamed, each
        choice's chunks come when it has finished."""
        tool_list, choice, forced = _tool_choice(tools, tool_choice)
        uses_tools = tool_list is not None or any(
            isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in messages)
        if uses_tools:
            req = {"messages": messages, "add_generation_prompt": True}
            if tool_list and choice != "none":
                req["tools"] = tool_list
            ids = self._apply_template_tokens(req)
        else:
            ids = self.chat_tokenize(messages, True, template)
        prefix = ""
        if forced is not None:
            if response_format is not None or grammar is not None:
                raise ValueError("response_format / grammar cannot be combined with a forced tool call (tool_choice)")
            prefix = "<tool_call>\n" if self._hermes_tool_calls() else ""
            ids = ids + self.tokenize(prefix, add_special=False, parse_special=True)
            response_format = {"type": "json_schema", "json_schema": {"schema": _forced_call_schema(tool_list, forced)}}
        parse = tool_list is not None and choice != "none"
        n = _c.check_int("n", n, 1, 128)
        session = Session(self, n_ctx=n_ctx, n_threads=self.n_threads)
        limit = session.info.n_ctx - len(ids)
        if max_tokens is None:
            max_tokens = max(limit, 0)
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                        repeat_penalty=repeat_penalty)
        if seed is not None:
            sampling["seed"] = seed
        n_top = (0 if top_logprobs is None else top_logprobs) if logprobs else None
        ident = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        name = model if model is not None else self.info.name

        def chunk(i: int, delta: Dict[str, Any], finish: Optional[str], lp: Any = None) -> Dict[str, Any]:
            return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": name,
                    "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

        def choice_of(i: int, text: str, finish: str, entries: List[TokenLogprob]) -> Dict[str, Any]:
            message, finish_reason = self._chat_message(prefix + text if parse else text, finish, parse)
            return {"index": i, "message": message, "finish_reason": finish_reason,
                    "logprobs": _chat_logprobs(self, entries) if logprobs else None}

        def as_chunks(c: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
            i, m = c["index"], c["message"]
            yield chunk(i, {"role": "assistant"}, None)
            if m["content"]:
                yield chunk(i, {"content": m["content"]}, None)
            if m.get("tool_calls"):
                yield chunk(i, {"tool_calls": [dict(tc, index=k) for k, tc in enumerate(m["tool_calls"])]}, None)
            yield chunk(i, {}, c["finish_reason"], c["logprobs"])

        if n > 1:
            session.close()
            with Scheduler(self, max_context=n_ctx, log_routing=False) as sched:
                reqs = sched.submit_n(ids, n, max_tokens=max(max_tokens, 1), stop=stop, logprobs=n_top,
                                      response_format=response_format, grammar=grammar, **sampling)
                results = [r.wait() for r in reqs]
                for r in reqs:
                    r.close()
            for r in results:
                if r.finish_reason not in _OPENAI_FINISH:
                    raise TandemError(r.status or E_INTERNAL, r.message or f"a choice ended {r.finish_reason!r}")
            choices = [choice_of(i, r.text, r.finish_reason, r.logprobs) for i, r in enumerate(results)]
            if stream:
                return (c for ch in choices for c in as_chunks(ch))
            used = sum(len(r.tokens) for r in results)
            return {"id": ident, "object": "chat.completion", "created": created, "model": name, "choices": choices,
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": used,
                              "total_tokens": len(ids) + used}}

        gen = session.generate(ids, max_tokens=max_tokens, stop=stop, logprobs=n_top,
                               response_format=response_format, grammar=grammar, **sampling)
        if not stream:
            with session:
                text = gen.text()
            r = gen.result
            return {"id": ident, "object": "chat.completion", "created": created, "model": name,
                    "choices": [choice_of(0, text, r.finish_reason, r.logprobs)],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": len(r.tokens),
                              "total_tokens": len(ids) + len(r.tokens)}}

        def chunks() -> Iterator[Dict[str, Any]]:
            if parse:  # a call is known only at the end: the choice comes whole
                with session, gen:
                    text = gen.text()
                r = gen.result
                yield from as_chunks(choice_of(0, text, r.finish_reason if r else "stop", r.logprobs if r else []))
                return
            with session, gen:
                yield chunk(0, {"role": "assistant"}, None)
                for piece in gen:
                    if piece:
                        yield chunk(0, {"content": piece}, None)
            lp = _chat_logprobs(self, gen.result.logprobs) if logprobs and gen.result else None
            yield chunk(0, {}, _OPENAI_FINISH.get(gen.result.finish_reason if gen.result else "stop", "stop"), lp)

        return chunks()

    def _apply_template_tokens(self, request: Dict[str, Any]) -> List[int]:
        """Token ids of apply_chat_template's prompt (tandem_chat_apply_template_tokens)."""
        body = json.dumps(request, ensure_ascii=False).encode("utf-8")
        count = _c.size_t()
        _c.check(_c.chat_apply_template_tokens(self.handle, body, None, 0, ctypes.byref(count)))
        out = (ctypes.c_int32 * max(count.value, 1))()
        _c.check(_c.chat_apply_template_tokens(self.handle, body, out, count.value, ctypes.byref(count)))
        return list(out[: count.value])

    def _hermes_tool_calls(self) -> bool:
        """This model's calls are <tool_call> blocks (else Llama 3's bare JSON): the format
        parse_tool_calls reads, asked of the library with a probe."""
        probe = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
        return bool(self.parse_tool_calls(probe)["tool_calls"])

    def _chat_message(self, text: str, finish: str, parse: bool):
        """(message, OpenAI finish_reason) of one choice's text (with a forced call's opening)."""
        finish_reason = _OPENAI_FINISH.get(finish, "stop")
        if not parse:
            return {"role": "assistant", "content": text}, finish_reason
        parsed = self.parse_tool_calls(text)
        content, calls = parsed["content"], parsed["tool_calls"]
        cut = finish_reason == "length"
        if cut and content:  # the call the output was inside is neither a call nor content
            at = content.find("<tool_call>") if self._hermes_tool_calls() else (
                0 if content.lstrip().startswith(("{", "[", "<|python_tag|>")) else -1)
            content = content[:at] if at >= 0 else content
        message: Dict[str, Any] = {"role": "assistant", "content": content or (None if calls or cut else content)}
        if calls:
            message["tool_calls"] = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
        return message, ("tool_calls" if calls and not cut else finish_reason)

    def create_completion(self, prompt: Prompt, *, max_tokens: Optional[int] = 16, temperature: float = 0.8,
                          top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                          stop: Union[None, str, List[str]] = None, seed: Optional[int] = None, stream: bool = False,
                          logprobs: Optional[int] = None, frequency_penalty: float = 0.0,
                          presence_penalty: float = 0.0, repeat_penalty: float = 1.0, n_ctx: int = 0,
                          model: Optional[str] = None, response_format: Optional[Dict[str, Any]] = None,
                          grammar: Optional[str] = None) -> Union[Dict[str, Any], Iterator[Dict[str, Any]]]:
        """An OpenAI-shaped text completion with the field names and defaults of
        llama-cpp-python's ``Llama.create_completion``: a "text_completion" dict
        (choices[0].text, finish_reason, usage) or, with stream=True, an iterator of them
        (the last with the finish_reason). `prompt`: text (BOS added, special tokens parsed,
        as tandem-server) or token ids. logprobs 0..20: choices[0]["logprobs"] is the
        legacy {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
        "text_offset"} (offsets in code points from the completion's start); streamed, the
        entries ride on the last chunk. max_tokens None: until the context is full.
        response_format / grammar: structured output, as Session.generate."""
        if isinstance(prompt, (str, bytes)):
            ids = self.tokenize(prompt, add_special=True, parse_special=True)
        else:
            ids = list(prompt)
        session = Session(self, n_ctx=n_ctx, n_threads=self.n_threads)
        if max_tokens is None or max_tokens <= 0:
            max_tokens = max(session.info.n_ctx - len(ids), 0)
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                        repeat_penalty=repeat_penalty)
        if seed is not None:
            sampling["seed"] = seed
        gen = session.generate(ids, max_tokens=max_tokens, stop=stop, logprobs=logprobs,
                               response_format=response_format, grammar=grammar, **sampling)
        ident = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        name = model if model is not None else self.info.name

        def body(text: str, finish: Optional[str], lp: Any) -> Dict[str, Any]:
            return {"id": ident, "object": "text_completion", "created": created, "model": name,
                    "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": finish}]}

        if not stream:
            with session:
                text = gen.text()
            r = gen.result
            out = body(text, _OPENAI_FINISH.get(r.finish_reason, "stop"),
                       _completion_logprobs(self, r.logprobs) if logprobs is not None else None)
            out["usage"] = {"prompt_tokens": len(ids), "completion_tokens": len(r.tokens),
                            "total_tokens": len(ids) + len(r.tokens)}
            return out

        def chunks() -> Iterator[Dict[str, Any]]:
            with session, gen:
                for piece in gen:
                    if piece:
                        yield body(piece, None, None)
            r = gen.result
            lp = _completion_logprobs(self, r.logprobs) if logprobs is not None and r else None
            yield body("", _OPENAI_FINISH.get(r.finish_reason if r else "stop", "stop"), lp)

        return chunks()


# ---- session --------------------------------------------------------------------------------

@dataclass(frozen=True)
class SessionInfo:
    n_ctx: int
    n_tokens: int
    n_batch: int
    page_size: int
    n_threads: int
    has_logits: bool


@dataclass
class GenerateResult:
    """The outcome of a generation. finish_reason: "stop" (end-of-generation token),
    "stop_string", "length" (max_tokens or the context), "cancelled" (closed, aborted,
    interrupted or stopped by on_piece)."""
    text: str = ""
    tokens: List[int] = field(default_factory=list)
    finish_reason: str = ""
    n_prompt: int = 0
    prompt_seconds: float = 0.0
    generate_seconds: float = 0.0
    logprobs: List[TokenLogprob] = field(default_factory=list)  # one per token with logprobs= given


_INT32_SAMPLING = ("top_k", "repeat_last_n")
_FLOAT_SAMPLING = ("temperature", "top_p", "min_p", "repeat_penalty", "frequency_penalty", "presence_penalty")
_SAMPLING_FIELDS = _INT32_SAMPLING + _FLOAT_SAMPLING + ("seed",)


def _sampling(sampling: Dict[str, Any]) -> "_c.SamplingParams":
    unknown = set(sampling) - set(_SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
    s = _c.init(_c.SamplingParams, _c.sampling_params_init)
    for k, v in sampling.items():
        if v is None:
            continue
        if k in _INT32_SAMPLING:
            v = _c.check_int(k, v, -2**31, _c.INT32_MAX)
        elif k == "seed":
            v = _c.check_int(k, v, 0, _c.UINT64_MAX)
        else:
            v = _c.check_float(k, v)
        setattr(s, k, v)
    return s


def _grammar(response_format: Optional[Dict[str, Any]], grammar: Optional[str]):
    """(tandem_grammar_type, text bytes or None) for llama-cpp-python's response_format
    ({"type": "text"}, {"type": "json_object"} optionally with a "schema"), OpenAI's
    {"type": "json_schema", "json_schema": {"schema": ...}}, or a GBNF `grammar` string."""
    kind, text = _c.GRAMMAR_NONE, None
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise TypeError("response_format must be a dict")
        t = response_format.get("type", "text")
        if t == "json_object" and response_format.get("schema") is not None:
            kind, text = _c.GRAMMAR_JSON_SCHEMA, json.dumps(response_format["schema"])
        elif t == "json_object":
            kind = _c.GRAMMAR_JSON_OBJECT
        elif t == "json_schema":
            js = response_format.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise ValueError("response_format json_schema needs {'json_schema': {'schema': {...}}}")
            kind, text = _c.GRAMMAR_JSON_SCHEMA, json.dumps(js["schema"])
        elif t != "text":
            raise ValueError(f"response_format type {t!r} is not supported (text, json_object, json_schema)")
    if grammar is not None:
        if kind != _c.GRAMMAR_NONE:
            raise ValueError("give response_format or grammar, not both")
        if not isinstance(grammar, str):
            raise TypeError("grammar must be a GBNF string")
        kind, text = _c.GRAMMAR_GBNF, grammar
    return kind, (text.encode("utf-8") if text is not None else None)


class _Call:
    """The C structs and buffers of one generate call (kept alive for its duration)."""

    def __init__(self, max_tokens: int, stop, ignore_eos: bool, parse_special: bool, sampling: Dict[str, Any],
                 n_ctx: int, logprobs: Optional[int] = None, grammar=(0, None)):
        max_tokens = _c.check_int("max_tokens", max_tokens, 0, _c.INT32_MAX)
        self.sampling = _sampling(sampling)
        self.params = _c.init(_c.GenerateParams, _c.generate_params_init)
        self.params.grammar_type, self.grammar_text = grammar
        self.params.grammar = self.grammar_text
        self.params.logprobs = -1 if logprobs is None else _c.check_int("logprobs", logprobs, 0, _c.MAX_TOP_LOGPROBS)
        self.params.sampling = ctypes.pointer(self.sampling)
        self.params.max_tokens = max_tokens
        self.params.flags = (_c.GENERATE_IGNORE_EOS if ignore_eos else 0) | (
            _c.GENERATE_PARSE_SPECIAL if parse_special else 0)
        stops = _c.stop_list(stop)
        self.stop_array = (ctypes.c_char_p * max(len(stops), 1))(*stops)
        if stops:
            self.params.stop = self.stop_array
            self.params.n_stop = len(stops)
        self.result = _c.init(_c.GenerateResult, _c.generate_result_init)
        # A generation never outgrows the context: size the buffer by that, not max_tokens.
        cap = max(min(max_tokens, n_ctx), 0)
        self.tokens = (ctypes.c_int32 * max(cap, 1))()
        self.result.tokens = self.tokens
        self.result.tokens_cap = cap
        self.logprobs = (_c.TokenLogprob * max(cap if logprobs is not None else 0, 1))()
        if logprobs is not None:
            self.result.logprobs = self.logprobs
            self.result.logprobs_cap = cap

    def to_result(self, pieces: List[str]) -> GenerateResult:
        r = self.result
        n = min(r.n_tokens, r.tokens_cap)
        return GenerateResult("".join(pieces), list(self.tokens[:n]), _c.FINISH_REASONS.get(r.finish_reason, "?"),
                              r.n_prompt, r.prompt_seconds, r.generate_seconds,
                              _logprobs_out(self.logprobs, min(r.n_logprobs, r.logprobs_cap)))


class _Stream:
    """State shared by a Generation and its worker thread. The worker references only
    this, never the Generation, so dropping the Generation runs its __del__ (cancel +
    join) at once."""

    DONE = object()

    def __init__(self, lookahead: int):
        self.queue: "queue.Queue" = queue.Queue(maxsize=max(1, lookahead))
        self.cancel = threading.Event()
        self.status = OK
        self.error = ""

        def on_piece(ptr, length, token, user_data):
            if self.cancel.is_set():
                return 1
            item = (ctypes.string_at(ptr, length).decode("utf-8"), token)
            while True:
                try:
                    self.queue.put(item, timeout=0.05)
                    return 0
                except queue.Full:
                    if self.cancel.is_set():
                        return 1

        self.callback = _c.TOKEN_CALLBACK(on_piece)  # referenced for the call's lifetime

    def run(self, start: Callable[[Any], int]) -> None:
        if not self.cancel.is_set():
            status = start(self.callback)
            if status != OK:
                self.status = status
                self.error = _c.last_error().decode("utf-8", "replace")  # per thread: read it here
        self.queue.put(_Stream.DONE)


class Generation:
    """A streaming generation: iterate for text pieces (str) as they are produced;
    ``.result`` (GenerateResult) is set once the iteration is finished. ``close()`` (or
    leaving a ``with`` block, or dropping the iterator) stops a generation in progress
    (tandem_session_abort: within one prefill chunk or one token) and waits until the
    session is free again. An exception that reaches the iteration (KeyboardInterrupt
    while waiting for a piece) does the same before it propagates, so Ctrl-C stops the
    model promptly and leaves the session usable.

    The C call runs in a worker thread and hands pieces over through a bounded queue, so
    the text streams while the model computes; ctypes releases the GIL during the call."""

    def __init__(self, session_handle: int, start: Callable[[Any], int], call: _Call, lookahead: int = 256):
        self.result: Optional[GenerateResult] = None
        self.last_token = -1
        self._session_handle = session_handle
        self._call = call
        self._pieces: List[str] = []
        self._finished = False
        self.owner_thread = threading.get_ident()
        self._stream = _Stream(lookahead)
        self._thread = threading.Thread(target=self._stream.run, args=(start,), name="tandem-generate",
                                        daemon=True)
        self._thread.start()

    @property
    def finished(self) -> bool:
        return self._finished

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self._finished:
            raise StopIteration
        try:
            item = self._stream.queue.get()
        except BaseException:  # KeyboardInterrupt (or another async exception) while waiting
            self.close()
            raise
        if item is _Stream.DONE:
            self._thread.join()
            self._finished = True
            if self._stream.status != OK:
                raise TandemError(self._stream.status, self._stream.error)
            self.result = self._call.to_result(self._pieces)
            raise StopIteration
        text, self.last_token = item
        self._pieces.append(text)
        return text

    def close(self) -> None:
        """Stop the generation (finish reason "cancelled") and wait for the worker."""
        if self._finished:
            return
        self._stream.cancel.set()
        _c.session_abort(self._session_handle)  # stops a prefill too; nothing if already done
        while self._thread.is_alive():
            try:
                item = self._stream.queue.get(timeout=0.05)
                if item is not _Stream.DONE:
                    self._pieces.append(item[0])
            except queue.Empty:
                pass
        self._thread.join()
        self._finished = True
        if self._stream.status == OK:
            self.result = self._call.to_result(self._pieces)

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def text(self) -> str:
        """Consume the rest and return the whole text."""
        for _ in self:
            pass
        return self.result.text if self.result else "".join(self._pieces)


class Pool(_Handle):
    """A CPU thread pool that several Sessions and Executors (and so several Schedulers)
    compute on together: their steps take turns on its threads, so the process never runs
    more compute threads than the pool has (tandem_pool_create). Without a pool,
    n_threads=0 already shares the process-wide pool of one thread per physical core; a
    Pool of your own sets another budget. Closing it early is safe: its users keep it."""

    _kind = "pool"
    _free = _c.pool_free

    def __init__(self, n_threads: int = 0):
        """n_threads: 0 = one per physical core; at most 512."""
        handle = _c.handle_t()
        _c.check(_c.pool_create(_c.check_int("n_threads", n_threads, 0, 512), ctypes.byref(handle)))
        self._h = handle.value

    @property
    def n_threads(self) -> int:
        n = ctypes.c_int32()
        _c.check(_c.pool_get_threads(self.handle, ctypes.byref(n)))
        return n.value


class Session(_Handle):
    """One conversation with its own CPU executor and KV cache. One call at a time (a
    concurrent call from another thread raises TandemError(E_BUSY)). A call made from
    the thread that started a still-streaming generate() first stops that generation (an
    abandoned stream never leaves the session busy)."""

    _kind = "session"
    _free = _c.session_free

    def __init__(self, model: Model, n_ctx: int = 0, n_batch: int = 512, page_size: int = 16, n_threads: int = 0,
                 kv_tier: str = "host", kv_dtype: str = "f16", kv_dir: Optional[str] = None,
                 pool: Optional[Pool] = None):
        """n_ctx: positions (0 = the model's, capped at 4096); n_batch: prompt tokens per
        step; n_threads: 0 = the shared pool of one thread per physical core, n > 0 = a
        pool of n threads of its own; pool: compute on this Pool instead (n_threads must
        be 0); kv_tier "host" or "file" (pages in a mapped file in kv_dir); kv_dtype "f16",
        "f32" or "q8_0" (Q8_0 blocks, about half the bytes of f16)."""
        params = _c.init(_c.SessionParams, _c.session_params_init)
        params.n_ctx = _c.check_int("n_ctx", n_ctx, 0, _c.INT32_MAX)
        params.n_batch = _c.check_int("n_batch", n_batch, 1, _c.INT32_MAX)
        params.page_size = _c.check_int("page_size", page_size, 1, _c.INT32_MAX)
        params.n_threads = _c.check_int("n_threads", n_threads, 0, 512)
        tiers = {"host": _c.KV_HOST, "file": _c.KV_FILE}
        if kv_tier not in tiers:
            raise TandemError(E_INVALID_ARG, f"kv_tier {kv_tier!r} is not one of {sorted(tiers)}")
        if kv_dtype not in _c.KV_DTYPES:
            raise TandemError(E_INVALID_ARG, f"kv_dtype {kv_dtype!r} is not one of {sorted(_c.KV_DTYPES)}")
        params.kv_tier, params.kv_dtype = tiers[kv_tier], _c.KV_DTYPES[kv_dtype]
        kv_dir_bytes = None if kv_dir is None else os.fsencode(kv_dir)
        params.kv_dir = kv_dir_bytes
        params.pool = None if pool is None else pool.handle
        handle = _c.handle_t()
        _c.check(_c.session_create(model.handle, ctypes.byref(params), ctypes.byref(handle)))
        self._h = handle.value
        self._model = model
        self._active: Optional["weakref.ref[Generation]"] = None
        self.n_vocab = model.info.n_vocab

    @property
    def handle(self) -> int:
        h = super().handle
        gen = self._active() if self._active is not None else None
        if gen is not None and not gen.finished and gen.owner_thread == threading.get_ident():
            gen.close()
        return h

    @property
    def info(self) -> SessionInfo:
        i = _c.init(_c.SessionInfo, _c.session_info_init)
        _c.check(_c.session_get_info(self.handle, ctypes.byref(i)))
        return SessionInfo(i.n_ctx, i.n_tokens, i.n_batch, i.page_size, i.n_threads, bool(i.has_logits))

    def reset(self) -> None:
        """Forget the conversation (KV pages returned)."""
        _c.check(_c.session_reset(self.handle))

    def abort(self) -> None:
        """Stop the generation running on this session, from any thread: it ends within one
        prefill chunk (n_batch tokens) or one token with finish_reason "cancelled" and the
        session stays usable. Does nothing when no generation is running."""
        if self._h is not None:
            _c.check(_c.session_abort(self._h))

    def eval(self, ids: Sequence[int], all_logits: bool = False) -> Optional[List[array]]:
        """Append `ids` to the conversation. With all_logits, return one row of n_vocab
        floats (array('f')) per id."""
        arr, n = _c.ids_array(ids)
        if not all_logits:
            _c.check(_c.session_eval(self.handle, arr, n, None, 0))
            return None
        buf = (ctypes.c_float * max(n * self.n_vocab, 1))()
        _c.check(_c.session_eval(self.handle, arr, n, buf, n * self.n_vocab))
        flat = array("f", bytes(buf)[: n * self.n_vocab * 4])
        return [flat[i * self.n_vocab:(i + 1) * self.n_vocab] for i in range(n)]

    def logits(self) -> array:
        """Logits after the last evaluated token (empty before the first evaluation)."""
        n = _c.size_t()
        _c.check(_c.session_get_logits(self.handle, None, 0, ctypes.byref(n)))
        buf = (ctypes.c_float * max(n.value, 1))()
        _c.check(_c.session_get_logits(self.handle, buf, n.value, ctypes.byref(n)))
        return array("f", bytes(buf)[: n.value * 4])

    def tokens(self) -> List[int]:
        """Ids whose KV is in the cache, in order."""
        n = _c.size_t()
        _c.check(_c.session_get_tokens(self.handle, None, 0, ctypes.byref(n)))
        buf = (ctypes.c_int32 * max(n.value, 1))()
        _c.check(_c.session_get_tokens(self.handle, buf, n.value, ctypes.byref(n)))
        return list(buf[: n.value])

    # -- generation --

    def _starter(self, prompt: Prompt, call: _Call):
        handle = self.handle
        if isinstance(prompt, (str, bytes)):
            data = _c.text_bytes("the prompt", prompt)
            return lambda cb: _c.session_generate(handle, data, ctypes.byref(call.params), cb, None,
                                                  ctypes.byref(call.result))
        if isinstance(prompt, (int, float)) or not isinstance(prompt, Iterable):
            raise TandemError(E_INVALID_ARG, f"the prompt must be str, bytes or a list of token ids, not "
                                             f"{type(prompt).__name__}")
        arr, n = _c.ids_array(prompt)
        return lambda cb: _c.session_generate_tokens(handle, arr, n, ctypes.byref(call.params), cb, None,
                                                     ctypes.byref(call.result))

    def generate(self, prompt: Prompt, max_tokens: int = 128, stop: Union[None, str, Iterable[str]] = None,
                 ignore_eos: bool = False, parse_special: bool = False, lookahead: int = 256,
                 logprobs: Optional[int] = None, response_format: Optional[Dict[str, Any]] = None,
                 grammar: Optional[str] = None, **sampling) -> Generation:
        """Stream a generation: returns a Generation, an iterator of text pieces. `prompt`
        is text (UTF-8; BOS added on an empty session) or a list of token ids; an empty
        prompt continues the conversation. `stop`: one stop string or a list of them.
        Sampling keywords: temperature (0 = greedy), top_k, top_p, min_p, repeat_penalty,
        repeat_last_n, frequency_penalty, presence_penalty, seed. `lookahead`: how many
        pieces generation may run ahead of the consumer before it waits (backpressure).
        `logprobs` 0..20: result.logprobs gets each token's TokenLogprob with that many
        alternatives. Structured output: `response_format` as llama-cpp-python's
        ({"type": "json_object"}, optionally with "schema") or OpenAI's ({"type":
        "json_schema", "json_schema": {"schema": {...}}}), or `grammar` a GBNF string; a
        schema that does not compile raises TandemError (INVALID_ARG) with the reason."""
        call = _Call(max_tokens, stop, ignore_eos, parse_special, sampling, self.info.n_ctx, logprobs,
                     _grammar(response_format, grammar))
        lookahead = _c.check_int("lookahead", lookahead, 1, _c.INT32_MAX)
        gen = Generation(self.handle, self._starter(prompt, call), call, lookahead)
        self._active = weakref.ref(gen)
        return gen

    def complete(self, prompt: Prompt, max_tokens: int = 128, stop: Union[None, str, Iterable[str]] = None,
                 ignore_eos: bool = False, parse_special: bool = False,
                 on_piece: Optional[Callable[[str, int], Optional[bool]]] = None, logprobs: Optional[int] = None,
                 response_format: Optional[Dict[str, Any]] = None, grammar: Optional[str] = None,
                 **sampling) -> GenerateResult:
        """Generate and return the whole result. `on_piece(text, token)` is called in this
        thread for each piece; returning True stops the generation ("cancelled"). An
        exception from on_piece, or KeyboardInterrupt, stops the generation and
        propagates; the session stays usable."""
        # lookahead 1: the model waits while on_piece runs, so a stop takes effect at once.
        gen = self.generate(prompt, max_tokens, stop, ignore_eos, parse_special, lookahead=1, logprobs=logprobs,
                            response_format=response_format, grammar=grammar, **sampling)
        with gen:
            for piece in gen:
                if on_piece is not None and on_piece(piece, gen.last_token):
                    break
        assert gen.result is not None
        return gen.result

    def chat(self, messages: List[Message], max_tokens: int = 128, stop: Union[None, str, Iterable[str]] = None,
             template: Optional[str] = None, **sampling) -> Generation:
        """Stream the assistant's reply to `messages` (OpenAI-style dicts with "role" and
        "content"), rendered with the model's chat template. The session is reset first:
        the conversation is re-evaluated from its messages each call."""
        ids = self._model.chat_tokenize(messages, True, template)
        self.reset()
        return self.generate(ids, max_tokens, stop, **sampling)

    # -- persistence --

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the conversation (tokens, KV cache, sampler state) to `path` atomically."""
        _c.check(_c.session_save(self.handle, os.fsencode(path)))

    def restore(self, path: Union[str, os.PathLike]) -> None:
        """Replace the conversation with the one saved in `path`. On any error (E_IO,
        E_SESSION_CORRUPT, E_SESSION_VERSION, E_SESSION_MODEL_MISMATCH, E_CONTEXT_OVERFLOW)
        the session is unchanged."""
        _c.check(_c.session_restore(self.handle, os.fsencode(path)))


# ---- scheduler ------------------------------------------------------------------------------

@dataclass
class Executor:
    """One executor of a Scheduler (tandem_executor_params). device: "cpu", "cuda" or
    "cuda:N" (a GPU needs a library built with CUDA: TandemError(E_UNSUPPORTED)
    otherwise). kv_file_pages: a File tier of that many pages (in kv_dir) below the
    compute tier, for swapping preempted sequences (and for SchedulerSession.park).
    pool: a Pool this CPU executor computes on (n_threads must be 0)."""
    n_threads: int = 0
    max_running: int = 16
    step_token_budget: int = 256
    prefill_chunk: int = 128
    kv_pages: int = 0
    accelerator: Optional[bool] = None
    device: str = "cpu"
    kv_dtype: str = "f16"
    kv_file_pages: int = 0
    kv_dir: Optional[str] = None
    pool: Optional[Pool] = None

    def _fill(self, p: "_c.ExecutorParams", i: int) -> Optional[bytes]:
        _c.check(_c.executor_params_init(ctypes.byref(p), ctypes.sizeof(_c.ExecutorParams)))
        name = f"executors[{i}]."
        p.n_threads = _c.check_int(name + "n_threads", self.n_threads, 0, 512)
        p.max_running = _c.check_int(name + "max_running", self.max_running, 1, _c.INT32_MAX)
        p.step_token_budget = _c.check_int(name + "step_token_budget", self.step_token_budget, 1, _c.INT32_MAX)
        p.prefill_chunk = _c.check_int(name + "prefill_chunk", self.prefill_chunk, 1, _c.INT32_MAX)
        p.kv_pages = _c.check_int(name + "kv_pages", self.kv_pages, 0, _c.INT32_MAX)
        p.kv_file_pages = _c.check_int(name + "kv_file_pages", self.kv_file_pages, 0, _c.INT32_MAX)
        p.accelerator = -1 if self.accelerator is None else int(bool(self.accelerator))
        kind, _, ordinal = self.device.partition(":")
        if kind not in ("cpu", "cuda") or (ordinal and not ordinal.isdigit()) or (kind == "cpu" and ordinal):
            raise TandemError(E_INVALID_ARG, f"{name}device {self.device!r} is not \"cpu\", \"cuda\" or \"cuda:N\"")
        p.device_kind = _c.DEVICE_CUDA if kind == "cuda" else _c.DEVICE_CPU
        p.device_id = _c.check_int(name + "device id", int(ordinal or 0), 0, _c.INT32_MAX)
        if self.kv_dtype not in _c.KV_DTYPES:
            raise TandemError(E_INVALID_ARG, f"{name}kv_dtype {self.kv_dtype!r} is not one of {sorted(_c.KV_DTYPES)}")
        p.kv_dtype = _c.KV_DTYPES[self.kv_dtype]
        kv_dir = None if self.kv_dir is None else os.fsencode(self.kv_dir)
        p.kv_dir = kv_dir
        p.pool = None if self.pool is None else self.pool.handle
        return kv_dir


@dataclass
class RequestEvent:
    """One streamed event of a Request: kind "token" (one generated id and the text it
    completed, possibly empty while text is held back) or "finish" (finish_reason, and
    any text flushed at the end)."""
    kind: str
    token: int
    text: str
    finish_reason: Optional[str] = None


@dataclass
class RequestResult:
    id: int
    finish_reason: str
    tokens: List[int]
    text: str
    status: int = OK         # the error of finish_reason "error"
    message: str = ""
    n_prompt: int = 0
    queue_seconds: float = 0.0
    ttft_seconds: float = 0.0
    e2e_seconds: float = 0.0
    logprobs: List[TokenLogprob] = field(default_factory=list)  # one per token with logprobs= given


class Request(_Handle):
    """A request submitted to a Scheduler. Stream its events with ``for event in
    request`` or ``async for event in request`` (both block in the library's wait,
    tandem_request_next_event: no sleeping and polling), or poll(); wait() / await
    wait_async() for the whole result; cancel(); close() (a request closed before it
    finished is cancelled). Thread-safe."""

    _kind = "request"
    _free = _c.request_free
    _WAIT_SLICE_MS = 200  # one C wait; between slices Python can deliver Ctrl-C

    def __init__(self, handle: int, max_tokens: int, pool: concurrent.futures.ThreadPoolExecutor):
        self._h = handle
        self._max_tokens = max_tokens
        self._pool = pool
        self._logprobs = False  # logprobs requested: the result reads them
        self._buf = ctypes.create_string_buffer(1024)
        self._lock = threading.Lock()  # one event buffer: one taker at a time
        self._done = False

    def _take(self, timeout_ms: Optional[int]) -> Optional[RequestEvent]:
        """poll (timeout None) or next_event(timeout_ms)."""
        with self._lock:
            ev = _c.init(_c.RequestEvent, _c.request_event_init)
            while True:
                ev.text = ctypes.addressof(self._buf)
                ev.text_cap = len(self._buf)
                if timeout_ms is None:
                    status = _c.request_poll(self.handle, ctypes.byref(ev))
                else:
                    status = _c.request_next_event(self.handle, timeout_ms, ctypes.byref(ev))
                if status == E_BUFFER_TOO_SMALL:  # the event is kept: retry with room for it
                    self._buf = ctypes.create_string_buffer(ev.text_len + 1)
                    timeout_ms = None if timeout_ms is None else 0
                    continue
                _c.check(status)
                break
            if ev.kind == _c.EVENT_NONE:
                return None
            text = self._buf.raw[: ev.text_len].decode("utf-8")
        if ev.kind == _c.EVENT_TOKEN:
            return RequestEvent("token", ev.token, text)
        return RequestEvent("finish", -1, text, _c.FINISH_REASONS.get(ev.finish_reason, "?"))

    def poll(self) -> Optional[RequestEvent]:
        """The next event without blocking, or None when nothing is new. After the finish
        event, every poll returns it again (with empty text)."""
        return self._take(None)

    def next_event(self, timeout: Optional[float] = None) -> Optional[RequestEvent]:
        """Block (in the library) until the next event, or `timeout` seconds (None: no
        limit) have passed: None."""
        if timeout is None:
            while True:
                ev = self._take(self._WAIT_SLICE_MS)
                if ev is not None:
                    return ev
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise TandemError(E_INVALID_ARG, f"timeout must be a number >= 0 or None, not {timeout!r}")
        return self._take(int(min(timeout * 1000, _c.INT32_MAX)))

    def __iter__(self) -> Iterator[RequestEvent]:
        """The events up to and including the finish event."""
        while True:
            ev = self.next_event()
            yield ev
            if ev.kind == "finish":
                return

    def __aiter__(self) -> AsyncIterator[RequestEvent]:
        return self._aevents()

    async def _aevents(self) -> AsyncIterator[RequestEvent]:
        loop = asyncio.get_running_loop()
        while True:
            ev = await loop.run_in_executor(self._pool, self._take, self._WAIT_SLICE_MS)
            if ev is None:
                continue
            yield ev
            if ev.kind == "finish":
                return

    def text(self) -> str:
        """Consume the events and return the concatenated text."""
        return "".join(ev.text for ev in self)

    def cancel(self) -> None:
        """Ask the request to stop (finish "cancelled" within one step, unless finished)."""
        _c.check(_c.request_cancel(self.handle))

    def _fill(self, call) -> Optional[RequestResult]:
        r = _c.init(_c.RequestResult, _c.request_result_init)
        while True:
            tokens = (ctypes.c_int32 * max(self._max_tokens, 1))()
            text = ctypes.create_string_buffer(max(self._max_tokens * 16, 64))
            lps = (_c.TokenLogprob * max(self._max_tokens if self._logprobs else 0, 1))()
            r.tokens, r.tokens_cap = tokens, len(tokens)
            r.text, r.text_cap = ctypes.addressof(text), len(text)
            if self._logprobs:
                r.logprobs, r.logprobs_cap = lps, len(lps)
            _c.check(call(ctypes.byref(r)))
            if not r.finished:
                return None
            if r.n_tokens <= r.tokens_cap and r.text_len < r.text_cap and r.n_logprobs <= r.logprobs_cap:
                break
            self._max_tokens = max(r.n_tokens, r.text_len // 16 + 1)  # grow and read again
        return RequestResult(r.id, _c.FINISH_REASONS.get(r.finish_reason, "?"), list(tokens[: r.n_tokens]),
                             text.raw[: r.text_len].decode("utf-8", "replace"), r.status,
                             (r.message or b"").decode("utf-8", "replace"), r.n_prompt, r.queue_seconds,
                             r.ttft_seconds, r.e2e_seconds, _logprobs_out(lps, min(r.n_logprobs, r.logprobs_cap)))

    def wait(self, timeout: Optional[float] = None) -> Optional[RequestResult]:
        """Block until finished (or `timeout` seconds pass: None)."""
        h = self.handle
        if timeout is None:
            while True:
                res = self._fill(lambda r: _c.request_wait(h, self._WAIT_SLICE_MS, r))
                if res is not None:
                    return res
        ms = max(0, min(int(timeout * 1000), _c.INT32_MAX))
        return self._fill(lambda r: _c.request_wait(h, ms, r))

    async def wait_async(self) -> RequestResult:
        """await the whole result (the wait blocks in a worker thread, not the loop)."""
        loop = asyncio.get_running_loop()
        while True:
            h = self.handle
            res = await loop.run_in_executor(self._pool, self._fill,
                                             lambda r: _c.request_wait(h, self._WAIT_SLICE_MS, r))
            if res is not None:
                return res

    def result(self) -> Optional[RequestResult]:
        """The outcome if finished, else None (does not block)."""
        h = self.handle
        return self._fill(lambda r: _c.request_get_result(h, r))


@dataclass
class SchedulerSessionInfo:
    """SchedulerSession.info: tokens of the conversation, positions whose KV it holds,
    the executor holding it (-1: none), whether a request runs on it, and its KV pages
    per tier."""
    n_tokens: int
    kv_tokens: int
    executor: int
    busy: bool
    pages_device: int
    pages_host: int
    pages_file: int


class SchedulerSession:
    """A conversation kept by the Scheduler between requests (its KV parked, moved down
    the tiers under memory pressure, or to another executor when a request's SLA routes
    it there): submit() appends a prompt and generates, continuing where the last
    request stopped. One request at a time; close() releases the KV."""

    def __init__(self, scheduler: "Scheduler", session_id: int):
        self._scheduler = scheduler
        self.id = session_id
        self._closed = False

    def submit(self, prompt: Prompt = "", **kw) -> Request:
        """As Scheduler.submit, continuing this conversation ("" continues it as is)."""
        if self._closed:
            raise TandemError(E_INVALID_HANDLE, "the scheduler session is closed")
        return self._scheduler.submit(prompt, session=self.id, **kw)

    @property
    def info(self) -> "SchedulerSessionInfo":
        """Where the session's KV is (tandem_scheduler_session_get_info)."""
        i = _c.init(_c.SchedulerSessionInfo, _c.scheduler_session_info_init)
        _c.check(_c.scheduler_session_get_info(self._scheduler.handle, self.id, ctypes.byref(i)))
        return SchedulerSessionInfo(i.n_tokens, i.kv_tokens, i.executor, bool(i.busy), i.pages_device,
                                    i.pages_host, i.pages_file)

    def park(self) -> None:
        """Move the session's KV pages to the File tier of its executor (an Executor with
        kv_file_pages) until its next request, which brings them back unchanged (nothing
        is recomputed). Between requests only: TandemError(E_BUSY) while one runs;
        E_INVALID_ARG when the executor has no File tier; E_OUT_OF_MEMORY when it is
        full (nothing moved)."""
        _c.check(_c.scheduler_session_park(self._scheduler.handle, self.id))

    def unpark(self) -> None:
        """Bring a parked session's KV back to the compute tier ahead of its next
        request. Errors as park()."""
        _c.check(_c.scheduler_session_unpark(self._scheduler.handle, self.id))

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the conversation (its tokens, the KV of the evaluated ones, the last
        sampled token) to `path` in the session-file format of Session.save, atomically:
        on any error, a full disk included, the file is left as it was. Between requests
        only: TandemError(E_BUSY) while one runs. Scheduler.restore_session or
        Session.restore continue it (tandem_scheduler_session_save)."""
        _c.check(_c.scheduler_session_save(self._scheduler.handle, self.id, os.fsencode(path)))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._scheduler._h is not None:
                _c.check(_c.scheduler_session_close(self._scheduler._h, self.id))

    def __enter__(self) -> "SchedulerSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Scheduler(_Handle):
    """Many requests on one or more executors with continuous batching. `executors`: a
    list of Executor (default: one CPU executor); "cpu+cpu" is [Executor(n_threads=1,
    accelerator=True), Executor(n_threads=1)], "cpu+gpu" [Executor(), Executor(device=
    "cuda")]. Closing it cancels outstanding requests (their Request objects stay usable
    and report "cancelled")."""

    _kind = "scheduler"
    _free = _c.scheduler_free

    def __init__(self, model: Model, executors: Optional[Sequence[Executor]] = None, max_queued: int = 1024,
                 max_context: int = 0, prefix_cache_entries: int = 4, page_size: int = 16, log_routing: bool = True):
        executors = list(executors) if executors is not None else [Executor()]
        if not executors:
            raise TandemError(E_INVALID_ARG, "executors is empty")
        arr = (_c.ExecutorParams * len(executors))()
        keep = [e._fill(arr[i], i) for i, e in enumerate(executors)]
        params = _c.init(_c.SchedulerParams, _c.scheduler_params_init)
        params.executors = arr
        params.n_executors = len(executors)
        params.max_queued = _c.check_int("max_queued", max_queued, 0, _c.INT32_MAX)
        params.max_context = _c.check_int("max_context", max_context, 0, _c.INT32_MAX)
        params.prefix_cache_entries = _c.check_int("prefix_cache_entries", prefix_cache_entries, 0, _c.INT32_MAX)
        params.page_size = _c.check_int("page_size", page_size, 1, _c.INT32_MAX)
        params.log_routing = int(bool(log_routing))
        handle = _c.handle_t()
        _c.check(_c.scheduler_create(model.handle, ctypes.byref(params), ctypes.byref(handle)))
        del keep
        self._h = handle.value
        self._model = model
        # Threads for the async interface's blocking waits (one per awaiting request).
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="tandem-wait")

    def submit(self, prompt: Prompt, max_tokens: int = 128, stop: Union[None, str, Iterable[str]] = None,
               ignore_eos: bool = False, parse_special: bool = False, sla: str = "standard", deadline_ms: int = 0,
               session: int = 0, logprobs: Optional[int] = None, response_format: Optional[Dict[str, Any]] = None,
               grammar: Optional[str] = None, **sampling) -> Request:
        """Submit a request (prompt text or token ids). sla: "interactive", "standard" or
        "batch"; deadline_ms > 0 ends it with "timeout" after that long; session: a
        SchedulerSession id to continue (see open_session). Sampling keywords, `logprobs`
        (0..20: RequestResult.logprobs) and structured output (`response_format` /
        `grammar`) as Session.generate."""
        return self._submit(prompt, 1, max_tokens, stop, ignore_eos, parse_special, sla, deadline_ms, session,
                            logprobs, sampling, _grammar(response_format, grammar))[0]

    def submit_n(self, prompt: Prompt, n: int, max_tokens: int = 128, stop: Union[None, str, Iterable[str]] = None,
                 ignore_eos: bool = False, parse_special: bool = False, sla: str = "standard", deadline_ms: int = 0,
                 logprobs: Optional[int] = None, response_format: Optional[Dict[str, Any]] = None,
                 grammar: Optional[str] = None, **sampling) -> List[Request]:
        """n choices of one prompt (OpenAI's `n`, 1..128; tandem_scheduler_submit_n): the
        prompt is computed once and its KV pages shared; choice i samples with seed + i.
        One Request per choice, each finished and cancelled on its own. Other arguments as
        submit (no session)."""
        n = _c.check_int("n", n, 1, 128)
        return self._submit(prompt, n, max_tokens, stop, ignore_eos, parse_special, sla, deadline_ms, 0, logprobs,
                            sampling, _grammar(response_format, grammar))

    def _submit(self, prompt, n, max_tokens, stop, ignore_eos, parse_special, sla, deadline_ms, session, logprobs,
                sampling, grammar=(0, None)) -> List[Request]:
        if sla not in _c.SLA_CLASSES:
            raise TandemError(E_INVALID_ARG, f"sla {sla!r} is not one of {sorted(_c.SLA_CLASSES)}")
        max_tokens = _c.check_int("max_tokens", max_tokens, 1, _c.INT32_MAX)
        call = _Call(max_tokens, stop, ignore_eos, parse_special, sampling, 0, logprobs)  # sampling, stop, logprobs
        p = _c.init(_c.RequestParams, _c.request_params_init)
        keep: List[Any] = []
        if isinstance(prompt, (str, bytes)):
            data = _c.text_bytes("the prompt", prompt)
            p.prompt = data
            keep.append(data)
        else:
            arr, n_ids = _c.ids_array(prompt)
            p.prompt_tokens, p.n_prompt_tokens = arr, n_ids
            keep.append(arr)
        p.sampling = ctypes.pointer(call.sampling)
        p.stop, p.n_stop = call.params.stop, call.params.n_stop
        p.max_tokens, p.flags = max_tokens, call.params.flags
        p.sla = _c.SLA_CLASSES[sla]
        p.deadline_ms = _c.check_int("deadline_ms", deadline_ms, 0, _c.INT32_MAX)
        p.session = _c.check_int("session", session, 0, _c.UINT64_MAX)
        p.logprobs = call.params.logprobs
        p.grammar_type, p.grammar = grammar
        handles = (_c.handle_t * n)()
        if n == 1:
            _c.check(_c.scheduler_submit(self.handle, ctypes.byref(p), handles))
        else:
            _c.check(_c.scheduler_submit_n(self.handle, ctypes.byref(p), n, handles))
        reqs = []
        for h in handles:
            req = Request(h, max_tokens, self._pool)
            req._logprobs = logprobs is not None
            reqs.append(req)
        return reqs

    def open_session(self) -> SchedulerSession:
        """A conversation continued over several requests (see SchedulerSession)."""
        sid = ctypes.c_uint64()
        _c.check(_c.scheduler_session_open(self.handle, ctypes.byref(sid)))
        return SchedulerSession(self, sid.value)

    def restore_session(self, path: Union[str, os.PathLike], executor: int = 0) -> SchedulerSession:
        """A new session from a file written by SchedulerSession.save or Session.save (same
        model), its KV in executor `executor`'s store (the compute tier when it has room,
        else the File tier). Errors (nothing opened): E_INVALID_ARG (executor out of
        range), E_IO, E_SESSION_CORRUPT, E_SESSION_VERSION, E_SESSION_MODEL_MISMATCH,
        E_CONTEXT_OVERFLOW, E_OUT_OF_MEMORY (tandem_scheduler_session_restore)."""
        sid = ctypes.c_uint64()
        _c.check(_c.scheduler_session_restore(self.handle, os.fsencode(path), executor, ctypes.byref(sid)))
        return SchedulerSession(self, sid.value)

    def drain(self) -> None:
        """Stop accepting (later requests finish "overloaded"); wait for all to finish."""
        _c.check(_c.scheduler_drain(self.handle))

    def shutdown(self) -> None:
        """Cancel everything outstanding and stop; later submits raise E_INVALID_ARG."""
        _c.check(_c.scheduler_shutdown(self.handle))

    def close(self) -> None:
        super().close()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)

    def metrics(self) -> dict:
        """The serving metrics (tandem_scheduler_metrics_json, parsed)."""
        import json
        h = self.handle
        while True:
            try:
                return json.loads(_c.read_text(lambda b, c, o: _c.scheduler_metrics_json(h, b, c, o)).decode())
            except TandemError as e:  # the JSON grew between the size query and the copy
                if e.status != E_BUFFER_TOO_SMALL:
                    raise
