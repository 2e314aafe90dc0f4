"""The ctypes layer over the C ABI (cabi/include/tandem.h): finding and loading
libtandem, the structs (field for field as the header, LP64), the prototypes, status
codes and TandemError. Nothing here is public API; `tandem` re-exports what is."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import List, Optional

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
E_UNSUPPORTED = 103

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
DEVICE_CPU, DEVICE_CUDA = 0, 1
KV_DEVICE, KV_HOST, KV_FILE = 0, 1, 2
KV_DTYPES = {"f32": 0, "f16": 1, "q8_0": 2}
LOG_LEVELS = {"debug": 0, "info": 1, "warn": 2, "error": 3}

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1


# ---- the library --------------------------------------------------------------------------

def _candidates() -> List[str]:
    """Where libtandem may be, in order: TANDEM_LIB (the .so itself), TANDEM_PREFIX (an
    install prefix), the copy `pip install` put inside this package, the system loader."""
    out: List[str] = []
    env = os.environ.get("TANDEM_LIB")
    if env:
        return [env]
    prefix = os.environ.get("TANDEM_PREFIX")
    if prefix:
        for libdir in ("lib", "lib64", os.path.join("lib", "x86_64-linux-gnu")):
            out.append(os.path.join(prefix, libdir, "libtandem.so"))
    out.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "libtandem.so"))
    return out


def _load() -> "tuple[ctypes.CDLL, str]":
    tried = []
    for path in _candidates():
        if os.path.exists(path) or os.environ.get("TANDEM_LIB"):
            try:
                return ctypes.CDLL(path), path
            except OSError as e:
                tried.append(f"{path}: {e}")
        else:
            tried.append(f"{path}: no such file")
    found = ctypes.util.find_library("tandem")
    if found:
        try:
            return ctypes.CDLL(found), found
        except OSError as e:
            tried.append(f"{found}: {e}")
    else:
        tried.append("the system loader path: no libtandem")
    raise ImportError(
        "tandem: cannot load libtandem (" + "; ".join(tried) + "). Install the package with `pip install .` "
        "from a Tandem checkout, or set TANDEM_LIB to the path of libtandem.so, or TANDEM_PREFIX to the prefix "
        "given to `cmake --install`.")


lib, library_path = _load()

_status = ctypes.c_int32
_handle = ctypes.c_void_p
_size = ctypes.c_size_t
_i32p = ctypes.POINTER(ctypes.c_int32)
_f32p = ctypes.POINTER(ctypes.c_float)
handle_t = _handle
size_t = _size


class ModelParams(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("check_block_scales", ctypes.c_int32),
                ("max_alignment", ctypes.c_uint32), ("chat_template", ctypes.c_char_p)]


class ModelInfo(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("arch", ctypes.c_char_p), ("name", ctypes.c_char_p),
                ("n_vocab", ctypes.c_int32), ("n_ctx_train", ctypes.c_int32), ("n_embd", ctypes.c_int32),
                ("n_layer", ctypes.c_int32), ("n_head", ctypes.c_int32), ("n_head_kv", ctypes.c_int32),
                ("token_bos", ctypes.c_int32), ("token_eos", ctypes.c_int32),
                ("weight_bytes", ctypes.c_uint64)]


class SessionParams(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("n_ctx", ctypes.c_int32), ("n_batch", ctypes.c_int32),
                ("page_size", ctypes.c_int32), ("n_threads", ctypes.c_int32), ("kv_tier", ctypes.c_int32),
                ("kv_dtype", ctypes.c_int32), ("kv_dir", ctypes.c_char_p), ("pool", _handle)]


class SessionInfo(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("n_ctx", ctypes.c_int32), ("n_tokens", ctypes.c_int32),
                ("n_batch", ctypes.c_int32), ("page_size", ctypes.c_int32), ("n_threads", ctypes.c_int32),
                ("has_logits", ctypes.c_int32)]


class SamplingParams(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("temperature", ctypes.c_float), ("top_k", ctypes.c_int32),
                ("top_p", ctypes.c_float), ("min_p", ctypes.c_float), ("repeat_penalty", ctypes.c_float),
                ("repeat_last_n", ctypes.c_int32), ("frequency_penalty", ctypes.c_float),
                ("presence_penalty", ctypes.c_float), ("seed", ctypes.c_uint64)]


class GenerateParams(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("sampling", ctypes.POINTER(SamplingParams)),
                ("stop", ctypes.POINTER(ctypes.c_char_p)), ("n_stop", _size),
                ("max_tokens", ctypes.c_int32), ("flags", ctypes.c_uint32), ("logprobs", ctypes.c_int32),
                ("reserved", ctypes.c_int32), ("grammar", ctypes.c_char_p), ("grammar_type", ctypes.c_int32),
                ("reserved2", ctypes.c_int32)]


# enum tandem_grammar_type
GRAMMAR_NONE, GRAMMAR_JSON_SCHEMA, GRAMMAR_JSON_OBJECT, GRAMMAR_GBNF = 0, 1, 2, 3


MAX_TOP_LOGPROBS = 20


class TokenLogprob(ctypes.Structure):
    _fields_ = [("token", ctypes.c_int32), ("logprob", ctypes.c_float), ("n_top", ctypes.c_int32),
                ("top_tokens", ctypes.c_int32 * MAX_TOP_LOGPROBS), ("top_logprobs", ctypes.c_float * MAX_TOP_LOGPROBS)]


class GenerateResult(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("tokens", _i32p), ("tokens_cap", _size),
                ("text", ctypes.c_char_p), ("text_cap", _size), ("n_tokens", _size), ("text_len", _size),
                ("finish_reason", ctypes.c_int32), ("n_prompt", ctypes.c_int32),
                ("prompt_seconds", ctypes.c_double), ("generate_seconds", ctypes.c_double),
                ("logprobs", ctypes.POINTER(TokenLogprob)), ("logprobs_cap", _size), ("n_logprobs", _size)]


class ExecutorParams(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("n_threads", ctypes.c_int32), ("max_running", ctypes.c_int32),
                ("step_token_budget", ctypes.c_int32), ("prefill_chunk", ctypes.c_int32),
                ("kv_pages", ctypes.c_int32), ("accelerator", ctypes.c_int32), ("device_kind", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("kv_dtype", ctypes.c_int32), ("kv_file_pages", ctypes.c_int32),
                ("kv_dir", ctypes.c_char_p), ("pool", _handle)]


class SchedulerSessionInfo(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("n_tokens", ctypes.c_int32), ("kv_tokens", ctypes.c_int32),
                ("executor", ctypes.c_int32), ("busy", ctypes.c_int32), ("pages_device", ctypes.c_int32),
                ("pages_host", ctypes.c_int32), ("pages_file", ctypes.c_int32), ("reserved", ctypes.c_int32)]


class SchedulerParams(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("executors", ctypes.POINTER(ExecutorParams)), ("n_executors", _size),
                ("max_queued", ctypes.c_int32), ("max_context", ctypes.c_int32),
                ("prefix_cache_entries", ctypes.c_int32), ("page_size", ctypes.c_int32),
                ("executor_handles", ctypes.POINTER(_handle)), ("log_routing", ctypes.c_int32),
                ("reserved", ctypes.c_int32)]


class RequestParams(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("prompt", ctypes.c_char_p), ("prompt_tokens", _i32p),
                ("n_prompt_tokens", _size), ("sampling", ctypes.POINTER(SamplingParams)),
                ("stop", ctypes.POINTER(ctypes.c_char_p)), ("n_stop", _size), ("max_tokens", ctypes.c_int32),
                ("flags", ctypes.c_uint32), ("sla", ctypes.c_int32), ("deadline_ms", ctypes.c_int32),
                ("session", ctypes.c_uint64), ("logprobs", ctypes.c_int32), ("reserved", ctypes.c_int32),
                ("grammar", ctypes.c_char_p), ("grammar_type", ctypes.c_int32), ("reserved2", ctypes.c_int32)]


class RequestEvent(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("text", ctypes.c_void_p), ("text_cap", _size), ("text_len", _size),
                ("kind", ctypes.c_int32), ("token", ctypes.c_int32), ("finish_reason", ctypes.c_int32),
                ("reserved", ctypes.c_int32)]


class RequestResult(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("tokens", _i32p), ("tokens_cap", _size), ("text", ctypes.c_void_p),
                ("text_cap", _size), ("n_tokens", _size), ("text_len", _size), ("id", ctypes.c_uint64),
                ("finished", ctypes.c_int32), ("finish_reason", ctypes.c_int32), ("status", ctypes.c_int32),
                ("n_prompt", ctypes.c_int32), ("message", ctypes.c_char_p), ("queue_seconds", ctypes.c_double),
                ("ttft_seconds", ctypes.c_double), ("e2e_seconds", ctypes.c_double),
                ("logprobs", ctypes.POINTER(TokenLogprob)), ("logprobs_cap", _size), ("n_logprobs", _size)]


class DeviceInfo(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("name", ctypes.c_char_p), ("isa", ctypes.c_char_p),
                ("memory_bytes", ctypes.c_uint64), ("kind", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("n_cores", ctypes.c_int32), ("compute_capability", ctypes.c_int32)]


TOKEN_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, _size, ctypes.c_int32, ctypes.c_void_p)
LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int32, ctypes.c_char_p, ctypes.c_void_p)


def _proto(name, restype, *argtypes):
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


def _ptr(t):
    return ctypes.POINTER(t)


version = _proto("tandem_version", ctypes.c_char_p)
version_number = _proto("tandem_version_number", ctypes.c_int32)
last_error = _proto("tandem_last_error", ctypes.c_char_p)
status_name = _proto("tandem_status_name", ctypes.c_char_p, _status)
log_set = _proto("tandem_log_set", _status, LOG_CALLBACK, ctypes.c_void_p, ctypes.c_int32)
device_info_init = _proto("tandem_device_info_init", _status, _ptr(DeviceInfo), _size)
device_count = _proto("tandem_device_count", _status, _ptr(_size))
device_get_info = _proto("tandem_device_get_info", _status, _size, _ptr(DeviceInfo))
model_params_init = _proto("tandem_model_params_init", _status, _ptr(ModelParams), _size)
model_load = _proto("tandem_model_load", _status, ctypes.c_char_p, _ptr(ModelParams), _ptr(_handle))
model_free = _proto("tandem_model_free", _status, _handle)
model_info_init = _proto("tandem_model_info_init", _status, _ptr(ModelInfo), _size)
model_get_info = _proto("tandem_model_get_info", _status, _handle, _ptr(ModelInfo))
model_identity_hash = _proto("tandem_model_identity_hash", _status, _handle, _ptr(ctypes.c_uint64))
model_meta_count = _proto("tandem_model_meta_count", _status, _handle, _ptr(_size))
model_meta_key_by_index = _proto("tandem_model_meta_key_by_index", _status, _handle, _size, ctypes.c_char_p, _size,
                                 _ptr(_size))
model_meta_value = _proto("tandem_model_meta_value", _status, _handle, ctypes.c_char_p, ctypes.c_char_p, _size,
                          _ptr(_size))
chat_render = _proto("tandem_chat_render", _status, _handle, ctypes.c_char_p, _ptr(ctypes.c_char_p),
                     _ptr(ctypes.c_char_p), _size, ctypes.c_int32, ctypes.c_char_p, _size, _ptr(_size))
chat_tokenize = _proto("tandem_chat_tokenize", _status, _handle, ctypes.c_char_p, _ptr(ctypes.c_char_p),
                       _ptr(ctypes.c_char_p), _size, ctypes.c_int32, _i32p, _size, _ptr(_size))
chat_apply_template = _proto("tandem_chat_apply_template", _status, _handle, ctypes.c_char_p, ctypes.c_char_p, _size,
                             _ptr(_size))
chat_apply_template_tokens = _proto("tandem_chat_apply_template_tokens", _status, _handle, ctypes.c_char_p, _i32p,
                                    _size, _ptr(_size))
chat_parse_tool_calls = _proto("tandem_chat_parse_tool_calls", _status, _handle, ctypes.c_char_p, ctypes.c_char_p,
                               _size, _ptr(_size))
tokenize = _proto("tandem_tokenize", _status, _handle, ctypes.c_char_p, _size, ctypes.c_uint32, _i32p, _size,
                  _ptr(_size))
detokenize = _proto("tandem_detokenize", _status, _handle, _i32p, _size, ctypes.c_uint32, ctypes.c_char_p, _size,
                    _ptr(_size))
token_to_piece = _proto("tandem_token_to_piece", _status, _handle, ctypes.c_int32, ctypes.c_uint32,
                        ctypes.c_char_p, _size, _ptr(_size))
session_params_init = _proto("tandem_session_params_init", _status, _ptr(SessionParams), _size)
session_create = _proto("tandem_session_create", _status, _handle, _ptr(SessionParams), _ptr(_handle))
session_free = _proto("tandem_session_free", _status, _handle)
session_info_init = _proto("tandem_session_info_init", _status, _ptr(SessionInfo), _size)
session_get_info = _proto("tandem_session_get_info", _status, _handle, _ptr(SessionInfo))
session_reset = _proto("tandem_session_reset", _status, _handle)
session_abort = _proto("tandem_session_abort", _status, _handle)
session_eval = _proto("tandem_session_eval", _status, _handle, _i32p, _size, _f32p, _size)
session_get_logits = _proto("tandem_session_get_logits", _status, _handle, _f32p, _size, _ptr(_size))
session_get_tokens = _proto("tandem_session_get_tokens", _status, _handle, _i32p, _size, _ptr(_size))
sampling_params_init = _proto("tandem_sampling_params_init", _status, _ptr(SamplingParams), _size)
generate_params_init = _proto("tandem_generate_params_init", _status, _ptr(GenerateParams), _size)
generate_result_init = _proto("tandem_generate_result_init", _status, _ptr(GenerateResult), _size)
session_generate = _proto("tandem_session_generate", _status, _handle, ctypes.c_char_p, _ptr(GenerateParams),
                          TOKEN_CALLBACK, ctypes.c_void_p, _ptr(GenerateResult))
session_generate_tokens = _proto("tandem_session_generate_tokens", _status, _handle, _i32p, _size,
                                 _ptr(GenerateParams), TOKEN_CALLBACK, ctypes.c_void_p, _ptr(GenerateResult))
session_save = _proto("tandem_session_save", _status, _handle, ctypes.c_char_p)
session_restore = _proto("tandem_session_restore", _status, _handle, ctypes.c_char_p)
executor_params_init = _proto("tandem_executor_params_init", _status, _ptr(ExecutorParams), _size)
scheduler_params_init = _proto("tandem_scheduler_params_init", _status, _ptr(SchedulerParams), _size)
request_params_init = _proto("tandem_request_params_init", _status, _ptr(RequestParams), _size)
request_event_init = _proto("tandem_request_event_init", _status, _ptr(RequestEvent), _size)
request_result_init = _proto("tandem_request_result_init", _status, _ptr(RequestResult), _size)
scheduler_create = _proto("tandem_scheduler_create", _status, _handle, _ptr(SchedulerParams), _ptr(_handle))
scheduler_free = _proto("tandem_scheduler_free", _status, _handle)
scheduler_submit = _proto("tandem_scheduler_submit", _status, _handle, _ptr(RequestParams), _ptr(_handle))
scheduler_submit_n = _proto("tandem_scheduler_submit_n", _status, _handle, _ptr(RequestParams), ctypes.c_uint32,
                            _ptr(_handle))
scheduler_drain = _proto("tandem_scheduler_drain", _status, _handle)
scheduler_shutdown = _proto("tandem_scheduler_shutdown", _status, _handle)
scheduler_metrics_json = _proto("tandem_scheduler_metrics_json", _status, _handle, ctypes.c_char_p, _size,
                                _ptr(_size))
scheduler_session_open = _proto("tandem_scheduler_session_open", _status, _handle, _ptr(ctypes.c_uint64))
scheduler_session_close = _proto("tandem_scheduler_session_close", _status, _handle, ctypes.c_uint64)
scheduler_session_info_init = _proto("tandem_scheduler_session_info_init", _status, _ptr(SchedulerSessionInfo), _size)
scheduler_session_get_info = _proto("tandem_scheduler_session_get_info", _status, _handle, ctypes.c_uint64,
                                    _ptr(SchedulerSessionInfo))
scheduler_session_park = _proto("tandem_scheduler_session_park", _status, _handle, ctypes.c_uint64)
scheduler_session_unpark = _proto("tandem_scheduler_session_unpark", _status, _handle, ctypes.c_uint64)
scheduler_session_save = _proto("tandem_scheduler_session_save", _status, _handle, ctypes.c_uint64, ctypes.c_char_p)
scheduler_session_restore = _proto("tandem_scheduler_session_restore", _status, _handle, ctypes.c_char_p,
                                   ctypes.c_int32, _ptr(ctypes.c_uint64))
pool_create = _proto("tandem_pool_create", _status, ctypes.c_int32, _ptr(_handle))
pool_free = _proto("tandem_pool_free", _status, _handle)
pool_get_threads = _proto("tandem_pool_get_threads", _status, _handle, _ptr(ctypes.c_int32))
request_poll = _proto("tandem_request_poll", _status, _handle, _ptr(RequestEvent))
request_next_event = _proto("tandem_request_next_event", _status, _handle, ctypes.c_int32, _ptr(RequestEvent))
request_cancel = _proto("tandem_request_cancel", _status, _handle)
request_wait = _proto("tandem_request_wait", _status, _handle, ctypes.c_int32, _ptr(RequestResult))
request_get_result = _proto("tandem_request_get_result", _status, _handle, _ptr(RequestResult))
request_free = _proto("tandem_request_free", _status, _handle)


class TandemError(Exception):
    """A tandem_* call failed, or an argument was refused before the call.

    Attributes: ``status`` (the tandem_status number, e.g. 1), ``name`` (its stable name,
    "INVALID_ARG"), ``message`` (the library's message naming the argument, key or byte
    at fault)."""

    def __init__(self, status: int, message: str):
        self.status = status
        self.name = status_name(status).decode()
        self.message = message
        super().__init__(f"{self.name} ({status}): {message}")


def check(status: int) -> None:
    """Raise TandemError for a status other than OK (with this thread's last error)."""
    if status != OK:
        raise TandemError(status, last_error().decode("utf-8", "replace"))


def init(struct_type, init_fn):
    """A struct filled by its *_init function (struct_size and the defaults)."""
    s = struct_type()
    check(init_fn(ctypes.byref(s), ctypes.sizeof(s)))
    return s


# ---- argument checks: Python ints are unbounded, ctypes would wrap them silently ------------

def check_int(name: str, value, lo: int, hi: int) -> int:
    """`value` as an int in [lo, hi]; TandemError(E_INVALID_ARG) naming `name` otherwise.
    bool is refused (True is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TandemError(E_INVALID_ARG, f"{name} must be an integer, not {type(value).__name__} ({value!r})")
    if not lo <= value <= hi:
        raise TandemError(E_INVALID_ARG, f"{name} = {value} is outside [{lo}, {hi}]")
    return value


def check_float(name: str, value) -> float:
    """`value` as a float (int or float, not bool); the library checks its range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TandemError(E_INVALID_ARG, f"{name} must be a number, not {type(value).__name__} ({value!r})")
    return float(value)


def text_bytes(name: str, value, allow_nul: bool = False) -> bytes:
    """UTF-8 bytes of a str, or the bytes given; anything else (an int, None) is refused."""
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    else:
        raise TandemError(E_INVALID_ARG, f"{name} must be str or bytes, not {type(value).__name__}")
    if not allow_nul and b"\0" in data:
        raise TandemError(E_INVALID_ARG, f"{name} contains a NUL byte")
    return data


def ids_array(ids, name: str = "token id"):
    """(int32 array, count) of a sequence of token ids, each checked to be an int32 >= 0."""
    ids = list(ids)
    for i in ids:
        check_int(name, i, 0, INT32_MAX)
    arr = (ctypes.c_int32 * max(len(ids), 1))(*ids)
    return arr, len(ids)


def stop_list(stop) -> List[bytes]:
    """Stop strings: one str (a single stop string, as OpenAI's `stop`) or a list of them."""
    if stop is None:
        return []
    if isinstance(stop, (str, bytes)):
        stop = [stop]
    out = []
    for s in stop:
        data = text_bytes("a stop string", s)
        if not data:
            raise TandemError(E_INVALID_ARG, "a stop string is empty")
        out.append(data)
    return out


def read_text(call, initial: int = 256) -> bytes:
    """Run a size-query style call(buf, cap, out_len_ptr) and return the bytes."""
    n = _size()
    check(call(None, 0, ctypes.byref(n)))
    buf = ctypes.create_string_buffer(n.value + 1)
    check(call(buf, n.value + 1, ctypes.byref(n)))
    return buf.raw[: n.value]


def optional_text(value: Optional[str]) -> Optional[bytes]:
    return None if value is None else text_bytes("a text argument", value)
