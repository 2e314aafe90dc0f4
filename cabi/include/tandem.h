/*
 * tandem.h -- the C ABI of Tandem (C99; no C++ in this header).
 *
 * One header, one library: libtandem.so (exports only tandem_* symbols) or libtandem.a.
 * Find it with `pkg-config tandem` or CMake `find_package(Tandem)` (targets
 * Tandem::tandem and Tandem::tandem_static).
 *
 * Conventions (they hold for every function below unless its comment says otherwise)
 * -----------------------------------------------------------------------------------
 * Status.    Every function returns a tandem_status: TANDEM_OK (0) or a TANDEM_E_* code.
 *            The exceptions are tandem_version(), tandem_last_error() and
 *            tandem_status_name(), which cannot fail. No C++ exception ever crosses this
 *            boundary: the library turns each one into a status.
 * Messages.  After a call that failed, tandem_last_error() returns a message naming the
 *            argument, key, tensor or byte offset at fault. The message is per thread.
 * Handles.   tandem_model, tandem_session, tandem_scheduler, tandem_request,
 *            tandem_executor and tandem_pool are opaque handles. The library keeps a
 *            registry of live handles and checks every handle it is given: NULL gives
 *            TANDEM_E_INVALID_ARG; a handle that was freed already, that was never
 *            returned by the library, or that names the wrong kind of object gives
 *            TANDEM_E_INVALID_HANDLE. Nothing is dereferenced before that check (handle
 *            values are registry keys >= 1 MiB, not addresses: never dereference one).
 * Ownership. Every *_create / *_load has a *_free. *_free(NULL) is a no-op returning
 *            TANDEM_OK; a second free of the same handle returns TANDEM_E_INVALID_HANDLE
 *            (handle values are never reused within a process). Objects are reference
 *            counted inside: a session keeps its model alive, so the model handle may be
 *            freed before its sessions.
 * Outputs.   Out-parameters for handles are set to NULL when a create fails. Other outputs
 *            are left unchanged on failure unless stated.
 * Structs.   Every struct begins with `size_t struct_size`, the caller's sizeof of the
 *            struct. Fill one with its *_init(&s, sizeof s) function (sets struct_size and
 *            the defaults) before changing fields. The library accepts a struct_size from
 *            the size of version 0.1 of the struct (smaller: TANDEM_E_INVALID_ARG) up to
 *            any larger size as long as the bytes it does not know are zero (a caller
 *            built against a newer header that sets a field this library does not have
 *            gets TANDEM_E_INVALID_ARG, never silent ignoring). Output structs are written
 *            only up to struct_size.
 * Strings.   Text passed in is UTF-8 and is validated: invalid UTF-8 gives
 *            TANDEM_E_INVALID_ARG. Variable-length results (token ids, detokenized text,
 *            token pieces, logits) go into CALLER-PROVIDED BUFFERS with a size query, as
 *            llama.h does: pass buf = NULL and capacity = 0 to learn the size (returns
 *            TANDEM_OK with the size in the out-count); a buffer that is too small gives
 *            TANDEM_E_BUFFER_TOO_SMALL with the needed size in the out-count and nothing
 *            written. Text buffers are always NUL-terminated, so they need size + 1
 *            bytes. The only strings the library owns are constants with a stated
 *            lifetime (tandem_version, tandem_status_name, tandem_last_error, the name
 *            and arch in tandem_model_info); there is nothing for the caller to free.
 * Threads.   Each function states its thread-safety. In short: models are immutable and
 *            may be used from any number of threads at once; a session serves one call
 *            at a time and refuses a concurrent call with TANDEM_E_BUSY (it never
 *            blocks and never corrupts state); schedulers and requests may be used from
 *            any number of threads at once; *_free may be called from any thread;
 *            the *_init functions only write the struct they are given.
 * Callbacks. A callback must return normally (no longjmp out of it); a C++ callback
 *            that throws ends the call with TANDEM_E_INTERNAL (the exception stops at the
 *            boundary). It may call any tandem function; calls on the session that is
 *            generating return TANDEM_E_BUSY, except tandem_session_free, which takes
 *            effect when the generation returns.
 *
 * Scheduler. tandem_scheduler runs many requests on one or more executors with
 *            continuous batching (include/tandem/sched/scheduler.hpp). tandem_request is a
 *            submitted request: poll it for streamed tokens, wait for it, cancel it, read its
 *            result, free it. Freeing the scheduler (or shutting it down) while requests
 *            are outstanding cancels them: their handles stay valid and report a terminal
 *            state (TANDEM_FINISH_CANCELLED, or the finish they reached before) until
 *            tandem_request_free. Freeing a request handle that has not finished cancels
 *            the request.
 */
#ifndef TANDEM_H
#define TANDEM_H

#include <stddef.h>
#include <stdint.h>

/* ---- version ------------------------------------------------------------------------ */

#define TANDEM_VERSION_MAJOR 0
#define TANDEM_VERSION_MINOR 1
#define TANDEM_VERSION_PATCH 0
#define TANDEM_VERSION_STRING "0.1.0"
/* (major * 10000 + minor * 100 + patch), for #if comparisons. */
#define TANDEM_VERSION_NUMBER (TANDEM_VERSION_MAJOR * 10000 + TANDEM_VERSION_MINOR * 100 + TANDEM_VERSION_PATCH)
/* The shared library's soname is libtandem.so.<TANDEM_ABI_VERSION>. */
#define TANDEM_ABI_VERSION 0

#if defined(_WIN32)
#if defined(TANDEM_BUILDING_LIBRARY)
#define TANDEM_API __declspec(dllexport)
#elif defined(TANDEM_SHARED_LIBRARY)
#define TANDEM_API __declspec(dllimport)
#else
#define TANDEM_API
#endif
#elif defined(__GNUC__) || defined(__clang__)
#define TANDEM_API __attribute__((visibility("default")))
#else
#define TANDEM_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status codes ------------------------------------------------------------------- */

/* A status: TANDEM_OK or one of the TANDEM_E_* values below. Values 0..99 are the numbers
 * of tandem::ErrorCode in the C++ library (include/tandem/core/error.hpp), passed through
 * unchanged (a code the C++ library gains before this header names it still arrives with
 * its number, and tandem_status_name knows it); 100 and up exist only at the C boundary.
 * Numbers never change meaning; new codes may be added. */
typedef int32_t tandem_status;

enum tandem_status_code {
  TANDEM_OK = 0,
  TANDEM_E_INVALID_ARG = 1,             /* an argument is NULL, out of range or malformed */
  TANDEM_E_IO = 2,                      /* open/read/mmap failed (errno text in the message) */
  TANDEM_E_OUT_OF_MEMORY = 3,           /* an allocation or capacity limit was exceeded */
  TANDEM_E_GGUF_BAD_MAGIC = 10,         /* the file does not start with "GGUF" */
  TANDEM_E_GGUF_BAD_VERSION = 11,       /* GGUF version other than 2 or 3 */
  TANDEM_E_GGUF_TRUNCATED = 12,         /* a field or tensor runs past the end of the file */
  TANDEM_E_GGUF_BAD_LENGTH = 13,        /* a length or count cannot fit in the file */
  TANDEM_E_GGUF_BAD_ALIGNMENT = 14,     /* general.alignment invalid, or a misaligned tensor */
  TANDEM_E_GGUF_DUPLICATE_KEY = 15,     /* the same metadata key twice */
  TANDEM_E_GGUF_DUPLICATE_TENSOR = 16,  /* the same tensor name twice */
  TANDEM_E_GGUF_BAD_TYPE = 17,          /* unknown value/tensor type, or a key of the wrong type */
  TANDEM_E_GGUF_BAD_TENSOR = 18,        /* bad tensor dimensions */
  TANDEM_E_TENSOR_NON_FINITE = 19,      /* a quantisation block scale is Inf or NaN */
  TANDEM_E_MODEL_UNSUPPORTED_ARCH = 30, /* general.architecture is not llama/qwen2/qwen3 */
  TANDEM_E_MODEL_MISSING_TENSOR = 31,   /* a required tensor is absent */
  TANDEM_E_MODEL_BAD_HPARAMS = 32,      /* a hyper-parameter is missing or inconsistent */
  TANDEM_E_MODEL_BAD_TENSOR_SHAPE = 33, /* a tensor's shape/type does not fit the model */
  TANDEM_E_TOKENIZER = 40,              /* tokenizer metadata missing or inconsistent */
  TANDEM_E_CONTEXT_OVERFLOW = 50,       /* more tokens than the session's context holds */
  TANDEM_E_BAD_POSITION = 51,           /* a KV position that is out of range */
  TANDEM_E_KV_MISMATCH = 60,            /* a KV hand-off for another model/tokenizer/layout */
  TANDEM_E_KV_CHECKSUM = 61,            /* a KV page's bytes do not match its checksum */
  TANDEM_E_KV_LEASE_EXPIRED = 62,       /* a KV hand-off's lease expired before import */
  TANDEM_E_KV_TOKEN_RANGE = 63,         /* a KV hand-off's tokens do not fit the receiver */
  TANDEM_E_SESSION_CORRUPT = 70,        /* a session file is truncated, damaged or malformed */
  TANDEM_E_SESSION_MODEL_MISMATCH = 71, /* a session file saved with another model/tokenizer */
  TANDEM_E_SESSION_VERSION = 72,        /* a session file format this library cannot read */
  TANDEM_E_INTERNAL = 99,               /* a bug in Tandem (or a callback threw a C++ exception) */
  TANDEM_E_INVALID_HANDLE = 100,        /* a freed, unknown or wrong-kind handle */
  TANDEM_E_BUSY = 101,                  /* the session is in use by another call */
  TANDEM_E_BUFFER_TOO_SMALL = 102,      /* a caller buffer is too small (size in the out-count) */
  TANDEM_E_UNSUPPORTED = 103            /* not available in this build (e.g. a GPU executor in a
                                           library built without CUDA) */
};

