"""Tandem from Python, through the C ABI (cabi/include/tandem.h) with ctypes only.

No third-party packages. The library is found, in order, from:
  TANDEM_LIB      path of libtandem.so itself
  TANDEM_PREFIX   an install prefix (PREFIX/lib/libtandem.so)
  the system      ctypes.util.find_library("tandem")

    import tandem
    model = tandem.Model("aidreams260K-q4_0.gguf")
    session = tandem.Session(model, n_threads=2)
    for piece in session.generate("Once upon a time", max_tokens=64, temperature=0):
        print(piece, end="", flush=True)

Errors raise tandem.TandemError (status code, status name, the library's message).
Thread-safety is the C ABI's: a Model may be shared by threads; a Session serves one
call at a time and refuses a concurrent one with TandemError(BUSY).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import queue
import threading
from array import array
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, List, Optional, Sequence

__all__ = [
    "TandemError", "Model", "ModelInfo", "Session", "SessionInfo", "Generation", "GenerateResult",
    "version", "library_path", "OK", "E_INVALID_ARG", "E_IO", "E_OUT_OF_MEMORY", "E_CONTEXT_OVERFLOW",
    "E_INTERNAL", "E_INVALID_HANDLE", "E_BUSY", "E_BUFFER_TOO_SMALL", "E_SESSION_CORRUPT",
    "E_SESSION_MODEL_MISMATCH", "E_SESSION_VERSION", "Scheduler", "Request", "RequestEvent", "RequestResult",
    "Executor",
]

# ---- status codes (tandem.h) ------------------------------------------------------------
OK = 0
E_INVALID_ARG = 1
E_IO = 2
E_OUT_OF_MEMORY = 3
E_GGUF_BAD_MAGIC = 10
E_TOKENIZER = 40
E_CONTEXT_OVERFLOW = 50
E_BAD_POSITION = 51
E_KV_MISMATCH = 60
E_KV_CHECKSUM = 61
E_KV_LEASE_EXPIRED = 62
E_KV_TOKEN_RANGE = 63
E_SESSION_CORRUPT = 70
E_SESSION_MODEL_MISMATCH = 71
E_SESSION_VERSION = 72
E_INTERNAL = 99
E_INVALID_HANDLE = 100
E_BUSY = 101
E_BUFFER_TOO_SMALL = 102

TOKENIZE_ADD_SPECIAL = 1
TOKENIZE_PARSE_SPECIAL = 2
DETOKENIZE_REMOVE_SPECIAL = 1
DETOKENIZE_UNPARSE_SPECIAL = 2
GENERATE_IGNORE_EOS = 1
GENERATE_PARSE_SPECIAL = 2

FINISH_REASONS = {0: "stop", 1: "stop_string", 2: "length", 3: "cancelled", 4: "timeout", 5: "overloaded",
                  6: "error"}
SLA_CLASSES = {"interactive": 0, "standard": 1, "batch": 2}
EVENT_NONE, EVENT_TOKEN, EVENT_FINISH = 0, 1, 2


# ---- the library --------------------------------------------------------------------------

def _find_library() -> str:
    env = os.environ.get("TANDEM_LIB")
    if env:
        return env
    prefix = os.environ.get("TANDEM_PREFIX")
    if prefix:
        for libdir in ("lib", "lib64", os.path.join("lib", "x86_64-linux-gnu")):
            path = os.path.join(prefix, libdir, "libtandem.so")
            if os.path.exists(path):
                return path
    found = ctypes.util.find_library("tandem")
    return found or "libtandem.so.0"


library_path = _find_library()
_lib = ctypes.CDLL(library_path)

_status = ctypes.c_int32
_handle = ctypes.c_void_p
_size = ctypes.c_size_t
_i32p = ctypes.POINTER(ctypes.c_int32)
_f32p = ctypes.POINTER(ctypes.c_float)


class _ModelParams(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("check_block_scales", ctypes.c_int32),
                ("max_alignment", ctypes.c_uint32)]


class _ModelInfo(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("arch", ctypes.c_char_p), ("name", ctypes.c_char_p),
                ("n_vocab", ctypes.c_int32), ("n_ctx_train", ctypes.c_int32), ("n_embd", ctypes.c_int32),
                ("n_layer", ctypes.c_int32), ("n_head", ctypes.c_int32), ("n_head_kv", ctypes.c_int32),
                ("token_bos", ctypes.c_int32), ("token_eos", ctypes.c_int32),
                ("weight_bytes", ctypes.c_uint64)]


class _SessionParams(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("n_ctx", ctypes.c_int32), ("n_batch", ctypes.c_int32),
                ("page_size", ctypes.c_int32), ("n_threads", ctypes.c_int32)]


class _SessionInfo(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("n_ctx", ctypes.c_int32), ("n_tokens", ctypes.c_int32),
                ("n_batch", ctypes.c_int32), ("page_size", ctypes.c_int32), ("n_threads", ctypes.c_int32),
                ("has_logits", ctypes.c_int32)]


class _SamplingParams(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("temperature", ctypes.c_float), ("top_k", ctypes.c_int32),
                ("top_p", ctypes.c_float), ("min_p", ctypes.c_float), ("repeat_penalty", ctypes.c_float),
                ("repeat_last_n", ctypes.c_int32), ("frequency_penalty", ctypes.c_float),
                ("presence_penalty", ctypes.c_float), ("seed", ctypes.c_uint64)]


class _GenerateParams(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("sampling", ctypes.POINTER(_SamplingParams)),
                ("stop", ctypes.POINTER(ctypes.c_char_p)), ("n_stop", _size),
                ("max_tokens", ctypes.c_int32), ("flags", ctypes.c_uint32)]


class _GenerateResult(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("tokens", _i32p), ("tokens_cap", _size),
                ("text", ctypes.c_char_p), ("text_cap", _size), ("n_tokens", _size), ("text_len", _size),
                ("finish_reason", ctypes.c_int32), ("n_prompt", ctypes.c_int32),
                ("prompt_seconds", ctypes.c_double), ("generate_seconds", ctypes.c_double)]


class _ExecutorParams(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("n_threads", ctypes.c_int32), ("max_running", ctypes.c_int32),
                ("step_token_budget", ctypes.c_int32), ("prefill_chunk", ctypes.c_int32),
                ("kv_pages", ctypes.c_int32), ("accelerator", ctypes.c_int32)]


class _SchedulerParams(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("executors", ctypes.POINTER(_ExecutorParams)), ("n_executors", _size),
                ("max_queued", ctypes.c_int32), ("max_context", ctypes.c_int32),
                ("prefix_cache_entries", ctypes.c_int32), ("page_size", ctypes.c_int32)]


class _RequestParams(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("prompt", ctypes.c_char_p), ("prompt_tokens", _i32p),
                ("n_prompt_tokens", _size), ("sampling", ctypes.POINTER(_SamplingParams)),
                ("stop", ctypes.POINTER(ctypes.c_char_p)), ("n_stop", _size), ("max_tokens", ctypes.c_int32),
                ("flags", ctypes.c_uint32), ("sla", ctypes.c_int32), ("deadline_ms", ctypes.c_int32)]


class _RequestEvent(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("text", ctypes.c_void_p), ("text_cap", _size), ("text_len", _size),
                ("kind", ctypes.c_int32), ("token", ctypes.c_int32), ("finish_reason", ctypes.c_int32),
                ("reserved", ctypes.c_int32)]


class _RequestResult(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("tokens", _i32p), ("tokens_cap", _size), ("text", ctypes.c_void_p),
                ("text_cap", _size), ("n_tokens", _size), ("text_len", _size), ("id", ctypes.c_uint64),
                ("finished", ctypes.c_int32), ("finish_reason", ctypes.c_int32), ("status", ctypes.c_int32),
                ("n_prompt", ctypes.c_int32), ("message", ctypes.c_char_p), ("queue_seconds", ctypes.c_double),
                ("ttft_seconds", ctypes.c_double), ("e2e_seconds", ctypes.c_double)]


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, _size, ctypes.c_int32, ctypes.c_void_p)


def _proto(name, restype, *argtypes):
    fn = getattr(_lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


_version = _proto("tandem_version", ctypes.c_char_p)
_last_error = _proto("tandem_last_error", ctypes.c_char_p)
_status_name = _proto("tandem_status_name", ctypes.c_char_p, _status)
_model_params_init = _proto("tandem_model_params_init", _status, ctypes.POINTER(_ModelParams), _size)
_model_load = _proto("tandem_model_load", _status, ctypes.c_char_p, ctypes.POINTER(_ModelParams),
                     ctypes.POINTER(_handle))
_model_free = _proto("tandem_model_free", _status, _handle)
_model_info_init = _proto("tandem_model_info_init", _status, ctypes.POINTER(_ModelInfo), _size)
_model_get_info = _proto("tandem_model_get_info", _status, _handle, ctypes.POINTER(_ModelInfo))
_model_identity_hash = _proto("tandem_model_identity_hash", _status, _handle, ctypes.POINTER(ctypes.c_uint64))
_tokenize = _proto("tandem_tokenize", _status, _handle, ctypes.c_char_p, _size, ctypes.c_uint32, _i32p, _size,
                   ctypes.POINTER(_size))
_detokenize = _proto("tandem_detokenize", _status, _handle, _i32p, _size, ctypes.c_uint32, ctypes.c_char_p,
                     _size, ctypes.POINTER(_size))
_token_to_piece = _proto("tandem_token_to_piece", _status, _handle, ctypes.c_int32, ctypes.c_uint32,
                         ctypes.c_char_p, _size, ctypes.POINTER(_size))
_session_params_init = _proto("tandem_session_params_init", _status, ctypes.POINTER(_SessionParams), _size)
_session_create = _proto("tandem_session_create", _status, _handle, ctypes.POINTER(_SessionParams),
                         ctypes.POINTER(_handle))
_session_free = _proto("tandem_session_free", _status, _handle)
_session_info_init = _proto("tandem_session_info_init", _status, ctypes.POINTER(_SessionInfo), _size)
_session_get_info = _proto("tandem_session_get_info", _status, _handle, ctypes.POINTER(_SessionInfo))
_session_reset = _proto("tandem_session_reset", _status, _handle)
_session_eval = _proto("tandem_session_eval", _status, _handle, _i32p, _size, _f32p, _size)
_session_get_logits = _proto("tandem_session_get_logits", _status, _handle, _f32p, _size, ctypes.POINTER(_size))
_session_get_tokens = _proto("tandem_session_get_tokens", _status, _handle, _i32p, _size, ctypes.POINTER(_size))
_sampling_params_init = _proto("tandem_sampling_params_init", _status, ctypes.POINTER(_SamplingParams), _size)
_generate_params_init = _proto("tandem_generate_params_init", _status, ctypes.POINTER(_GenerateParams), _size)
_generate_result_init = _proto("tandem_generate_result_init", _status, ctypes.POINTER(_GenerateResult), _size)
_session_generate = _proto("tandem_session_generate", _status, _handle, ctypes.c_char_p,
                           ctypes.POINTER(_GenerateParams), _CALLBACK, ctypes.c_void_p,
                           ctypes.POINTER(_GenerateResult))
_session_generate_tokens = _proto("tandem_session_generate_tokens", _status, _handle, _i32p, _size,
                                  ctypes.POINTER(_GenerateParams), _CALLBACK, ctypes.c_void_p,
                                  ctypes.POINTER(_GenerateResult))
_session_save = _proto("tandem_session_save", _status, _handle, ctypes.c_char_p)
_session_restore = _proto("tandem_session_restore", _status, _handle, ctypes.c_char_p)
_executor_params_init = _proto("tandem_executor_params_init", _status, ctypes.POINTER(_ExecutorParams), _size)
_scheduler_params_init = _proto("tandem_scheduler_params_init", _status, ctypes.POINTER(_SchedulerParams), _size)
_request_params_init = _proto("tandem_request_params_init", _status, ctypes.POINTER(_RequestParams), _size)
_request_event_init = _proto("tandem_request_event_init", _status, ctypes.POINTER(_RequestEvent), _size)
_request_result_init = _proto("tandem_request_result_init", _status, ctypes.POINTER(_RequestResult), _size)
_scheduler_create = _proto("tandem_scheduler_create", _status, _handle, ctypes.POINTER(_SchedulerParams),
                           ctypes.POINTER(_handle))
_scheduler_free = _proto("tandem_scheduler_free", _status, _handle)
_scheduler_submit = _proto("tandem_scheduler_submit", _status, _handle, ctypes.POINTER(_RequestParams),
                           ctypes.POINTER(_handle))
_scheduler_drain = _proto("tandem_scheduler_drain", _status, _handle)
_scheduler_shutdown = _proto("tandem_scheduler_shutdown", _status, _handle)
_scheduler_metrics_json = _proto("tandem_scheduler_metrics_json", _status, _handle, ctypes.c_char_p, _size,
                                 ctypes.POINTER(_size))
_request_poll = _proto("tandem_request_poll", _status, _handle, ctypes.POINTER(_RequestEvent))
_request_cancel = _proto("tandem_request_cancel", _status, _handle)
_request_wait = _proto("tandem_request_wait", _status, _handle, ctypes.c_int32, ctypes.POINTER(_RequestResult))
_request_get_result = _proto("tandem_request_get_result", _status, _handle, ctypes.POINTER(_RequestResult))
_request_free = _proto("tandem_request_free", _status, _handle)


class TandemError(Exception):
    """A tandem_* call failed: .status (the number), .name ("INVALID_ARG", ...), .message."""

    def __init__(self, status: int, message: str):
        self.status = status
        self.name = _status_name(status).decode()
        self.message = message
        super().__init__(f"{self.name} ({status}): {message}")


def _check(status: int) -> None:
    if status != OK:
        raise TandemError(status, _last_error().decode("utf-8", "replace"))


def _init(struct_type, init_fn):
    s = struct_type()
    _check(init_fn(ctypes.byref(s), ctypes.sizeof(s)))
    return s


def version() -> str:
    """Version of the loaded library ("MAJOR.MINOR.PATCH")."""
    return _version().decode()


def _ids_array(ids: Sequence[int]):
    for i in ids:  # ctypes would wrap a value outside int32 silently
        if not isinstance(i, int) or not 0 <= i < 2**31:
            raise TandemError(E_INVALID_ARG, f"token id {i!r} is not an integer in [0, 2**31)")
    arr = (ctypes.c_int32 * max(len(ids), 1))(*ids)
    return arr, len(ids)


# ---- model --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelInfo:
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


class _Handle:
    """A library handle owned by a Python object: `handle` (raises once closed), close()
    (idempotent; frees through `_free`), context manager, closed on garbage collection.
    Subclasses set `_kind` (for the message) and `_free` (the tandem_*_free function)."""

    _kind = "handle"
    _free = None
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
            _check(type(self)._free(h))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Model(_Handle):
    """An immutable loaded GGUF model. Safe to share between threads. Closing it leaves the
    sessions created from it working."""

    _kind = "model"
    _free = _model_free

    def __init__(self, path: str | os.PathLike, check_block_scales: bool = True):
        params = _init(_ModelParams, _model_params_init)
        params.check_block_scales = 1 if check_block_scales else 0
        handle = _handle()
        _check(_model_load(os.fsencode(path), ctypes.byref(params), ctypes.byref(handle)))
        self._h = handle.value

    @property
    def info(self) -> ModelInfo:
        i = _init(_ModelInfo, _model_info_init)
        _check(_model_get_info(self.handle, ctypes.byref(i)))
        return ModelInfo(i.arch.decode(), i.name.decode("utf-8", "replace"), i.n_vocab, i.n_ctx_train, i.n_embd,
                         i.n_layer, i.n_head, i.n_head_kv, i.token_bos, i.token_eos, i.weight_bytes)

    def identity_hash(self) -> int:
        h = ctypes.c_uint64()
        _check(_model_identity_hash(self.handle, ctypes.byref(h)))
        return h.value

    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> List[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        flags = (TOKENIZE_ADD_SPECIAL if add_special else 0) | (TOKENIZE_PARSE_SPECIAL if parse_special else 0)
        n = _size()
        _check(_tokenize(self.handle, data, len(data), flags, None, 0, ctypes.byref(n)))  # size query
        out = (ctypes.c_int32 * max(n.value, 1))()
        _check(_tokenize(self.handle, data, len(data), flags, out, n.value, ctypes.byref(n)))
        return list(out[: n.value])

    def detokenize_bytes(self, ids: Sequence[int], remove_special: bool = False,
                         unparse_special: bool = False) -> bytes:
        arr, n_ids = _ids_array(ids)
        flags = (DETOKENIZE_REMOVE_SPECIAL if remove_special else 0) | (
            DETOKENIZE_UNPARSE_SPECIAL if unparse_special else 0)
        n = _size()
        _check(_detokenize(self.handle, arr, n_ids, flags, None, 0, ctypes.byref(n)))
        buf = ctypes.create_string_buffer(n.value + 1)
        _check(_detokenize(self.handle, arr, n_ids, flags, buf, n.value + 1, ctypes.byref(n)))
        return buf.raw[: n.value]

    def detokenize(self, ids: Sequence[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        """Text of `ids` (bytes that are not valid UTF-8 become U+FFFD)."""
        return self.detokenize_bytes(ids, remove_special, unparse_special).decode("utf-8", "replace")

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        flags = DETOKENIZE_UNPARSE_SPECIAL if special else 0
        n = _size()
        _check(_token_to_piece(self.handle, token, flags, None, 0, ctypes.byref(n)))
        buf = ctypes.create_string_buffer(n.value + 1)
        _check(_token_to_piece(self.handle, token, flags, buf, n.value + 1, ctypes.byref(n)))
        return buf.raw[: n.value]


# ---- session ------------------------------------------------------------------------------

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
    text: str = ""
    tokens: List[int] = field(default_factory=list)
    finish_reason: str = ""
    n_prompt: int = 0
    prompt_seconds: float = 0.0
    generate_seconds: float = 0.0


_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
                    "frequency_penalty", "presence_penalty", "seed")


class _Call:
    """The C structs and buffers of one generate call (kept alive for its duration)."""

    def __init__(self, max_tokens: int, stop: Optional[Iterable[str]], ignore_eos: bool, parse_special: bool,
                 sampling: dict, n_ctx: int):
        unknown = set(sampling) - set(_SAMPLING_FIELDS)
        if unknown:
            raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
        self.sampling = _init(_SamplingParams, _sampling_params_init)
        for k, v in sampling.items():
            if v is not None:
                setattr(self.sampling, k, v)
        self.params = _init(_GenerateParams, _generate_params_init)
        self.params.sampling = ctypes.pointer(self.sampling)
        self.params.max_tokens = max_tokens
        self.params.flags = (GENERATE_IGNORE_EOS if ignore_eos else 0) | (
            GENERATE_PARSE_SPECIAL if parse_special else 0)
        stops = [s.encode("utf-8") for s in (stop or [])]
        self.stop_array = (ctypes.c_char_p * max(len(stops), 1))(*stops)
        if stops:
            self.params.stop = self.stop_array
            self.params.n_stop = len(stops)
        self.result = _init(_GenerateResult, _generate_result_init)
        # A generation never outgrows the context: size the buffer by that, not max_tokens.
        cap = max(min(max_tokens, n_ctx), 0)
        self.tokens = (ctypes.c_int32 * max(cap, 1))()
        self.result.tokens = self.tokens
        self.result.tokens_cap = cap

    def to_result(self, pieces: List[str]) -> GenerateResult:
        r = self.result
        n = min(r.n_tokens, r.tokens_cap)
        return GenerateResult("".join(pieces), list(self.tokens[:n]), FINISH_REASONS.get(r.finish_reason, "?"),
                              r.n_prompt, r.prompt_seconds, r.generate_seconds)


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
            text = ctypes.string_at(ptr, length).decode("utf-8")
            while True:
                try:
                    self.queue.put(text, timeout=0.05)
                    return 0
                except queue.Full:
                    if self.cancel.is_set():
                        return 1

        self.callback = _CALLBACK(on_piece)  # referenced for the call's lifetime

    def run(self, start: Callable[[_CALLBACK], int]) -> None:
        status = start(self.callback)
        if status != OK:
            self.status = status
            self.error = _last_error().decode("utf-8", "replace")  # per thread: read it here
        self.queue.put(_Stream.DONE)


class Generation:
    """A streaming generation: iterate for text pieces (str) as they are produced;
    `.result` (GenerateResult) is set once the iteration is finished. `close()` (or
    leaving a `with` block, or dropping the iterator) cancels a generation in progress
    and waits until the session is free again.

    The C call runs in a worker thread and hands pieces over through a bounded queue, so
    the text streams while the model computes; ctypes releases the GIL during the call."""

    def __init__(self, start: Callable[[_CALLBACK], int], call: _Call, lookahead: int = 256):
        self.result: Optional[GenerateResult] = None
        self._call = call
        self._pieces: List[str] = []
        self._finished = False
        self._stream = _Stream(lookahead)
        self._thread = threading.Thread(target=self._stream.run, args=(start,), name="tandem-generate",
                                        daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self._finished:
            raise StopIteration
        item = self._stream.queue.get()
        if item is _Stream.DONE:
            self._thread.join()
            self._finished = True
            if self._stream.status != OK:
                raise TandemError(self._stream.status, self._stream.error)
            self.result = self._call.to_result(self._pieces)
            raise StopIteration
        self._pieces.append(item)
        return item

    def close(self) -> None:
        """Stop the generation (finish reason "cancelled") and wait for the worker."""
        if self._finished:
            return
        self._stream.cancel.set()
        while self._thread.is_alive():
            try:
                item = self._stream.queue.get(timeout=0.05)
                if item is not _Stream.DONE:
                    self._pieces.append(item)
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


class Session(_Handle):
    """One conversation with its own CPU executor. One call at a time (a concurrent call
    raises TandemError with status E_BUSY)."""

    _kind = "session"
    _free = _session_free

    def __init__(self, model: Model, n_ctx: int = 0, n_batch: int = 512, page_size: int = 16,
                 n_threads: int = 0):
        params = _init(_SessionParams, _session_params_init)
        params.n_ctx, params.n_batch, params.page_size, params.n_threads = n_ctx, n_batch, page_size, n_threads
        handle = _handle()
        _check(_session_create(model.handle, ctypes.byref(params), ctypes.byref(handle)))
        self._h = handle.value
        self.n_vocab = model.info.n_vocab

    @property
    def info(self) -> SessionInfo:
        i = _init(_SessionInfo, _session_info_init)
        _check(_session_get_info(self.handle, ctypes.byref(i)))
        return SessionInfo(i.n_ctx, i.n_tokens, i.n_batch, i.page_size, i.n_threads, bool(i.has_logits))

    def reset(self) -> None:
        _check(_session_reset(self.handle))

    def eval(self, ids: Sequence[int], all_logits: bool = False) -> Optional[List[array]]:
        """Append `ids` to the conversation. With all_logits, return one row of n_vocab
        floats (array('f')) per id."""
        arr, n = _ids_array(ids)
        if not all_logits:
            _check(_session_eval(self.handle, arr, n, None, 0))
            return None
        buf = (ctypes.c_float * max(n * self.n_vocab, 1))()
        _check(_session_eval(self.handle, arr, n, buf, n * self.n_vocab))
        flat = array("f", bytes(buf)[: n * self.n_vocab * 4])
        return [flat[i * self.n_vocab:(i + 1) * self.n_vocab] for i in range(n)]

    def logits(self) -> array:
        """Logits after the last evaluated token (empty before the first evaluation)."""
        n = _size()
        _check(_session_get_logits(self.handle, None, 0, ctypes.byref(n)))
        buf = (ctypes.c_float * max(n.value, 1))()
        _check(_session_get_logits(self.handle, buf, n.value, ctypes.byref(n)))
        return array("f", bytes(buf)[: n.value * 4])

    def tokens(self) -> List[int]:
        """Ids whose KV is in the cache, in order."""
        n = _size()
        _check(_session_get_tokens(self.handle, None, 0, ctypes.byref(n)))
        buf = (ctypes.c_int32 * max(n.value, 1))()
        _check(_session_get_tokens(self.handle, buf, n.value, ctypes.byref(n)))
        return list(buf[: n.value])

    # -- generation --

    def _starter(self, prompt, call: _Call):
        handle = self.handle
        if isinstance(prompt, (str, bytes)):
            data = prompt.encode("utf-8") if isinstance(prompt, str) else prompt
            if b"\0" in data:
                raise TandemError(E_INVALID_ARG, "the prompt contains a NUL byte")
            return lambda cb: _session_generate(handle, data, ctypes.byref(call.params), cb, None,
                                                ctypes.byref(call.result))
        arr, n = _ids_array(list(prompt))
        return lambda cb: _session_generate_tokens(handle, arr, n, ctypes.byref(call.params), cb, None,
                                                   ctypes.byref(call.result))

    def generate(self, prompt: str | bytes | Sequence[int], max_tokens: int = 128,
                 stop: Optional[Iterable[str]] = None, ignore_eos: bool = False, parse_special: bool = False,
                 lookahead: int = 256, **sampling) -> Generation:
        """Stream a generation: returns a Generation, an iterator of text pieces. `prompt`
        is text (UTF-8; BOS added on an empty session) or a list of token ids. Sampling
        keywords: temperature (0 = greedy), top_k, top_p, min_p, repeat_penalty,
        repeat_last_n, frequency_penalty, presence_penalty, seed. `lookahead`: how many
        pieces generation may run ahead of the consumer before it waits (backpressure)."""
        call = _Call(max_tokens, stop, ignore_eos, parse_special, sampling, self.info.n_ctx)
        return Generation(self._starter(prompt, call), call, lookahead)

    def complete(self, prompt: str | bytes | Sequence[int], max_tokens: int = 128,
                 stop: Optional[Iterable[str]] = None, ignore_eos: bool = False, parse_special: bool = False,
                 on_piece: Optional[Callable[[str, int], Optional[bool]]] = None, **sampling) -> GenerateResult:
        """Generate in the calling thread. `on_piece(text, token)` is called for each piece;
        returning True stops the generation (finish reason "cancelled")."""
        call = _Call(max_tokens, stop, ignore_eos, parse_special, sampling, self.info.n_ctx)
        pieces: List[str] = []
        raised: List[BaseException] = []

        def cb(ptr, length, token, user_data):
            try:
                text = ctypes.string_at(ptr, length).decode("utf-8")
                pieces.append(text)
                return 1 if on_piece is not None and on_piece(text, token) else 0
            except BaseException as e:  # never let an exception unwind through C
                raised.append(e)
                return 1

        status = self._starter(prompt, call)(_CALLBACK(cb))
        if raised:
            raise raised[0]
        _check(status)
        return call.to_result(pieces)

    # -- persistence --

    def save(self, path: str | os.PathLike) -> None:
        """Write the conversation (tokens, KV cache, sampler state) to `path` atomically."""
        _check(_session_save(self.handle, os.fsencode(path)))

    def restore(self, path: str | os.PathLike) -> None:
        """Replace the conversation with the one saved in `path`. On any error (E_IO,
        E_SESSION_CORRUPT, E_SESSION_VERSION, E_SESSION_MODEL_MISMATCH, E_CONTEXT_OVERFLOW)
        the session is unchanged."""
        _check(_session_restore(self.handle, os.fsencode(path)))


# ---- scheduler ------------------------------------------------------------------------------

@dataclass
class Executor:
    """One CPU executor of a Scheduler (fields as tandem_executor_params)."""
    n_threads: int = 0
    max_running: int = 16
    step_token_budget: int = 256
    prefill_chunk: int = 128
    kv_pages: int = 0
    accelerator: Optional[bool] = None


@dataclass
class RequestEvent:
    kind: str               # "token" or "finish"
    token: int              # the generated id ("token"), else -1
    text: str               # the text it completed (may be empty)
    finish_reason: Optional[str] = None  # for "finish"


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


class Request(_Handle):
    """A request submitted to a Scheduler: poll() / iterate for streamed text, wait(),
    cancel(), close() (a request closed before it finished is cancelled)."""

    _kind = "request"
    _free = _request_free

    def __init__(self, handle: int, max_tokens: int):
        self._h = handle
        self._max_tokens = max_tokens
        self._buf = ctypes.create_string_buffer(1024)

    def poll(self) -> Optional[RequestEvent]:
        """The next event without blocking, or None when nothing is new. After the finish
        event, every poll returns it again (with empty text)."""
        ev = _init(_RequestEvent, _request_event_init)
        while True:
            ev.text = ctypes.addressof(self._buf)
            ev.text_cap = len(self._buf)
            status = _request_poll(self.handle, ctypes.byref(ev))
            if status == E_BUFFER_TOO_SMALL:  # the event is kept: retry with room for it
                self._buf = ctypes.create_string_buffer(ev.text_len + 1)
                continue
            _check(status)
            break
        if ev.kind == EVENT_NONE:
            return None
        text = self._buf.raw[: ev.text_len].decode("utf-8")
        if ev.kind == EVENT_TOKEN:
            return RequestEvent("token", ev.token, text)
        return RequestEvent("finish", -1, text, FINISH_REASONS.get(ev.finish_reason, "?"))

    def __iter__(self) -> Iterator[str]:
        """The streamed text pieces (polling; sleeps briefly while nothing is new)."""
        import time
        delay = 1e-4
        while True:
            ev = self.poll()
            if ev is None:
                time.sleep(delay)
                delay = min(delay * 2, 5e-3)
                continue
            delay = 1e-4
            if ev.text:
                yield ev.text
            if ev.kind == "finish":
                return

    def cancel(self) -> None:
        _check(_request_cancel(self.handle))

    def _fill(self, call) -> Optional[RequestResult]:
        r = _init(_RequestResult, _request_result_init)
        while True:
            tokens = (ctypes.c_int32 * max(self._max_tokens, 1))()
            text = ctypes.create_string_buffer(max(self._max_tokens * 16, 64))
            r.tokens, r.tokens_cap = tokens, len(tokens)
            r.text, r.text_cap = ctypes.addressof(text), len(text)
            _check(call(ctypes.byref(r)))
            if not r.finished:
                return None
            if r.n_tokens <= r.tokens_cap and r.text_len < r.text_cap:
                break
            self._max_tokens = max(r.n_tokens, r.text_len // 16 + 1)  # grow and read again
        return RequestResult(r.id, FINISH_REASONS.get(r.finish_reason, "?"), list(tokens[: r.n_tokens]),
                             text.raw[: r.text_len].decode("utf-8", "replace"), r.status,
                             (r.message or b"").decode("utf-8", "replace"), r.n_prompt, r.queue_seconds,
                             r.ttft_seconds, r.e2e_seconds)

    def wait(self, timeout: Optional[float] = None) -> Optional[RequestResult]:
        """Block until finished (or `timeout` seconds pass: None)."""
        ms = -1 if timeout is None else max(0, min(int(timeout * 1000), 2**31 - 1))
        h = self.handle
        return self._fill(lambda r: _request_wait(h, ms, r))

    def result(self) -> Optional[RequestResult]:
        """The outcome if finished, else None (does not block)."""
        h = self.handle
        return self._fill(lambda r: _request_get_result(h, r))


class Scheduler(_Handle):
    """Many requests on one or more CPU executors with continuous batching. `executors`:
    a list of Executor (default: one). "cpu+cpu" is [Executor(n_threads=1),
    Executor(n_threads=1)]. Closing it cancels outstanding requests (their Request objects
    stay usable and report "cancelled")."""

    _kind = "scheduler"
    _free = _scheduler_free

    def __init__(self, model: Model, executors: Optional[Sequence[Executor]] = None, max_queued: int = 1024,
                 max_context: int = 0, prefix_cache_entries: int = 4, page_size: int = 16):
        executors = list(executors) if executors is not None else [Executor()]
        arr = (_ExecutorParams * max(len(executors), 1))()
        for i, e in enumerate(executors):
            _check(_executor_params_init(ctypes.byref(arr[i]), ctypes.sizeof(_ExecutorParams)))
            arr[i].n_threads, arr[i].max_running = e.n_threads, e.max_running
            arr[i].step_token_budget, arr[i].prefill_chunk, arr[i].kv_pages = (
                e.step_token_budget, e.prefill_chunk, e.kv_pages)
            arr[i].accelerator = -1 if e.accelerator is None else int(bool(e.accelerator))
        params = _init(_SchedulerParams, _scheduler_params_init)
        params.executors = arr
        params.n_executors = len(executors)
        params.max_queued, params.max_context = max_queued, max_context
        params.prefix_cache_entries, params.page_size = prefix_cache_entries, page_size
        handle = _handle()
        _check(_scheduler_create(model.handle, ctypes.byref(params), ctypes.byref(handle)))
        self._h = handle.value
        self._model = model

    def submit(self, prompt: str | bytes | Sequence[int], max_tokens: int = 128,
               stop: Optional[Iterable[str]] = None, ignore_eos: bool = False, parse_special: bool = False,
               sla: str = "standard", deadline_ms: int = 0, **sampling) -> Request:
        """Submit a request (prompt text or token ids). sla: "interactive", "standard" or
        "batch". Sampling keywords as Session.generate (the C defaults when omitted)."""
        if sla not in SLA_CLASSES:
            raise TandemError(E_INVALID_ARG, f"sla {sla!r} is not one of {sorted(SLA_CLASSES)}")
        call = _Call(max_tokens, stop, ignore_eos, parse_special, sampling, 0)  # sampling + stop arrays only
        p = _init(_RequestParams, _request_params_init)
        keep = []
        if isinstance(prompt, (str, bytes)):
            data = prompt.encode("utf-8") if isinstance(prompt, str) else prompt
            if b"\0" in data:
                raise TandemError(E_INVALID_ARG, "the prompt contains a NUL byte")
            p.prompt = data
            keep.append(data)
        else:
            arr, n = _ids_array(list(prompt))
            p.prompt_tokens, p.n_prompt_tokens = arr, n
            keep.append(arr)
        p.sampling = ctypes.pointer(call.sampling)
        p.stop, p.n_stop = call.params.stop, call.params.n_stop
        p.max_tokens, p.flags = max_tokens, call.params.flags
        p.sla, p.deadline_ms = SLA_CLASSES[sla], deadline_ms
        handle = _handle()
        _check(_scheduler_submit(self.handle, ctypes.byref(p), ctypes.byref(handle)))
        return Request(handle.value, max_tokens)

    def drain(self) -> None:
        """Stop accepting (later requests finish "overloaded"); wait for all to finish."""
        _check(_scheduler_drain(self.handle))

    def shutdown(self) -> None:
        """Cancel everything outstanding and stop; later submits raise E_INVALID_ARG."""
        _check(_scheduler_shutdown(self.handle))

    def metrics(self) -> dict:
        """The serving metrics (tandem_scheduler_metrics_json, parsed)."""
        import json
        n = _size()
        while True:
            _check(_scheduler_metrics_json(self.handle, None, 0, ctypes.byref(n)))
            buf = ctypes.create_string_buffer(n.value + 256)
            status = _scheduler_metrics_json(self.handle, buf, len(buf), ctypes.byref(n))
            if status != E_BUFFER_TOO_SMALL:
                _check(status)
                return json.loads(buf.value.decode("utf-8"))
