//! Raw declarations of cabi/include/tandem.h, written by hand. Layouts must
//! match the C structs exactly (`#[repr(C)]`, same field order and types).
#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_int, c_void};

pub type tandem_status = i32;

pub const TANDEM_OK: tandem_status = 0;
pub const TANDEM_E_INVALID_ARG: tandem_status = 1;
pub const TANDEM_E_IO: tandem_status = 2;
pub const TANDEM_E_OUT_OF_MEMORY: tandem_status = 3;
pub const TANDEM_E_CONTEXT_OVERFLOW: tandem_status = 50;
pub const TANDEM_E_KV_MISMATCH: tandem_status = 60;
pub const TANDEM_E_KV_CHECKSUM: tandem_status = 61;
pub const TANDEM_E_KV_LEASE_EXPIRED: tandem_status = 62;
pub const TANDEM_E_KV_TOKEN_RANGE: tandem_status = 63;
pub const TANDEM_E_SESSION_CORRUPT: tandem_status = 70;
pub const TANDEM_E_SESSION_MODEL_MISMATCH: tandem_status = 71;
pub const TANDEM_E_SESSION_VERSION: tandem_status = 72;
pub const TANDEM_E_INTERNAL: tandem_status = 99;
pub const TANDEM_E_INVALID_HANDLE: tandem_status = 100;
pub const TANDEM_E_BUSY: tandem_status = 101;
pub const TANDEM_E_BUFFER_TOO_SMALL: tandem_status = 102;

pub const TANDEM_TOKENIZE_ADD_SPECIAL: u32 = 1;
pub const TANDEM_TOKENIZE_PARSE_SPECIAL: u32 = 2;
pub const TANDEM_DETOKENIZE_REMOVE_SPECIAL: u32 = 1;
pub const TANDEM_DETOKENIZE_UNPARSE_SPECIAL: u32 = 2;
pub const TANDEM_GENERATE_IGNORE_EOS: u32 = 1;
pub const TANDEM_GENERATE_PARSE_SPECIAL: u32 = 2;

pub const TANDEM_FINISH_STOP: i32 = 0;
pub const TANDEM_FINISH_STOP_STRING: i32 = 1;
pub const TANDEM_FINISH_LENGTH: i32 = 2;
pub const TANDEM_FINISH_CANCELLED: i32 = 3;
pub const TANDEM_FINISH_TIMEOUT: i32 = 4;
pub const TANDEM_FINISH_OVERLOADED: i32 = 5;
pub const TANDEM_FINISH_ERROR: i32 = 6;

pub const TANDEM_SLA_INTERACTIVE: i32 = 0;
pub const TANDEM_SLA_STANDARD: i32 = 1;
pub const TANDEM_SLA_BATCH: i32 = 2;

pub const TANDEM_EVENT_NONE: i32 = 0;
pub const TANDEM_EVENT_TOKEN: i32 = 1;
pub const TANDEM_EVENT_FINISH: i32 = 2;