/* ---- library-wide functions --------------------------------------------------------- */

/* "MAJOR.MINOR.PATCH" of the library actually loaded (compare with TANDEM_VERSION_STRING
 * to detect a header/library mismatch). Static storage. Thread-safe. */
TANDEM_API const char* tandem_version(void);

/* The message of the most recent failed call on the calling thread; "" if none failed
 * yet. Never NULL. Valid until the next tandem call on this thread. Successful calls do
 * not clear it. Thread-safe (each thread has its own message). */
TANDEM_API const char* tandem_last_error(void);

/* Stable name of a status without its prefix ("OK", "INVALID_ARG", "BUSY", ...;
 * "UNKNOWN" for a number that is not a code). Static storage. Thread-safe. */
TANDEM_API const char* tandem_status_name(tandem_status status);

/* ---- handles ------------------------------------------------------------------------ */

typedef struct tandem_model tandem_model;         /* an immutable loaded GGUF model */
typedef struct tandem_session tandem_session;     /* one conversation: tokens, KV cache, executor */
typedef struct tandem_scheduler tandem_scheduler; /* the multi-executor scheduler */
typedef struct tandem_request tandem_request;     /* a request submitted to a scheduler */
typedef struct tandem_executor tandem_executor;   /* a CPU or GPU executor (tandem_executor_create) */
typedef struct tandem_pool tandem_pool;           /* a shared CPU thread pool (tandem_pool_create) */

/* ---- model -------------------------------------------------------------------------- */

typedef struct tandem_model_params {
  size_t struct_size;
  int32_t check_block_scales; /* nonzero: refuse Q4_0/Q8_0 blocks with Inf/NaN scales at load
                                 (reads every block scale once). Default 1. */
  uint32_t max_alignment;     /* largest accepted general.alignment, a power of two.
                                 Default 1 MiB. */
  /* ---- later fields (a struct_size without them is still accepted) ---- */
  const char* chat_template; /* NULL (default): the model's own tokenizer.chat_template. Else
                                the template used instead by the chat functions below (as
                                tandem-server --chat-template): a built-in name ("chatml",
                                "llama3", ...) or Jinja source (UTF-8, at most 1 MiB), copied
                                and parsed at load: one that does not parse is
                                TANDEM_E_INVALID_ARG "chat_template: jinja: line N: ...". */
} tandem_model_params;

/* Set params->struct_size = struct_size and every field to its default.
 * TANDEM_E_INVALID_ARG: params NULL, struct_size smaller than version 0.1 of the struct.
 * Thread-safe. */
TANDEM_API tandem_status tandem_model_params_init(tandem_model_params* params, size_t struct_size);

/* Load, validate and memory-map a GGUF model. params may be NULL (defaults).
 * On success *out_model is a new handle (free with tandem_model_free); on failure it is
 * set to NULL. Errors: TANDEM_E_INVALID_ARG (path or out_model NULL, bad params),
 * TANDEM_E_IO, the TANDEM_E_GGUF_* / TANDEM_E_TENSOR_NON_FINITE codes for a malformed
 * file, TANDEM_E_MODEL_* , TANDEM_E_TOKENIZER, TANDEM_E_OUT_OF_MEMORY.
 * Thread-safe (any number of loads at once). */
TANDEM_API tandem_status tandem_model_load(const char* path, const tandem_model_params* params,
                                           tandem_model** out_model);

/* Release the handle. The weights stay mapped while sessions created from it exist.
 * NULL: no-op, TANDEM_OK. Already freed / unknown: TANDEM_E_INVALID_HANDLE.
 * Thread-safe, also while other threads use the model (their calls finish normally). */
TANDEM_API tandem_status tandem_model_free(tandem_model* model);

typedef struct tandem_model_info {
  size_t struct_size;
  const char* arch;    /* "llama", "qwen2" or "qwen3"; static storage */
  const char* name;    /* general.name, or the file name without extension; owned by the
                          model, valid until tandem_model_free of this handle */
  int32_t n_vocab;     /* vocabulary size */
  int32_t n_ctx_train; /* context length the model was trained with */
  int32_t n_embd;
  int32_t n_layer;
  int32_t n_head;
  int32_t n_head_kv;
  int32_t token_bos;     /* -1 if none */
  int32_t token_eos;     /* -1 if none */
  uint64_t weight_bytes; /* bytes of all tensor data */
} tandem_model_info;

/* Set info->struct_size = struct_size and zero the rest. Errors as the other *_init.
 * Thread-safe. */
TANDEM_API tandem_status tandem_model_info_init(tandem_model_info* info, size_t struct_size);

/* Fill *info (up to info->struct_size). Cheap. Thread-safe. */
TANDEM_API tandem_status tandem_model_get_info(const tandem_model* model, tandem_model_info* info);

/* The model's identity hash: xxHash3-64 of the hyper-parameters and of every tensor's
 * name, shape, type and data (not the file name). Equal hashes = same weights. The first
 * call reads every weight once (seconds for a large model); later calls are cached.
 * Thread-safe. */
TANDEM_API tandem_status tandem_model_identity_hash(const tandem_model* model, uint64_t* out_hash);

/* ---- tokenizer ---------------------------------------------------------------------- */

#define TANDEM_TOKENIZE_ADD_SPECIAL 1u   /* add BOS (and EOS) as the vocabulary asks */
#define TANDEM_TOKENIZE_PARSE_SPECIAL 2u /* text of control tokens ("<s>") becomes that token */

/* Tokenize text_len bytes of UTF-8 (llama_tokenize semantics). text may be NULL only when
 * text_len is 0. flags: TANDEM_TOKENIZE_* (unknown bits: TANDEM_E_INVALID_ARG).
 * *out_n_tokens receives the number of ids; they are written to tokens[0..n) when
 * capacity >= n. tokens NULL with capacity 0 is a size query (TANDEM_OK).
 * Errors: TANDEM_E_INVALID_ARG (NULL model/out_n_tokens, invalid UTF-8, tokens NULL with
 * capacity > 0), TANDEM_E_BUFFER_TOO_SMALL. Thread-safe. */
TANDEM_API tandem_status tandem_tokenize(const tandem_model* model, const char* text, size_t text_len, uint32_t flags,
                                         int32_t* tokens, size_t capacity, size_t* out_n_tokens);

#define TANDEM_DETOKENIZE_REMOVE_SPECIAL 1u  /* drop a leading BOS / trailing EOS the vocabulary adds */
#define TANDEM_DETOKENIZE_UNPARSE_SPECIAL 2u /* write control tokens as their text */

/* Text of n_tokens ids (llama_detokenize semantics). The bytes may be invalid UTF-8 (for
 * example half a character when the ids end inside one). *out_len receives the length in
 * bytes without the NUL; buf gets the text and a NUL when capacity >= *out_len + 1.
 * buf NULL with capacity 0 is a size query. tokens may be NULL only when n_tokens is 0.
 * Errors: TANDEM_E_INVALID_ARG (NULL arguments, an id outside [0, n_vocab), unknown flag
 * bits), TANDEM_E_BUFFER_TOO_SMALL. Thread-safe. */
TANDEM_API tandem_status tandem_detokenize(const tandem_model* model, const int32_t* tokens, size_t n_tokens,
                                           uint32_t flags, char* buf, size_t capacity, size_t* out_len);

/* Raw bytes of one token (llama_token_to_piece): control tokens give "" unless flags has
 * TANDEM_DETOKENIZE_UNPARSE_SPECIAL. Buffer rules and errors as tandem_detokenize.
 * Thread-safe. */
TANDEM_API tandem_status tandem_token_to_piece(const tandem_model* model, int32_t token, uint32_t flags, char* buf,
                                               size_t capacity, size_t* out_len);

/* ---- session ------------------------------------------------------------------------ */

/* KV cache options (include/tandem/kv/kv_store.hpp): the tier pages live in, the element type. */
enum tandem_kv_tier { TANDEM_KV_DEVICE = 0, TANDEM_KV_HOST = 1, TANDEM_KV_FILE = 2 };
/* TANDEM_KV_Q8_0: ggml's Q8_0 blocks (34 bytes per 32 elements, about half of f16;
 * llama.cpp's --cache-type-k/-v q8_0); CPU executors only (TANDEM_E_UNSUPPORTED for a CUDA
 * executor), and n_head_kv x head_dim must be a multiple of 32 (else TANDEM_E_INVALID_ARG). */
enum tandem_kv_dtype { TANDEM_KV_F32 = 0, TANDEM_KV_F16 = 1, TANDEM_KV_Q8_0 = 2 };

typedef struct tandem_session_params {
  size_t struct_size;
  int32_t n_ctx;     /* context positions; 0 = the model's n_ctx_train capped at 4096 */
  int32_t n_batch;   /* prompt tokens per executor step (chunked prefill), >= 1; default 512 */
  int32_t page_size; /* KV page size in tokens, >= 1; default 16 */
  int32_t n_threads; /* CPU threads of the session's executor, 0..512. 0 (default) = the
                        process-wide node pool: one thread per physical core, shared by every
                        session and executor created with n_threads 0 and no pool (their
                        steps take turns on it, so together they never run more compute
                        threads than cores). n > 0: a pool of n threads of its own */
  /* ---- later fields (a struct_size without them is still accepted) ---- */
  int32_t kv_tier;    /* TANDEM_KV_HOST (default) or TANDEM_KV_FILE (pages in a memory-mapped
                         file in kv_dir, removed when the session is freed) */
  int32_t kv_dtype;   /* a tandem_kv_dtype; default TANDEM_KV_F16 */
  const char* kv_dir; /* directory of the File tier (NULL = the system temporary directory) */
  tandem_pool* pool;  /* NULL (default), or a pool from tandem_pool_create the session's
                         executor computes on (shared with the other users of the pool; the
                         session keeps it alive). With a pool, n_threads must be 0 */
} tandem_session_params;

/* Defaults: n_ctx 0, n_batch 512, page_size 16, n_threads 0, kv_tier TANDEM_KV_HOST,
 * kv_dtype TANDEM_KV_F16, kv_dir NULL, pool NULL. Thread-safe. */
TANDEM_API tandem_status tandem_session_params_init(tandem_session_params* params, size_t struct_size);

/* Create a session on `model` with its own CPU executor (CpuQ4Executor on the threads
 * that n_threads / pool select) and a KV cache of n_ctx positions, allocated now. params
 * may be NULL. On failure *out_session is set to NULL. Errors: TANDEM_E_INVALID_ARG (NULL
 * model or out_session, a parameter out of range, n_ctx too large for a page count, both
 * pool and n_threads set), TANDEM_E_INVALID_HANDLE (also a freed pool),
 * TANDEM_E_OUT_OF_MEMORY (the KV cache would not fit in physical memory, or allocation
 * failed). Thread-safe (the model may serve many sessions). */
TANDEM_API tandem_status tandem_session_create(const tandem_model* model, const tandem_session_params* params,
                                               tandem_session** out_session);

/* Release the session (KV cache, executor threads). NULL: no-op. Already freed:
 * TANDEM_E_INVALID_HANDLE. May be called from any thread, also while another thread (or
 * a callback) is inside a call on this session: the handle is invalid at once and the
 * session is destroyed when that call returns. */
TANDEM_API tandem_status tandem_session_free(tandem_session* session);

typedef struct tandem_session_info {
  size_t struct_size;
  int32_t n_ctx;    /* context positions */
  int32_t n_tokens; /* tokens whose KV is in the cache */
  int32_t n_batch;
  int32_t page_size;
  int32_t n_threads;  /* threads of the session's executor (resolved, >= 1) */
  int32_t has_logits; /* nonzero when logits of the last evaluated token are available */
} tandem_session_info;

TANDEM_API tandem_status tandem_session_info_init(tandem_session_info* info, size_t struct_size);

/* Fill *info. Session calls: one at a time per session; a concurrent call on the same
 * session returns TANDEM_E_BUSY (this applies to every tandem_session_* function below). */
TANDEM_API tandem_status tandem_session_get_info(const tandem_session* session, tandem_session_info* info);

/* Forget the conversation (KV pages returned). TANDEM_E_BUSY as above. */
TANDEM_API tandem_status tandem_session_reset(tandem_session* session);

/* Evaluate n_tokens ids appended to the conversation (a pending sampled token, if any, is
 * evaluated first). When logits is not NULL it receives [n_tokens, n_vocab] floats, row i
 * = logits after tokens[i]; capacity is in floats. n_tokens 0 evaluates only the pending
 * token. On any error nothing is evaluated and the session is unchanged.
 * Errors: TANDEM_E_INVALID_ARG (NULL session, tokens NULL with n_tokens > 0, an id
 * outside the vocabulary, logits NULL with capacity > 0), TANDEM_E_BUFFER_TOO_SMALL
 * (capacity < n_tokens * n_vocab), TANDEM_E_CONTEXT_OVERFLOW, TANDEM_E_BUSY. */
TANDEM_API tandem_status tandem_session_eval(tandem_session* session, const int32_t* tokens, size_t n_tokens,
                                             float* logits, size_t capacity);

/* Copy the logits after the last evaluated token ([n_vocab] floats; 0 floats before the
 * first evaluation). Size query and TANDEM_E_BUFFER_TOO_SMALL as for tokenize. */
TANDEM_API tandem_status tandem_session_get_logits(const tandem_session* session, float* logits, size_t capacity,
                                                   size_t* out_n);

/* Copy the ids whose KV is in the cache, in order. Size query as for tokenize. */
TANDEM_API tandem_status tandem_session_get_tokens(const tandem_session* session, int32_t* tokens, size_t capacity,
                                                   size_t* out_n);

/* Save the conversation (tokens, the pending sampled token, the last logits, the random
 * engine's state and the KV cache) to `path` atomically: a temporary file beside it is
 * written, synced and renamed over `path`. The path is passed to the OS as bytes (not
 * checked as UTF-8). Errors: TANDEM_E_INVALID_ARG (NULL session or path, empty path),
 * TANDEM_E_INVALID_HANDLE, TANDEM_E_IO, TANDEM_E_BUSY. */
TANDEM_API tandem_status tandem_session_save(const tandem_session* session, const char* path);

/* Replace the session's conversation with the one saved in `path` (by
 * tandem_session_save, with the same model weights and tokenizer; the executor's thread
 * count, n_batch and the KV page size may differ). On ANY failure the session is left
 * exactly as it was. Errors: TANDEM_E_INVALID_ARG (NULL session or path, empty path),
 * TANDEM_E_INVALID_HANDLE, TANDEM_E_IO (cannot read it), TANDEM_E_SESSION_CORRUPT (not a
 * session file, truncated, any damaged byte), TANDEM_E_SESSION_VERSION (a newer format),
 * TANDEM_E_SESSION_MODEL_MISMATCH (saved with other weights, hyper-parameters or
 * tokenizer), TANDEM_E_CONTEXT_OVERFLOW (more positions than this session's n_ctx),
 * TANDEM_E_OUT_OF_MEMORY, TANDEM_E_BUSY. */
TANDEM_API tandem_status tandem_session_restore(tandem_session* session, const char* path);

/* ---- sampling and generation -------------------------------------------------------- */

/* The chain follows llama.cpp's common sampler: penalties -> top-k -> top-p -> min-p ->
 * temperature -> draw (see include/tandem/session/sampler.hpp for the formulas). */
typedef struct tandem_sampling_params {
  size_t struct_size;
  float temperature;       /* 0 = greedy (lowest id on ties); >= 0; default 0.8 */
  int32_t top_k;           /* 0 = off; default 40 */
  float top_p;             /* [0, 1]; 1 = off; default 0.95 */
  float min_p;             /* [0, 1]; 0 = off; default 0.05 */
  float repeat_penalty;    /* > 0; 1 = off (default) */
  int32_t repeat_last_n;   /* >= 0; tokens of history the penalties see; default 64 */
  float frequency_penalty; /* finite; default 0 */
  float presence_penalty;  /* finite; default 0 */
  uint64_t seed;           /* same seed + same logits -> same tokens; default: the C++
                              library's SamplingParams default */
} tandem_sampling_params;

TANDEM_API tandem_status tandem_sampling_params_init(tandem_sampling_params* params, size_t struct_size);

typedef struct tandem_generate_params {
  size_t struct_size;
  const tandem_sampling_params* sampling; /* NULL = tandem_sampling_params_init defaults */
  const char* const* stop;                /* n_stop NUL-terminated, non-empty UTF-8 stop strings */
  size_t n_stop;
  int32_t max_tokens; /* >= 0; default 128 */
  uint32_t flags;     /* TANDEM_GENERATE_* bits; default 0; unknown bits: TANDEM_E_INVALID_ARG */
  /* ---- later fields (a struct_size without them is still accepted) ---- */
  int32_t logprobs; /* -1 (default): none; 0 .. TANDEM_MAX_TOP_LOGPROBS: each generated
                       token's log-probability and this many most likely alternatives
                       (OpenAI's logprobs / top_logprobs), into tandem_generate_result.logprobs */
  int32_t reserved; /* 0 */
  /* ---- structured outputs (a struct_size without them is still accepted) ---- */
  const char* grammar;  /* the schema or grammar text (NUL-terminated UTF-8) for grammar_type;
                           NULL for TANDEM_GRAMMAR_NONE and TANDEM_GRAMMAR_JSON_OBJECT */
  int32_t grammar_type; /* a tandem_grammar_type; default TANDEM_GRAMMAR_NONE */
  int32_t reserved2;    /* 0 */
} tandem_generate_params;