#[repr(C)]
pub struct tandem_model {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct tandem_session {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct tandem_scheduler {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct tandem_request {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct tandem_pool {
    _opaque: [u8; 0],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct tandem_model_params {
    pub struct_size: usize,
    pub check_block_scales: i32,
    pub max_alignment: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tandem_model_info {
    pub struct_size: usize,
    pub arch: *const c_char,
    pub name: *const c_char,
    pub n_vocab: i32,
    pub n_ctx_train: i32,
    pub n_embd: i32,
    pub n_layer: i32,
    pub n_head: i32,
    pub n_head_kv: i32,
    pub token_bos: i32,
    pub token_eos: i32,
    pub weight_bytes: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tandem_session_params {
    pub struct_size: usize,
    pub n_ctx: i32,
    pub n_batch: i32,
    pub page_size: i32,
    pub n_threads: i32,
    pub kv_tier: i32,
    pub kv_dtype: i32,
    pub kv_dir: *const c_char,
    pub pool: *mut tandem_pool,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct tandem_session_info {
    pub struct_size: usize,
    pub n_ctx: i32,
    pub n_tokens: i32,
    pub n_batch: i32,
    pub page_size: i32,
    pub n_threads: i32,
    pub has_logits: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct tandem_sampling_params {
    pub struct_size: usize,
    pub temperature: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub repeat_penalty: f32,
    pub repeat_last_n: i32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub seed: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tandem_generate_params {
    pub struct_size: usize,
    pub sampling: *const tandem_sampling_params,
    pub stop: *const *const c_char,
    pub n_stop: usize,
    pub max_tokens: i32,
    pub flags: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tandem_generate_result {
    pub struct_size: usize,
    pub tokens: *mut i32,
    pub tokens_cap: usize,
    pub text: *mut c_char,
    pub text_cap: usize,
    pub n_tokens: usize,
    pub text_len: usize,
    pub finish_reason: i32,
    pub n_prompt: i32,
    pub prompt_seconds: f64,
    pub generate_seconds: f64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tandem_executor_params {
    pub struct_size: usize,
    pub n_threads: i32,
    pub max_running: i32,
    pub step_token_budget: i32,
    pub prefill_chunk: i32,
    pub kv_pages: i32,
    pub accelerator: i32,
    pub device_kind: i32,
    pub device_id: i32,
    pub kv_dtype: i32,
    pub kv_file_pages: i32,
    pub kv_dir: *const c_char,
    pub pool: *mut tandem_pool,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tandem_scheduler_params {
    pub struct_size: usize,
    pub executors: *const tandem_executor_params,
    pub n_executors: usize,
    pub max_queued: i32,
    pub max_context: i32,
    pub prefix_cache_entries: i32,
    pub page_size: i32,
    pub executor_handles: *const *mut c_void,
    pub log_routing: i32,
    pub reserved: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tandem_request_params {
    pub struct_size: usize,
    pub prompt: *const c_char,
    pub prompt_tokens: *const i32,
    pub n_prompt_tokens: usize,
    pub sampling: *const tandem_sampling_params,
    pub stop: *const *const c_char,
    pub n_stop: usize,
    pub max_tokens: i32,
    pub flags: u32,
    pub sla: i32,
    pub deadline_ms: i32,
    pub session: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tandem_scheduler_session_info {
    pub struct_size: usize,
    pub n_tokens: i32,
    pub kv_tokens: i32,
    pub executor: i32,
    pub busy: i32,
    pub pages_device: i32,
    pub pages_host: i32,
    pub pages_file: i32,
    pub reserved: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tandem_request_event {
    pub struct_size: usize,
    pub text: *mut c_char,
    pub text_cap: usize,
    pub text_len: usize,
    pub kind: i32,
    pub token: i32,
    pub finish_reason: i32,
    pub reserved: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tandem_request_result {
    pub struct_size: usize,
    pub tokens: *mut i32,
    pub tokens_cap: usize,
    pub text: *mut c_char,
    pub text_cap: usize,
    pub n_tokens: usize,
    pub text_len: usize,
    pub id: u64,
    pub finished: i32,
    pub finish_reason: i32,
    pub status: i32,
    pub n_prompt: i32,
    pub message: *const c_char,
    pub queue_seconds: f64,
    pub ttft_seconds: f64,
    pub e2e_seconds: f64,
}

pub type tandem_token_callback =
    Option<unsafe extern "C" fn(piece: *const c_char, len: usize, token: i32, user_data: *mut c_void) -> c_int>;

extern "C" {
    pub fn tandem_version() -> *const c_char;
    pub fn tandem_last_error() -> *const c_char;
    pub fn tandem_status_name(status: tandem_status) -> *const c_char;

    pub fn tandem_model_params_init(params: *mut tandem_model_params, struct_size: usize) -> tandem_status;
    pub fn tandem_model_load(
        path: *const c_char,
        params: *const tandem_model_params,
        out_model: *mut *mut tandem_model,
    ) -> tandem_status;
    pub fn tandem_model_free(model: *mut tandem_model) -> tandem_status;
    pub fn tandem_model_info_init(info: *mut tandem_model_info, struct_size: usize) -> tandem_status;
    pub fn tandem_model_get_info(model: *const tandem_model, info: *mut tandem_model_info) -> tandem_status;
    pub fn tandem_model_identity_hash(model: *const tandem_model, out_hash: *mut u64) -> tandem_status;

    pub fn tandem_tokenize(
        model: *const tandem_model,
        text: *const c_char,
        text_len: usize,
        flags: u32,
        tokens: *mut i32,
        capacity: usize,
        out_n_tokens: *mut usize,
    ) -> tandem_status;
    pub fn tandem_detokenize(
        model: *const tandem_model,
        tokens: *const i32,
        n_tokens: usize,
        flags: u32,
        buf: *mut c_char,
        capacity: usize,
        out_len: *mut usize,
    ) -> tandem_status;
    pub fn tandem_token_to_piece(
        model: *const tandem_model,
        token: i32,
        flags: u32,
        buf: *mut c_char,
        capacity: usize,
        out_len: *mut usize,
    ) -> tandem_status;

    pub fn tandem_session_params_init(params: *mut tandem_session_params, struct_size: usize) -> tandem_status;
    pub fn tandem_session_create(
        model: *const tandem_model,
        params: *const tandem_session_params,
        out_session: *mut *mut tandem_session,
    ) -> tandem_status;
    pub fn tandem_session_free(session: *mut tandem_session) -> tandem_status;
    pub fn tandem_session_info_init(info: *mut tandem_session_info, struct_size: usize) -> tandem_status;
    pub fn tandem_session_get_info(session: *const tandem_session, info: *mut tandem_session_info) -> tandem_status;
    pub fn tandem_session_reset(session: *mut tandem_session) -> tandem_status;
    pub fn tandem_session_eval(
        session: *mut tandem_session,
        tokens: *const i32,
        n_tokens: usize,
        logits: *mut f32,
        capacity: usize,
    ) -> tandem_status;
    pub fn tandem_session_get_logits(
        session: *const tandem_session,
        logits: *mut f32,
        capacity: usize,
        out_n: *mut usize,
    ) -> tandem_status;
    pub fn tandem_session_get_tokens(
        session: *const tandem_session,
        tokens: *mut i32,
        capacity: usize,
        out_n: *mut usize,
    ) -> tandem_status;

    pub fn tandem_sampling_params_init(params: *mut tandem_sampling_params, struct_size: usize) -> tandem_status;
    pub fn tandem_generate_params_init(params: *mut tandem_generate_params, struct_size: usize) -> tandem_status;
    pub fn tandem_generate_result_init(result: *mut tandem_generate_result, struct_size: usize) -> tandem_status;
    pub fn tandem_session_generate(
        session: *mut tandem_session,
        prompt_utf8: *const c_char,
        params: *const tandem_generate_params,
        callback: tandem_token_callback,
        user_data: *mut c_void,
        result: *mut tandem_generate_result,
    ) -> tandem_status;
    pub fn tandem_session_generate_tokens(
        session: *mut tandem_session,
        prompt: *const i32,
        n_prompt: usize,
        params: *const tandem_generate_params,
        callback: tandem_token_callback,
        user_data: *mut c_void,
        result: *mut tandem_generate_result,
    ) -> tandem_status;

    pub fn tandem_session_save(session: *const tandem_session, path: *const c_char) -> tandem_status;
    pub fn tandem_session_restore(session: *mut tandem_session, path: *const c_char) -> tandem_status;

    pub fn tandem_executor_params_init(params: *mut tandem_executor_params, struct_size: usize) -> tandem_status;
    pub fn tandem_scheduler_params_init(params: *mut tandem_scheduler_params, struct_size: usize) -> tandem_status;
    pub fn tandem_request_params_init(params: *mut tandem_request_params, struct_size: usize) -> tandem_status;
    pub fn tandem_request_event_init(event: *mut tandem_request_event, struct_size: usize) -> tandem_status;
    pub fn tandem_request_result_init(result: *mut tandem_request_result, struct_size: usize) -> tandem_status;
    pub fn tandem_scheduler_create(
        model: *const tandem_model,
        params: *const tandem_scheduler_params,
        out_scheduler: *mut *mut tandem_scheduler,
    ) -> tandem_status;
    pub fn tandem_scheduler_free(scheduler: *mut tandem_scheduler) -> tandem_status;
    pub fn tandem_scheduler_submit(
        scheduler: *mut tandem_scheduler,
        params: *const tandem_request_params,
        out_request: *mut *mut tandem_request,
    ) -> tandem_status;
    pub fn tandem_scheduler_drain(scheduler: *mut tandem_scheduler) -> tandem_status;
    pub fn tandem_scheduler_shutdown(scheduler: *mut tandem_scheduler) -> tandem_status;
    pub fn tandem_scheduler_metrics_json(
        scheduler: *const tandem_scheduler,
        buf: *mut c_char,
        capacity: usize,
        out_len: *mut usize,
    ) -> tandem_status;
    pub fn tandem_request_poll(request: *mut tandem_request, event: *mut tandem_request_event) -> tandem_status;
    pub fn tandem_request_cancel(request: *mut tandem_request) -> tandem_status;
    pub fn tandem_request_wait(
        request: *mut tandem_request,
        timeout_ms: i32,
        result: *mut tandem_request_result,
    ) -> tandem_status;
    pub fn tandem_request_get_result(request: *const tandem_request, result: *mut tandem_request_result) -> tandem_status;
    pub fn tandem_request_free(request: *mut tandem_request) -> tandem_status;

    pub fn tandem_session_abort(session: *mut tandem_session) -> tandem_status;
    pub fn tandem_request_next_event(
        request: *mut tandem_request,
        timeout_ms: i32,
        event: *mut tandem_request_event,
    ) -> tandem_status;
    pub fn tandem_scheduler_session_open(scheduler: *mut tandem_scheduler, out_session: *mut u64) -> tandem_status;
    pub fn tandem_scheduler_session_close(scheduler: *mut tandem_scheduler, session: u64) -> tandem_status;
    pub fn tandem_scheduler_session_info_init(
        info: *mut tandem_scheduler_session_info,
        struct_size: usize,
    ) -> tandem_status;
    pub fn tandem_scheduler_session_get_info(
        scheduler: *mut tandem_scheduler,
        session: u64,
        info: *mut tandem_scheduler_session_info,
    ) -> tandem_status;
    pub fn tandem_scheduler_session_park(scheduler: *mut tandem_scheduler, session: u64) -> tandem_status;
    pub fn tandem_scheduler_session_unpark(scheduler: *mut tandem_scheduler, session: u64) -> tandem_status;
    pub fn tandem_pool_create(n_threads: i32, out_pool: *mut *mut tandem_pool) -> tandem_status;
    pub fn tandem_pool_free(pool: *mut tandem_pool) -> tandem_status;
    pub fn tandem_pool_get_threads(pool: *const tandem_pool, out_n: *mut i32) -> tandem_status;
}