/* Structured outputs (include/tandem/grammar/grammar.hpp): every sampled token is one the grammar
 * allows, and generation ends at end-of-generation only where the grammar is complete
 * (max_tokens can still cut it); a grammar that completes ends the output there even with
 * TANDEM_GENERATE_IGNORE_EOS. Compiled with xgrammar for the model's vocabulary and
 * cached by text, so repeating a schema is cheap. A schema or grammar that does not
 * compile, a text for NONE / JSON_OBJECT or none for the others, or a library built
 * without xgrammar: TANDEM_E_INVALID_ARG with the reason in tandem_last_error. */
enum tandem_grammar_type {
  TANDEM_GRAMMAR_NONE = 0,        /* unconstrained */
  TANDEM_GRAMMAR_JSON_SCHEMA = 1, /* grammar: a JSON schema (OpenAI response_format json_schema;
                                     strict: only the properties it names) */
  TANDEM_GRAMMAR_JSON_OBJECT = 2, /* any JSON object (response_format json_object); grammar NULL */
  TANDEM_GRAMMAR_GBNF = 3         /* grammar: GBNF text with a `root` rule (llama.cpp's format) */
};

/* Most alternatives a tandem_token_logprob carries (OpenAI's top_logprobs limit). */
#define TANDEM_MAX_TOP_LOGPROBS 20

/* A generated token's log-probability and the most likely tokens of the same step: a
 * float64 log-softmax of the step's logits before any sampling transform (temperature,
 * penalties, top-k/p, min-p), i.e. the model's own distribution, rounded to float. A fixed
 * layout (no struct_size: it never grows), used in arrays. */
typedef struct tandem_token_logprob {
  int32_t token;                               /* the generated id */
  float logprob;                               /* its log-probability (<= 0; -INFINITY possible) */
  int32_t n_top;                               /* entries of top_tokens / top_logprobs in use */
  int32_t top_tokens[TANDEM_MAX_TOP_LOGPROBS]; /* most likely first (ties: lower id first) */
  float top_logprobs[TANDEM_MAX_TOP_LOGPROBS];
} tandem_token_logprob;

#define TANDEM_GENERATE_IGNORE_EOS 1u    /* do not stop at end-of-generation tokens */
#define TANDEM_GENERATE_PARSE_SPECIAL 2u /* control-token text in a text prompt becomes the token */

TANDEM_API tandem_status tandem_generate_params_init(tandem_generate_params* params, size_t struct_size);

enum tandem_finish_reason {
  TANDEM_FINISH_STOP = 0,        /* an end-of-generation token was sampled (not included) */
  TANDEM_FINISH_STOP_STRING = 1, /* a stop string appeared (the text is cut before it) */
  TANDEM_FINISH_LENGTH = 2,      /* max_tokens generated, or the context is full */
  TANDEM_FINISH_CANCELLED = 3,   /* the callback returned nonzero / tandem_request_cancel */
  TANDEM_FINISH_TIMEOUT = 4,     /* scheduler only: the request's deadline passed */
  TANDEM_FINISH_OVERLOADED = 5,  /* scheduler only: refused, the queue is full or draining */
  TANDEM_FINISH_ERROR = 6        /* scheduler only: an invalid request or an executor error
                                    (the status and message are in tandem_request_result) */
};

/* Generation result. The buffer fields (tokens, text, logprobs and their capacities) are
 * INPUTS (optional; init sets them to NULL/0); the rest are outputs. */
typedef struct tandem_generate_result {
  size_t struct_size;
  int32_t* tokens;         /* in: buffer for the generated ids, or NULL */
  size_t tokens_cap;       /* in: its capacity in ids */
  char* text;              /* in: buffer for the generated text, or NULL */
  size_t text_cap;         /* in: its capacity in bytes (NUL included) */
  size_t n_tokens;         /* out: ids generated (min(n_tokens, tokens_cap) of them written) */
  size_t text_len;         /* out: full text length in bytes; the buffer gets as much as fits,
                              cut at a UTF-8 character boundary, NUL-terminated */
  int32_t finish_reason;   /* out: a tandem_finish_reason */
  int32_t n_prompt;        /* out: tokens evaluated for the prompt (pending token included) */
  double prompt_seconds;   /* out: wall time of the prompt evaluation */
  double generate_seconds; /* out: wall time from the first sampled token to the end */
  /* ---- later fields (a struct_size without them is still accepted) ---- */
  tandem_token_logprob* logprobs; /* in: buffer for one entry per generated id (with
                                     params->logprobs >= 0), or NULL */
  size_t logprobs_cap;            /* in: its capacity in entries */
  size_t n_logprobs;              /* out: entries (n_tokens with params->logprobs >= 0, else 0);
                                     min(n_logprobs, logprobs_cap) of them written */
} tandem_generate_result;

TANDEM_API tandem_status tandem_generate_result_init(tandem_generate_result* result, size_t struct_size);

/* Called with each piece of generated text as it becomes final: valid UTF-8, `len`
 * bytes, NUL-terminated for convenience, valid only during the call. Text is held back
 * while it may still become a stop string or an incomplete UTF-8 character, so a token
 * may produce no call and a call may carry the text of several tokens; `token` is the id
 * that completed the piece (-1 for a final flush with no token). The concatenation of all
 * pieces is the generated text. Return 0 to continue, nonzero to stop (finish reason
 * TANDEM_FINISH_CANCELLED; the call still returns TANDEM_OK) -- the opposite sense of the
 * C++ GenerateOptions::on_text (include/tandem/session/session.hpp), whose true means continue. */
typedef int (*tandem_token_callback)(const char* piece, size_t len, int32_t token, void* user_data);

/* Tokenize prompt_utf8 (NUL-terminated; BOS added when the session is empty and the
 * vocabulary asks for it), evaluate it, then sample up to max_tokens tokens, streaming
 * text to `callback` (may be NULL) with `user_data` passed through untouched. An empty
 * prompt continues from the current state; on an empty session it starts from BOS alone
 * (vocabularies that add no BOS: TANDEM_E_INVALID_ARG). params and result may be NULL
 * (defaults / not wanted).
 * Errors: TANDEM_E_INVALID_ARG (NULL session or prompt, invalid UTF-8 in the prompt or a
 * stop string, bad sampling or generate params, empty prompt on an empty session),
 * TANDEM_E_CONTEXT_OVERFLOW (the prompt does not fit: nothing evaluated, session
 * unchanged), TANDEM_E_BUSY, TANDEM_E_INTERNAL (a C++ callback threw). Generation that
 * reaches n_ctx ends with TANDEM_FINISH_LENGTH, not an error. After success the
 * generated tokens are part of the conversation (the last one is evaluated when it
 * continues). */
TANDEM_API tandem_status tandem_session_generate(tandem_session* session, const char* prompt_utf8,
                                                 const tandem_generate_params* params, tandem_token_callback callback,
                                                 void* user_data, tandem_generate_result* result);

/* As tandem_session_generate with the prompt given as token ids (nothing added to them).
 * prompt may be NULL when n_prompt is 0 (continue). An id outside the vocabulary:
 * TANDEM_E_INVALID_ARG, nothing evaluated. */
TANDEM_API tandem_status tandem_session_generate_tokens(tandem_session* session, const int32_t* prompt, size_t n_prompt,
                                                        const tandem_generate_params* params,
                                                        tandem_token_callback callback, void* user_data,
                                                        tandem_generate_result* result);

/* ---- scheduler ---------------------------------------------------------------------- */

/* Service classes (routing and admission order: interactive, standard, batch). */
enum tandem_sla_class { TANDEM_SLA_INTERACTIVE = 0, TANDEM_SLA_STANDARD = 1, TANDEM_SLA_BATCH = 2 };

/* One executor and its own KV store (CPU: a CpuQ4Executor on the thread pool n_threads /
 * pool select; GPU: see device_kind). */
typedef struct tandem_executor_params {
  size_t struct_size;
  int32_t n_threads;         /* CPU threads, 0..512. 0 (default) = the shared node pool (as
                                tandem_session_params.n_threads); n > 0: a pool of its own */
  int32_t max_running;       /* decode slots (sequences admitted at once), >= 1; default 16 */
  int32_t step_token_budget; /* tokens per step (decodes + prefill chunks), >= 1; default 256 */
  int32_t prefill_chunk;     /* most prompt tokens of one sequence per step, >= 1; default 128 */
  int32_t kv_pages;          /* pages of its compute tier (CPU: host memory; GPU: device
                                memory), >= 0; 0 = room for max_running +
                                prefix_cache_entries sequences of max_context positions
                                (include/tandem/node/node.hpp). Default 0 */
  int32_t accelerator;       /* routing role: -1 = by kind (a CPU executor is not an
                                accelerator), 0 = not, 1 = treat as the accelerator (for
                                "cpu+cpu": mark one pool as the primary). Default -1 */
  /* ---- later fields (a struct_size without them is still accepted) ---- */
  int32_t device_kind;   /* a tandem_device_kind: TANDEM_DEVICE_CPU (default) or
                            TANDEM_DEVICE_CUDA (TANDEM_E_UNSUPPORTED in a library built
                            without CUDA) */
  int32_t device_id;     /* CUDA device ordinal (tandem_device_get_info's device_id);
                            0 for the CPU. Default 0 */
  int32_t kv_dtype;      /* a tandem_kv_dtype of the executor's KV store; default
                            TANDEM_KV_F16 */
  int32_t kv_file_pages; /* pages of a File tier below the compute tier (Host for a CPU,
                            Device for a GPU executor, which also gets a Host tier as
                            large as its Device tier where physical memory allows):
                            sequences preempted when the
                            compute tier is full are swapped there instead of being
                            recomputed. >= 0; 0 = no File tier (default) */
  const char* kv_dir;    /* directory of the File tier's page file (NUL-terminated; NULL =
                            the system temporary directory). Copied at creation */
  tandem_pool* pool;     /* CPU executors: NULL (default) or a pool from tandem_pool_create
                            to compute on, shared with its other users (kept alive by the
                            executor); n_threads must then be 0. GPU executors: must be NULL */
} tandem_executor_params;

TANDEM_API tandem_status tandem_executor_params_init(tandem_executor_params* params, size_t struct_size);

typedef struct tandem_scheduler_params {
  size_t struct_size;
  /* n_executors executor descriptions, or NULL for n_executors default executors. The
   * array's stride is executors[0].struct_size: every element must have the same
   * struct_size (fill each with tandem_executor_params_init). */
  const tandem_executor_params* executors;
  size_t n_executors;           /* 1..64; default 1. "cpu+cpu" is 2 */
  int32_t max_queued;           /* waiting requests, all executors together, >= 0; beyond it
                                   a request finishes at once with TANDEM_FINISH_OVERLOADED.
                                   Default 1024 */
  int32_t max_context;          /* positions per sequence, >= 0; 0 = the model's n_ctx_train
                                   capped at 4096. Default 0 */
  int32_t prefix_cache_entries; /* finished prompts kept per executor for KV reuse, >= 0
                                   (0 = off). Default 4 */
  int32_t page_size;            /* KV page size in tokens, >= 1; default 16 */
  /* ---- later fields (a struct_size without them is still accepted) ---- */
  /* NULL, or n_executors executor handles (tandem_executor_create): executor i is
   * executor_handles[i] instead of a new one built from executors[i] (whose slot and KV
   * fields still apply; its device fields are ignored). An executor serves one scheduler
   * at a time: a handle in use by another live scheduler gives TANDEM_E_BUSY. The
   * scheduler keeps the executors alive; freeing a handle does not stop it. */
  tandem_executor* const* executor_handles;
  int32_t log_routing; /* nonzero: every routing decision, preemption and hand-off
                          goes to the log callback (tandem_log_set) at
                          TANDEM_LOG_DEBUG with its reason. Default 1 */
  int32_t reserved;    /* must be 0 */
} tandem_scheduler_params;

TANDEM_API tandem_status tandem_scheduler_params_init(tandem_scheduler_params* params, size_t struct_size);

/* Create a scheduler on `model`: the executors (each with its threads and KV store,
 * allocated now) and one step-loop thread per executor. params may be NULL (defaults:
 * one executor). On failure *out_scheduler is set to NULL. Errors: TANDEM_E_INVALID_ARG
 * (NULL model or out_scheduler, a parameter out of range, bad struct_size of the
 * scheduler params or of an executor), TANDEM_E_INVALID_HANDLE, TANDEM_E_OUT_OF_MEMORY
 * (the KV stores would not fit in physical memory). Thread-safe. */
TANDEM_API tandem_status tandem_scheduler_create(const tandem_model* model, const tandem_scheduler_params* params,
                                                 tandem_scheduler** out_scheduler);

/* Shut the scheduler down (outstanding requests are cancelled: their handles stay valid
 * and report TANDEM_FINISH_CANCELLED unless they had finished) and release the handle;
 * the executors and KV stores go when the last call using them returns. NULL: no-op.
 * Already freed: TANDEM_E_INVALID_HANDLE. May be called from any thread, also while other
 * threads are inside calls on this scheduler or its requests (tandem_scheduler_drain
 * returns once the cancellations are delivered). */
TANDEM_API tandem_status tandem_scheduler_free(tandem_scheduler* scheduler);

typedef struct tandem_request_params {
  size_t struct_size;
  const char* prompt;           /* NUL-terminated UTF-8 prompt (BOS added when the vocabulary
                                   asks for it); used when prompt_tokens is NULL */
  const int32_t* prompt_tokens; /* or the prompt as ids (nothing added), n_prompt_tokens >= 1 */
  size_t n_prompt_tokens;
  const tandem_sampling_params* sampling; /* NULL = tandem_sampling_params_init defaults */
  const char* const* stop;                /* n_stop NUL-terminated, non-empty UTF-8 stop strings */
  size_t n_stop;
  int32_t max_tokens;  /* >= 1; default 128 */
  uint32_t flags;      /* TANDEM_GENERATE_* bits; default 0 */
  int32_t sla;         /* a tandem_sla_class; default TANDEM_SLA_STANDARD */
  int32_t deadline_ms; /* > 0: the request ends with TANDEM_FINISH_TIMEOUT this many
                          milliseconds after submission; 0 = none (default) */
  /* ---- later fields (a struct_size without them is still accepted) ---- */
  uint64_t session; /* 0 (default), or a scheduler session
                       (tandem_scheduler_session_open): the request continues
                       that conversation, its prompt appended to the session's
                       tokens and KV (one request per session at a time; a
                       second one finishes with TANDEM_FINISH_ERROR) */
  int32_t logprobs; /* -1 (default): none; 0 .. TANDEM_MAX_TOP_LOGPROBS: as
                       tandem_generate_params.logprobs, into tandem_request_result.logprobs
                       (the result only: events do not carry them) */
  int32_t reserved; /* 0 */
  /* ---- structured outputs (a struct_size without them is still accepted) ---- */
  const char* grammar;  /* as tandem_generate_params.grammar */
  int32_t grammar_type; /* a tandem_grammar_type; default TANDEM_GRAMMAR_NONE */
  int32_t reserved2;    /* 0 */
} tandem_request_params;

TANDEM_API tandem_status tandem_request_params_init(tandem_request_params* params, size_t struct_size);

/* Submit a request. The arguments are checked here: TANDEM_E_INVALID_ARG (NULL
 * scheduler, params or out_request, bad struct_size, neither prompt nor prompt_tokens,
 * invalid UTF-8 in the prompt or a stop string, an empty or NULL stop string, a token id
 * outside the vocabulary, max_tokens < 1, deadline_ms < 0, an unknown sla or flag bit,
 * bad sampling params, a scheduler that was shut down), TANDEM_E_INVALID_HANDLE. A
 * request the scheduler cannot take is still returned, finished: with
 * TANDEM_FINISH_OVERLOADED (queue full, draining) or TANDEM_FINISH_ERROR (for example a
 * prompt longer than max_context). On failure *out_request is set to NULL. Free the
 * request with tandem_request_free. Thread-safe (any number of submitters). */
TANDEM_API tandem_status tandem_scheduler_submit(tandem_scheduler* scheduler, const tandem_request_params* params,
                                                 tandem_request** out_request);

/* n choices of one prompt (OpenAI's `n`): n requests, out_requests[i] choice i (an array
 * of n handles, each freed with tandem_request_free). The prompt is computed once: choice 0
 * prefills it, the others wait for it and share its KV pages (only the last prompt token
 * is recomputed per choice, for its logits). Choice i samples with seed params->sampling
 * seed + i (mod 2^64); each request streams, finishes and is cancelled on its own. n == 1
 * is tandem_scheduler_submit. Errors as tandem_scheduler_submit, plus TANDEM_E_INVALID_ARG
 * for n outside [1, 128] or n > 1 with a session; on failure every out_requests[i] is NULL.
 * Thread-safe. */
TANDEM_API tandem_status tandem_scheduler_submit_n(tandem_scheduler* scheduler, const tandem_request_params* params,
                                                   uint32_t n, tandem_request** out_requests);

/* Stop accepting requests (later submissions finish with TANDEM_FINISH_OVERLOADED) and
 * block until every submitted request has finished. Thread-safe. */
TANDEM_API tandem_status tandem_scheduler_drain(tandem_scheduler* scheduler);

/* Cancel every outstanding request, stop the step loops and release parked KV; later
 * submissions fail with TANDEM_E_INVALID_ARG. Idempotent. Blocks until the loops have
 * stopped. Thread-safe. */
TANDEM_API tandem_status tandem_scheduler_shutdown(tandem_scheduler* scheduler);

/* A JSON snapshot of the serving metrics (one object: submitted, finished, by_finish,
 * migrations, prefix reuse, queued, and per executor steps, tokens, utilisation, speeds,
 * KV usage per tier; see include/tandem/sched/metrics.hpp). Buffer rules as tandem_detokenize
 * (size query, TANDEM_E_BUFFER_TOO_SMALL, NUL-terminated). The size can change between
 * two calls: retry on TANDEM_E_BUFFER_TOO_SMALL. Thread-safe. */
TANDEM_API tandem_status tandem_scheduler_metrics_json(const tandem_scheduler* scheduler, char* buf, size_t capacity,
                                                       size_t* out_len);

/* Events of tandem_request_poll. */
enum tandem_event_kind {
  TANDEM_EVENT_NONE = 0,  /* nothing new yet */
  TANDEM_EVENT_TOKEN = 1, /* one generated token and the text it completed (may be empty:
                             text is held back while it may become a stop string or an
                             incomplete UTF-8 character) */
  TANDEM_EVENT_FINISH = 2 /* the request finished: finish_reason, and any text flushed at
                             the end (token -1) */
};

/* One polled event. text and text_cap are INPUTS (an optional buffer; init sets them to
 * NULL/0), the rest are outputs. */
typedef struct tandem_request_event {
  size_t struct_size;
  char* text;            /* in: buffer for the event's text, or NULL */
  size_t text_cap;       /* in: its capacity in bytes (NUL included) */
  size_t text_len;       /* out: the text's length in bytes (valid UTF-8) */
  int32_t kind;          /* out: a tandem_event_kind */
  int32_t token;         /* out: the generated id (TANDEM_EVENT_TOKEN), else -1 */
  int32_t finish_reason; /* out: a tandem_finish_reason (TANDEM_EVENT_FINISH), else -1 */
  int32_t reserved;      /* out: 0 */
} tandem_request_event;

TANDEM_API tandem_status tandem_request_event_init(tandem_request_event* event, size_t struct_size);

/* Take the next streamed event without blocking. Every request delivers its token events
 * in order and then exactly one TANDEM_EVENT_FINISH; after that every poll returns
 * TANDEM_EVENT_FINISH again (same finish_reason, empty text). The concatenated texts are
 * the request's text. With event->text NULL (text_cap 0) the text is not wanted: the
 * event is taken and only text_len reported. Nothing is lost otherwise: when event->text
 * cannot hold the text (text_len + 1 bytes), the call returns TANDEM_E_BUFFER_TOO_SMALL
 * with text_len set, nothing else written, and the event stays first in line for the
 * next poll with a larger buffer. Errors: TANDEM_E_INVALID_ARG (NULL arguments, bad
 * struct_size, text NULL with text_cap > 0), TANDEM_E_INVALID_HANDLE (freed request),
 * TANDEM_E_BUFFER_TOO_SMALL. Thread-safe (polls of one request are serialised; each event
 * goes to one caller). */
TANDEM_API tandem_status tandem_request_poll(tandem_request* request, tandem_request_event* event);

/* Ask the request to stop; it finishes with TANDEM_FINISH_CANCELLED within one step
 * unless it already finished (then nothing changes: TANDEM_OK). Thread-safe. */
TANDEM_API tandem_status tandem_request_cancel(tandem_request* request);

/* A request's outcome. The buffer fields (tokens, text, logprobs and their capacities) are
 * INPUTS (optional; init sets them to NULL/0); the rest are outputs. Buffers get as much
 * as fits (text cut at a UTF-8 character boundary, NUL-terminated); n_tokens, text_len
 * and n_logprobs give the full sizes. */
typedef struct tandem_request_result {
  size_t struct_size;
  int32_t* tokens;       /* in: buffer for the generated ids, or NULL */
  size_t tokens_cap;     /* in: its capacity in ids */
  char* text;            /* in: buffer for the generated text, or NULL */
  size_t text_cap;       /* in: its capacity in bytes (NUL included) */
  size_t n_tokens;       /* out: ids generated */
  size_t text_len;       /* out: text length in bytes (stop strings cut off) */
  uint64_t id;           /* out: the scheduler's request id (1, 2, ...) */
  int32_t finished;      /* out: nonzero when the request has finished; when 0 the outputs
                            below are not final and the buffers are not written */
  int32_t finish_reason; /* out: a tandem_finish_reason (-1 before the finish) */
  int32_t status;        /* out: for TANDEM_FINISH_ERROR the error (a TANDEM_E_* code),
                            else TANDEM_OK */
  int32_t n_prompt;      /* out: prompt tokens */
  const char* message;   /* out: why it ended with an error or overloaded ("" otherwise);
                            owned by the request, valid until tandem_request_free */
  double queue_seconds;  /* out: submission -> admission */
  double ttft_seconds;   /* out: submission -> first generated token (0: none) */
  double e2e_seconds;    /* out: submission -> finish */
  /* ---- later fields (a struct_size without them is still accepted) ---- */
  tandem_token_logprob* logprobs; /* in: buffer for one entry per generated id (with
                                     tandem_request_params.logprobs >= 0), or NULL */
  size_t logprobs_cap;            /* in: its capacity in entries */
  size_t n_logprobs;              /* out: entries (n_tokens with logprobs requested, else 0;
                                     0 before the finish); min(n_logprobs, logprobs_cap) written */
} tandem_request_result;

TANDEM_API tandem_status tandem_request_result_init(tandem_request_result* result, size_t struct_size);

/* Block until the request has finished or timeout_ms milliseconds have passed (< 0:
 * without limit; 0: do not block), then fill *result (may be NULL) as
 * tandem_request_get_result does. Returns TANDEM_OK either way: result->finished says which.
 * Errors: TANDEM_E_INVALID_ARG (NULL request, bad struct_size, a buffer NULL with a
 * capacity), TANDEM_E_INVALID_HANDLE. Thread-safe (any number of waiters). */
TANDEM_API tandem_status tandem_request_wait(tandem_request* request, int32_t timeout_ms,
                                             tandem_request_result* result);

/* Fill *result without blocking: the whole outcome when the request has finished (always
 * once tandem_request_poll or _next_event has delivered its FINISH event), else
 * finished = 0 (and the id). Errors as tandem_request_wait. Thread-safe. */
TANDEM_API tandem_status tandem_request_get_result(const tandem_request* request, tandem_request_result* result);

/* Release the handle; a request that has not finished is cancelled first. NULL: no-op.
 * Already freed: TANDEM_E_INVALID_HANDLE. Thread-safe, also while another thread is
 * inside tandem_request_wait on it (that call returns normally). */
TANDEM_API tandem_status tandem_request_free(tandem_request* request);

/* ---- library: numeric version, log ---------------------------------------------------- */

/* TANDEM_VERSION_NUMBER of the library actually loaded (major * 10000 + minor * 100 +
 * patch). Cannot fail. Thread-safe. */
TANDEM_API int32_t tandem_version_number(void);

enum tandem_log_level {
  TANDEM_LOG_DEBUG = 0, /* routing decisions (with their reasons), preemptions, hand-offs */
  TANDEM_LOG_INFO = 1,  /* objects created: executors (device, threads), KV stores (pages) */
  TANDEM_LOG_WARN = 2,
  TANDEM_LOG_ERROR = 3
};

/* Receives every line the library would print (it prints nothing itself): `message` is
 * NUL-terminated UTF-8 without a trailing newline, valid only during the call. Called from
 * any library thread (scheduler step loops included), possibly from several at once: it
 * must be thread-safe, quick, and must not call tandem functions other than
 * tandem_last_error / tandem_status_name. */
typedef void (*tandem_log_callback)(int32_t level, const char* message, void* user_data);

/* Install `callback` (NULL = discard everything, the default) for lines of `min_level`
 * and above, for the whole process. Once this returns, no call reaches the previous
 * callback. Errors: TANDEM_E_INVALID_ARG (min_level outside TANDEM_LOG_DEBUG..ERROR).
 * Thread-safe. */
TANDEM_API tandem_status tandem_log_set(tandem_log_callback callback, void* user_data, int32_t min_level);

/* ---- devices and executors --------------------------------------------------------- */

enum tandem_device_kind { TANDEM_DEVICE_CPU = 0, TANDEM_DEVICE_CUDA = 1 };

typedef struct tandem_device_info {
  size_t struct_size;
  const char* name;           /* out: "cpu", or the CUDA device name; static storage */
  const char* isa;            /* out: CPU: the kernels' instruction set ("avx512-vnni", "avx2",
                                 "scalar", ...); CUDA: "sm_<major><minor>"; static storage */
  uint64_t memory_bytes;      /* out: CPU: physical memory; CUDA: total device memory */
  int32_t kind;               /* out: a tandem_device_kind */
  int32_t device_id;          /* out: CUDA device ordinal; 0 for the CPU */
  int32_t n_cores;            /* out: CPU: hardware threads online; CUDA: multiprocessors */
  int32_t compute_capability; /* out: CUDA: major * 10 + minor; CPU: 0 */
} tandem_device_info;

TANDEM_API tandem_status tandem_device_info_init(tandem_device_info* info, size_t struct_size);

/* Number of devices: the CPU (always index 0) plus, in a library built with CUDA, every
 * CUDA device the runtime sees (none without a driver). Errors: TANDEM_E_INVALID_ARG
 * (out_n NULL). Thread-safe. */
TANDEM_API tandem_status tandem_device_count(size_t* out_n);

/* Describe device `index` (0 .. count-1). Errors: TANDEM_E_INVALID_ARG (info NULL, bad
 * struct_size, index out of range). Thread-safe. */
TANDEM_API tandem_status tandem_device_get_info(size_t index, tandem_device_info* info);

/* Create an executor on `model` from params' device_kind, device_id, n_threads and pool
 * (the slot and KV fields are used by a scheduler built on it): a CPU executor (on the
 * node pool, a pool of n_threads of its own, or the given pool) or, in a library built
 * with CUDA, a GPU executor (the weights are uploaded now). params may be NULL (a CPU
 * executor). On failure *out_executor is set to NULL. Errors: TANDEM_E_INVALID_ARG (NULL
 * model or out_executor, bad params, a pool with n_threads or with a GPU, no such CUDA
 * device), TANDEM_E_UNSUPPORTED (TANDEM_DEVICE_CUDA in a library built without CUDA),
 * TANDEM_E_OUT_OF_MEMORY, TANDEM_E_INVALID_HANDLE (also a freed pool). Thread-safe. */
TANDEM_API tandem_status tandem_executor_create(const tandem_model* model, const tandem_executor_params* params,
                                                tandem_executor** out_executor);

/* Release the handle; a scheduler using the executor keeps it until the scheduler is
 * freed. NULL: no-op. Already freed: TANDEM_E_INVALID_HANDLE. Thread-safe. */
TANDEM_API tandem_status tandem_executor_free(tandem_executor* executor);

/* The device an executor computes on (as tandem_device_get_info; n_cores of a CPU
 * executor is its thread count). Thread-safe. */
TANDEM_API tandem_status tandem_executor_get_device(const tandem_executor* executor, tandem_device_info* info);

/* ---- model metadata ------------------------------------------------------------------ */

/* Number of GGUF metadata key/value pairs of the model's file. Thread-safe. */
TANDEM_API tandem_status tandem_model_meta_count(const tandem_model* model, size_t* out_n);

/* Key of metadata entry `index` (file order), as text. Buffer rules as tandem_detokenize
 * (size query, TANDEM_E_BUFFER_TOO_SMALL, NUL-terminated). Errors: TANDEM_E_INVALID_ARG
 * (index >= count). Thread-safe. */
TANDEM_API tandem_status tandem_model_meta_key_by_index(const tandem_model* model, size_t index, char* buf,
                                                        size_t capacity, size_t* out_len);

/* Value of metadata key `key` as text (llama_model_meta_val_str): strings as they are,
 * integers in decimal, floats with the shortest round-trip form, booleans "true"/"false",
 * arrays as "[n items]" of their element type (e.g. "[32000 string]"); the vocabulary
 * arrays are never copied out. Buffer rules as tandem_detokenize. Errors:
 * TANDEM_E_INVALID_ARG (NULL key or out_len; a key the file does not have: the message
 * names it). Thread-safe. */
TANDEM_API tandem_status tandem_model_meta_value(const tandem_model* model, const char* key, char* buf, size_t capacity,
                                                 size_t* out_len);

/* ---- chat templates ------------------------------------------------------------------- */

/* A conversation is n_messages pairs roles[i] / contents[i] of NUL-terminated UTF-8.
 * With template_name NULL the template is the model's (tandem_model_params.chat_template
 * when the model was loaded with one; the functions below use it too), else its own tokenizer.chat_template,
 * executed by Tandem's Jinja interpreter as Hugging Face transformers renders it (roles are
 * what that template accepts; its raise_exception is TANDEM_E_INVALID_ARG with its message;
 * a render limit reached is TANDEM_E_OUT_OF_MEMORY). When the model has no template or it does not
 * parse, the built-in family it matches (llama.cpp's list: ChatML, Llama 3, Llama 2,
 * Mistral, Phi-3, Gemma, Zephyr, DeepSeek; ChatML when none matches) renders it, as does
 * the family named by template_name ("chatml", "llama3", ...); the built-in families take
 * the roles "system", "user" and "assistant". */

/* The rendered conversation as text, markers included; with add_assistant nonzero it ends
 * with the opening of an assistant turn. Buffer rules as tandem_detokenize. Errors:
 * TANDEM_E_INVALID_ARG (NULL arguments with n_messages > 0, an unknown role or template
 * name, invalid UTF-8). Thread-safe. */
TANDEM_API tandem_status tandem_chat_render(const tandem_model* model, const char* template_name,
                                            const char* const* roles, const char* const* contents, size_t n_messages,
                                            int32_t add_assistant, char* buf, size_t capacity, size_t* out_len);

/* Token ids of the rendered conversation: the template's markers become their control
 * tokens, message contents are tokenized with special-token parsing OFF (a user typing
 * "<|im_end|>" cannot end a turn), BOS added when the vocabulary asks. Pass them to
 * tandem_session_generate_tokens or tandem_request_params.prompt_tokens. Buffer rules and
 * errors as tandem_tokenize and tandem_chat_render. Thread-safe. */
TANDEM_API tandem_status tandem_chat_tokenize(const tandem_model* model, const char* template_name,
                                              const char* const* roles, const char* const* contents, size_t n_messages,
                                              int32_t add_assistant, int32_t* tokens, size_t capacity,
                                              size_t* out_n_tokens);

/* The prompt the model's own chat template makes of an OpenAI chat-completions request
 * (llama-server's /apply-template), exactly as Hugging Face transformers renders it.
 * request_json: NUL-terminated JSON text with "messages" (content a string, null or a list
 * of parts; tool_calls, tool results, ...), optional "tools" (OpenAI function tools),
 * "add_generation_prompt" (default true) and "chat_template_kwargs" (more template
 * variables, e.g. enable_thinking). A model without a usable Jinja template gets its
 * built-in family, which takes role/content strings only and no tools. Buffer rules as
 * tandem_detokenize. Errors: TANDEM_E_INVALID_ARG (NULL arguments, not JSON, no messages
 * array, the template's raise_exception or a type error: the message says which),
 * TANDEM_E_OUT_OF_MEMORY (a render limit: output, steps, nesting, bytes created).
 * Thread-safe. */
TANDEM_API tandem_status tandem_chat_apply_template(const tandem_model* model, const char* request_json, char* buf,
                                                    size_t capacity, size_t* out_len);

/* Its token ids, made as tandem_chat_tokenize makes them (the template's markers become
 * control tokens, message text never does; BOS when the vocabulary asks and the text has
 * none). Buffer rules as tandem_tokenize; errors as tandem_chat_apply_template.
 * Thread-safe. */
TANDEM_API tandem_status tandem_chat_apply_template_tokens(const tandem_model* model, const char* request_json,
                                                           int32_t* tokens, size_t capacity, size_t* out_n_tokens);

/* Tool calls (OpenAI `tools`) in generated text, split off in the format the model's chat
 * template asks for: <tool_call>{"name", "arguments"}</tool_call> blocks (Qwen, Hermes, and
 * templates that do not render tools, e.g. SmolLM2's), or the whole message as {"name",
 * "parameters"} objects, optionally after <|python_tag|> (Llama 3.x). Writes the JSON
 * object {"content": the text outside the calls (trimmed) or null when that is empty,
 * "tool_calls": [{"name", "arguments": the arguments object as JSON text}]}; text without a
 * well-formed call gives {"content": the text unchanged, "tool_calls": []}. A call whose JSON
 * does not parse stays in the content. Invalid UTF-8 is written as U+FFFD. Buffer rules as
 * tandem_detokenize. Errors: TANDEM_E_INVALID_ARG (NULL text or out_len),
 * TANDEM_E_INVALID_HANDLE, TANDEM_E_BUFFER_TOO_SMALL. Thread-safe. */
TANDEM_API tandem_status tandem_chat_parse_tool_calls(const tandem_model* model, const char* text, char* buf,
                                                      size_t capacity, size_t* out_len);

/* ---- stopping a generation from another thread ---------------------------------------- */

/* Ask the tandem_session_generate / _generate_tokens call running on `session` to stop
 * (as llama_set_abort_callback / ORT's RunOptionsSetTerminate): it stops at the next
 * prefill chunk boundary (n_batch tokens) or the next sampled token, whichever comes
 * first, and returns TANDEM_OK with finish_reason TANDEM_FINISH_CANCELLED; the tokens
 * evaluated so far stay in the conversation (it can be continued or reset). When no call
 * is running it does nothing (it does not affect a later call). Never TANDEM_E_BUSY: made
 * to be called while another thread is inside a session call. Thread-safe. */
TANDEM_API tandem_status tandem_session_abort(tandem_session* session);

/* ---- scheduler sessions and blocking waits --------------------------------------------- */

/* Open a scheduler session: a conversation whose KV stays with the scheduler between
 * requests (parked between requests, moved down the KV tiers when memory is short, moved
 * to another executor when a request's SLA routes it there). Continue it by submitting
 * requests with tandem_request_params.session = *out_session: each request's prompt is
 * appended to the conversation (nothing is recomputed), so three requests in a row
 * generate what one long generation would. Errors: TANDEM_E_INVALID_ARG (NULL
 * out_session, a scheduler that was shut down). Thread-safe. */
TANDEM_API tandem_status tandem_scheduler_session_open(tandem_scheduler* scheduler, uint64_t* out_session);

/* Close a scheduler session: its KV pages are released (a request running on it finishes
 * first). Closing an unknown or closed session is a no-op. Thread-safe. */
TANDEM_API tandem_status tandem_scheduler_session_close(tandem_scheduler* scheduler, uint64_t session);

/* As tandem_request_poll, but block until an event is there or timeout_ms milliseconds
 * have passed (< 0: no limit; 0: do not block). On a timeout it returns TANDEM_OK with
 * event->kind TANDEM_EVENT_NONE. The wait sleeps in the library (a condition variable
 * signalled by the scheduler's step loop), so bindings never need to sleep and poll.
 * Every request ends with a TANDEM_EVENT_FINISH, so a wait without limit always returns
 * (cancel, free of the scheduler, deadlines all finish it). Errors as tandem_request_poll.
 * Thread-safe (waits of one request are serialised with its polls). */
TANDEM_API tandem_status tandem_request_next_event(tandem_request* request, int32_t timeout_ms,
                                                   tandem_request_event* event);

/* ---- shared CPU thread pools ------------------------------------------------------------- */

/* A pool of CPU compute threads that several sessions and executors (and so several
 * schedulers) compute on together: their steps take turns on the pool's threads (one
 * step at a time per pool; a caller waiting its turn sleeps), so the process never runs
 * more compute threads than the pool has, however many sessions it serves. Pass it in
 * tandem_session_params.pool or tandem_executor_params.pool. (Without a pool, n_threads 0
 * already shares the process-wide node pool of one thread per physical core; a pool of
 * your own sets another budget, e.g. a few cores for one tenant.)
 *
 * Create a pool of n_threads threads (0 = one per physical core; 0..512), started now.
 * On failure *out_pool is set to NULL. Errors: TANDEM_E_INVALID_ARG (out_pool NULL,
 * n_threads out of range), TANDEM_E_OUT_OF_MEMORY (the threads cannot be started).
 * Thread-safe. */
TANDEM_API tandem_status tandem_pool_create(int32_t n_threads, tandem_pool** out_pool);

/* Release the handle. The threads stop when the last session or executor using the pool
 * is freed too. NULL: no-op. Already freed: TANDEM_E_INVALID_HANDLE. Thread-safe. */
TANDEM_API tandem_status tandem_pool_free(tandem_pool* pool);

/* The pool's number of threads (the caller's thread counted: a step runs on the calling
 * thread plus n - 1 workers). Errors: TANDEM_E_INVALID_ARG (NULL out_n). Thread-safe. */
TANDEM_API tandem_status tandem_pool_get_threads(const tandem_pool* pool, int32_t* out_n);

/* ---- parking scheduler sessions explicitly ------------------------------------------------ */

typedef struct tandem_scheduler_session_info {
  size_t struct_size;
  int32_t n_tokens;     /* out: tokens of the conversation so far */
  int32_t kv_tokens;    /* out: positions whose KV the session holds (0: none yet, or lost
                           and recomputed by its next request) */
  int32_t executor;     /* out: index of the executor whose KV store holds it; -1 = none */
  int32_t busy;         /* out: nonzero while a request runs on it (the KV then belongs to
                           the request: kv_tokens, executor and the pages read 0 / -1) */
  int32_t pages_device; /* out: its KV pages in each tier of that executor's store */
  int32_t pages_host;
  int32_t pages_file;
  int32_t reserved; /* out: 0 */
} tandem_scheduler_session_info;

TANDEM_API tandem_status tandem_scheduler_session_info_init(tandem_scheduler_session_info* info, size_t struct_size);

/* Fill *info. Errors: TANDEM_E_INVALID_ARG (NULL arguments, bad struct_size, an unknown
 * or closed session), TANDEM_E_INVALID_HANDLE. Thread-safe. */
TANDEM_API tandem_status tandem_scheduler_session_get_info(tandem_scheduler* scheduler, uint64_t session,
                                                           tandem_scheduler_session_info* info);

/* Park a session between requests: move its KV pages from its executor's compute tier
 * (Host for a CPU executor, Device for a GPU one) to the File tier of that executor's KV
 * store (tandem_executor_params.kv_file_pages > 0), so the compute tier is free for other
 * requests. Nothing is recomputed: its next request (or tandem_scheduler_session_unpark,
 * which brings the pages back ahead of it) copies the same bytes back, so the
 * conversation continues exactly as if it had never moved. Pages the session shares with
 * other sequences (a prompt prefix another request shares) stay where they are. A session
 * without KV (nothing evaluated yet): nothing moves, TANDEM_OK.
 * Errors: TANDEM_E_INVALID_ARG (NULL scheduler, an unknown or closed session, a KV store
 * without a File tier), TANDEM_E_BUSY (a request is running on the session: nothing
 * moved), TANDEM_E_OUT_OF_MEMORY (the File tier has too few free pages: nothing moved),
 * TANDEM_E_IO, TANDEM_E_INVALID_HANDLE. Thread-safe (the step loops go on meanwhile). */
TANDEM_API tandem_status tandem_scheduler_session_park(tandem_scheduler* scheduler, uint64_t session);

/* Move a parked session's KV back to its executor's compute tier (a prefetch before its
 * next request; the request would otherwise do it at admission). Errors as
 * tandem_scheduler_session_park (TANDEM_E_OUT_OF_MEMORY: the compute tier is full);
 * no File tier is needed. Thread-safe. */
TANDEM_API tandem_status tandem_scheduler_session_unpark(tandem_scheduler* scheduler, uint64_t session);

/* ---- saving scheduler sessions ------------------------------------------------------------ */

/* Save an idle scheduler session to `path` in the session-file format of
 * tandem_session_save (the same code and checks): its tokens, the KV cache of the
 * evaluated ones (read in whatever tier it is; nothing moves) and the last sampled token,
 * not yet in the KV. No logits and no random state (each request seeds its own sampler):
 * a tandem_session restoring such a file keeps its random engine and continues from the
 * pending token. Written atomically (a temporary file beside it, synced, renamed): on any
 * error, a full disk included, the file at `path` is left as it was. The path is passed
 * to the OS as bytes. Errors: TANDEM_E_INVALID_ARG (NULL scheduler or path, empty path,
 * an unknown or closed session, a path that is a directory or device, a session whose
 * tokens run more than one past its KV: a request stopped before its prompt was
 * evaluated, or its KV was dropped; its next request evaluates them), TANDEM_E_BUSY (a
 * request is running on the session: nothing written), TANDEM_E_IO,
 * TANDEM_E_INVALID_HANDLE. Thread-safe (the step loops go on meanwhile). */
TANDEM_API tandem_status tandem_scheduler_session_save(tandem_scheduler* scheduler, uint64_t session, const char* path);

/* Open a new scheduler session from a file written by tandem_scheduler_session_save or
 * tandem_session_save (same model weights and tokenizer; KV dtype and page size may
 * differ: converted). Its KV goes into the store of executor `executor` (0-based, as in
 * tandem_scheduler_params' executors): into that executor's compute tier when it has
 * room, else into the store's File tier (parked; its next request brings it up). The
 * session is idle: continue it with tandem_request_params.session = *out_session. A
 * tandem_session file's logits and random state are not used. On failure nothing is
 * opened and *out_session is 0. Errors: TANDEM_E_INVALID_ARG (NULL scheduler, path or
 * out_session, empty path, executor out of range), TANDEM_E_IO (cannot read it),
 * TANDEM_E_SESSION_CORRUPT (not a session file, truncated, any damaged byte),
 * TANDEM_E_SESSION_VERSION (a newer format), TANDEM_E_SESSION_MODEL_MISMATCH (saved with
 * other weights, hyper-parameters or tokenizer), TANDEM_E_CONTEXT_OVERFLOW (more
 * positions than the scheduler's context), TANDEM_E_OUT_OF_MEMORY (no tier has room),
 * TANDEM_E_INVALID_HANDLE. Thread-safe. */
TANDEM_API tandem_status tandem_scheduler_session_restore(tandem_scheduler* scheduler, const char* path,
                                                          int32_t executor, uint64_t* out_session);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TANDEM_H */
