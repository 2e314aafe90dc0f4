//! Safe Rust over the Tandem C ABI (`tandem.h`), with hand-written `extern "C"` bindings
//! ([`sys`]) and no crates.io dependencies.
//!
//! ```no_run
//! let model = tandem::Model::load("aidreams260K-q4_0.gguf")?;
//! let mut session = tandem::Session::new(&model, &tandem::SessionParams::default())?;
//! let opts = tandem::GenerateOptions { max_tokens: 64, temperature: Some(0.0), ..Default::default() };
//! let result = session.generate("Once upon a time", &opts, |piece, _token| {
//!     print!("{piece}");
//!     false // true would stop the generation
//! })?;
//! println!("\n{} tokens, {:?}", result.tokens.len(), result.finish_reason);
//! # Ok::<(), tandem::Error>(())
//! ```
//!
//! Thread-safety follows the C ABI: a [`Model`] is `Send + Sync` (immutable, shared by
//! sessions and threads); a [`Session`] is `Send` and takes `&mut self` for every call
//! that changes it, so safe Rust cannot use one session from two threads at once (the C
//! library would refuse that with `TANDEM_E_BUSY`); an [`AbortHandle`] stops its running
//! generation from another thread. A [`Scheduler`] and its [`Request`]s are `Send + Sync`:
//! [`Request::events`] streams with a wait that blocks inside the library (no polling),
//! and [`SchedulerSession`] continues a conversation over several requests, parkable to
//! the File tier between them. Every handle is freed by `Drop`.

pub mod sys;

use std::any::Any;
use std::ffi::{CStr, CString};
use std::fmt;
use std::mem::MaybeUninit;
use std::os::raw::{c_char, c_int, c_void};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::ptr;

/// A failed call: the status code, its name and the library's message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub status: i32,
    pub name: String,
    pub message: String,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.name, self.status, self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

fn cstr_to_string(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Name of a status ("OK", "INVALID_ARG", "BUSY", ...).
pub fn status_name(status: i32) -> String {
    cstr_to_string(unsafe { sys::tandem_status_name(status) })
}

fn check(status: sys::tandem_status) -> Result<()> {
    if status == sys::TANDEM_OK {
        return Ok(());
    }
    Err(Error { status, name: status_name(status), message: cstr_to_string(unsafe { sys::tandem_last_error() }) })
}

fn invalid_arg(message: &str) -> Error {
    Error { status: sys::TANDEM_E_INVALID_ARG, name: status_name(sys::TANDEM_E_INVALID_ARG), message: message.into() }
}

/// A struct filled by its `*_init` function (struct_size and defaults).
fn init<T>(f: unsafe extern "C" fn(*mut T, usize) -> sys::tandem_status) -> T {
    let mut v = MaybeUninit::<T>::zeroed();
    // The init functions cannot fail for a non-null pointer and the exact size.
    let st = unsafe { f(v.as_mut_ptr(), std::mem::size_of::<T>()) };
    assert_eq!(st, sys::TANDEM_OK, "tandem *_init failed: {}", status_name(st));
    unsafe { v.assume_init() }
}

/// Version of the loaded library ("MAJOR.MINOR.PATCH").
pub fn version() -> String {
    cstr_to_string(unsafe { sys::tandem_version() })
}

// ---- model ---------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    pub arch: String,
    pub name: String,
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

/// An immutable loaded GGUF model.
pub struct Model {
    raw: *mut sys::tandem_model,
}

// The C ABI documents models as immutable and usable from any number of threads.
unsafe impl Send for Model {}
unsafe impl Sync for Model {}

impl Model {
    pub fn load(path: impl AsRef<Path>) -> Result<Model> {
        use std::os::unix::ffi::OsStrExt;
        let c_path = CString::new(path.as_ref().as_os_str().as_bytes()).map_err(|_| invalid_arg("path contains NUL"))?;
        let params: sys::tandem_model_params = init(sys::tandem_model_params_init);
        let mut raw = ptr::null_mut();
        check(unsafe { sys::tandem_model_load(c_path.as_ptr(), &params, &mut raw) })?;
        Ok(Model { raw })
    }

    /// The raw handle (owned by this Model).
    pub fn as_ptr(&self) -> *mut sys::tandem_model {
        self.raw
    }

    pub fn info(&self) -> Result<ModelInfo> {
        let mut i: sys::tandem_model_info = init(sys::tandem_model_info_init);
        check(unsafe { sys::tandem_model_get_info(self.raw, &mut i) })?;
        Ok(ModelInfo {
            arch: cstr_to_string(i.arch),
            name: cstr_to_string(i.name),
            n_vocab: i.n_vocab,
            n_ctx_train: i.n_ctx_train,
            n_embd: i.n_embd,
            n_layer: i.n_layer,
            n_head: i.n_head,
            n_head_kv: i.n_head_kv,
            token_bos: i.token_bos,
            token_eos: i.token_eos,
            weight_bytes: i.weight_bytes,
        })
    }

    pub fn identity_hash(&self) -> Result<u64> {
        let mut h = 0u64;
        check(unsafe { sys::tandem_model_identity_hash(self.raw, &mut h) })?;
        Ok(h)
    }

    pub fn tokenize(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<i32>> {
        self.tokenize_bytes(text.as_bytes(), add_special, parse_special)
    }

    /// Tokenize raw bytes (must be valid UTF-8, or the library returns INVALID_ARG).
    pub fn tokenize_bytes(&self, text: &[u8], add_special: bool, parse_special: bool) -> Result<Vec<i32>> {
        let flags = if add_special { sys::TANDEM_TOKENIZE_ADD_SPECIAL } else { 0 }
            | if parse_special { sys::TANDEM_TOKENIZE_PARSE_SPECIAL } else { 0 };
        let mut n = 0usize;
        let tp = text.as_ptr() as *const c_char;
        check(unsafe { sys::tandem_tokenize(self.raw, tp, text.len(), flags, ptr::null_mut(), 0, &mut n) })?;
        let mut out = vec![0i32; n];
        check(unsafe { sys::tandem_tokenize(self.raw, tp, text.len(), flags, out.as_mut_ptr(), out.len(), &mut n) })?;
        out.truncate(n);
        Ok(out)
    }

    /// Bytes of `ids` (may be invalid UTF-8, e.g. half a character).
    pub fn detokenize(&self, ids: &[i32], remove_special: bool, unparse_special: bool) -> Result<Vec<u8>> {
        let flags = if remove_special { sys::TANDEM_DETOKENIZE_REMOVE_SPECIAL } else { 0 }
            | if unparse_special { sys::TANDEM_DETOKENIZE_UNPARSE_SPECIAL } else { 0 };
        let mut n = 0usize;
        check(unsafe { sys::tandem_detokenize(self.raw, ids.as_ptr(), ids.len(), flags, ptr::null_mut(), 0, &mut n) })?;
        let mut buf = vec![0u8; n + 1];
        check(unsafe {
            sys::tandem_detokenize(self.raw, ids.as_ptr(), ids.len(), flags, buf.as_mut_ptr() as *mut c_char, buf.len(), &mut n)
        })?;
        buf.truncate(n);
        Ok(buf)
    }

    pub fn token_to_piece(&self, token: i32, special: bool) -> Result<Vec<u8>> {
        let flags = if special { sys::TANDEM_DETOKENIZE_UNPARSE_SPECIAL } else { 0 };
        let mut n = 0usize;
        check(unsafe { sys::tandem_token_to_piece(self.raw, token, flags, ptr::null_mut(), 0, &mut n) })?;
        let mut buf = vec![0u8; n + 1];
        check(unsafe { sys::tandem_token_to_piece(self.raw, token, flags, buf.as_mut_ptr() as *mut c_char, buf.len(), &mut n) })?;
        buf.truncate(n);
        Ok(buf)
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        unsafe { sys::tandem_model_free(self.raw) };
    }
}

// ---- session -------------------------------------------------------------------------------

#[derive(Debug, Clone)]
pub struct SessionParams {
    pub n_ctx: i32,
    pub n_batch: i32,
    pub page_size: i32,
    pub n_threads: i32,
}

impl Default for SessionParams {
    fn default() -> Self {
        let p: sys::tandem_session_params = init(sys::tandem_session_params_init);
        SessionParams { n_ctx: p.n_ctx, n_batch: p.n_batch, page_size: p.page_size, n_threads: p.n_threads }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionInfo {
    pub n_ctx: i32,
    pub n_tokens: i32,
    pub n_batch: i32,
    pub page_size: i32,
    pub n_threads: i32,
    pub has_logits: bool,
}

/// Sampling and generation options; `None` keeps the library's default.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_tokens: i32,
    pub temperature: Option<f32>,
    pub top_k: Option<i32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<i32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub parse_special: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        let g: sys::tandem_generate_params = init(sys::tandem_generate_params_init);
        GenerateOptions {
            max_tokens: g.max_tokens,
            temperature: None,
            top_k: None,
            top_p: None,
            min_p: None,
            repeat_penalty: None,
            repeat_last_n: None,
            frequency_penalty: None,
            presence_penalty: None,
            seed: None,
            stop: Vec::new(),
            ignore_eos: false,
            parse_special: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    StopString,
    Length,
    Cancelled,
    Timeout,
    Overloaded,
    Error,
    Other(i32),
}

fn sampling_of(opts: &GenerateOptions) -> sys::tandem_sampling_params {
    let mut sampling: sys::tandem_sampling_params = init(sys::tandem_sampling_params_init);
    if let Some(v) = opts.temperature { sampling.temperature = v; }
    if let Some(v) = opts.top_k { sampling.top_k = v; }
    if let Some(v) = opts.top_p { sampling.top_p = v; }
    if let Some(v) = opts.min_p { sampling.min_p = v; }
    if let Some(v) = opts.repeat_penalty { sampling.repeat_penalty = v; }
    if let Some(v) = opts.repeat_last_n { sampling.repeat_last_n = v; }
    if let Some(v) = opts.frequency_penalty { sampling.frequency_penalty = v; }
    if let Some(v) = opts.presence_penalty { sampling.presence_penalty = v; }
    if let Some(v) = opts.seed { sampling.seed = v; }
    sampling
}

/// The stop strings as C strings and the pointer array over them (keep both alive).
fn stops_of(opts: &GenerateOptions) -> Result<(Vec<CString>, Vec<*const c_char>)> {
    let stops: Vec<CString> = opts
        .stop
        .iter()
        .map(|s| CString::new(s.as_str()).map_err(|_| invalid_arg("a stop string contains NUL")))
        .collect::<Result<_>>()?;
    let ptrs = stops.iter().map(|s| s.as_ptr()).collect();
    Ok((stops, ptrs))
}

fn path_cstring(path: &Path) -> Result<CString> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(path.as_os_str().as_bytes()).map_err(|_| invalid_arg("the path contains NUL"))
}

impl From<i32> for FinishReason {
    fn from(v: i32) -> Self {
        match v {
            sys::TANDEM_FINISH_STOP => FinishReason::Stop,
            sys::TANDEM_FINISH_STOP_STRING => FinishReason::StopString,
            sys::TANDEM_FINISH_LENGTH => FinishReason::Length,
            sys::TANDEM_FINISH_CANCELLED => FinishReason::Cancelled,
            sys::TANDEM_FINISH_TIMEOUT => FinishReason::Timeout,
            sys::TANDEM_FINISH_OVERLOADED => FinishReason::Overloaded,
            sys::TANDEM_FINISH_ERROR => FinishReason::Error,
            other => FinishReason::Other(other),
        }
    }
}

#[derive(Debug, Clone)]
pub struct GenerateResult {
    /// The streamed text (the concatenation of every piece).
    pub text: String,
    pub tokens: Vec<i32>,
    pub finish_reason: FinishReason,
    pub n_prompt: i32,
    pub prompt_seconds: f64,
    pub generate_seconds: f64,
}

/// One conversation with its own CPU executor.
pub struct Session {
    raw: *mut sys::tandem_session,
    n_vocab: usize,
}

// A session may move between threads; it is used by one at a time (&mut self).
unsafe impl Send for Session {}

struct CallbackState<'a> {
    f: &'a mut dyn FnMut(&str, i32) -> bool,
    text: String,
    panic: Option<Box<dyn Any + Send>>,
}

unsafe extern "C" fn trampoline(piece: *const c_char, len: usize, token: i32, user_data: *mut c_void) -> c_int {
    let state = &mut *(user_data as *mut CallbackState);
    let bytes = std::slice::from_raw_parts(piece as *const u8, len);
    let text = String::from_utf8_lossy(bytes); // always valid UTF-8 by contract
    state.text.push_str(&text);
    // A panic must not unwind through C: catch it, stop, and resume it after the call.
    match catch_unwind(AssertUnwindSafe(|| (state.f)(&text, token))) {
        Ok(stop) => c_int::from(stop),
        Err(p) => {
            state.panic = Some(p);
            1
        }
    }
}

enum Prompt<'a> {
    Text(&'a str),
    Tokens(&'a [i32]),
}

impl Session {
    pub fn new(model: &Model, params: &SessionParams) -> Result<Session> {
        Session::create(model, params, None)
    }

    /// A session whose executor computes on `pool`, shared with the pool's other users
    /// (`params.n_threads` must be 0). The session keeps the pool's threads alive.
    pub fn with_pool(model: &Model, params: &SessionParams, pool: &Pool) -> Result<Session> {
        Session::create(model, params, Some(pool))
    }

    fn create(model: &Model, params: &SessionParams, pool: Option<&Pool>) -> Result<Session> {
        let mut p: sys::tandem_session_params = init(sys::tandem_session_params_init);
        p.n_ctx = params.n_ctx;
        p.n_batch = params.n_batch;
        p.page_size = params.page_size;
        p.n_threads = params.n_threads;
        p.pool = pool.map_or(ptr::null_mut(), |p| p.raw);
        let mut raw = ptr::null_mut();
        check(unsafe { sys::tandem_session_create(model.raw, &p, &mut raw) })?;
        Ok(Session { raw, n_vocab: model.info()?.n_vocab as usize })
    }

    /// The raw handle (owned by this Session).
    pub fn as_ptr(&self) -> *mut sys::tandem_session {
        self.raw
    }

    /// A handle that stops this session's running generation from another thread.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle { raw: self.raw }
    }

    pub fn info(&self) -> Result<SessionInfo> {
        let mut i: sys::tandem_session_info = init(sys::tandem_session_info_init);
        check(unsafe { sys::tandem_session_get_info(self.raw, &mut i) })?;
        Ok(SessionInfo {
            n_ctx: i.n_ctx,
            n_tokens: i.n_tokens,
            n_batch: i.n_batch,
            page_size: i.page_size,
            n_threads: i.n_threads,
            has_logits: i.has_logits != 0,
        })
    }

    pub fn reset(&mut self) -> Result<()> {
        check(unsafe { sys::tandem_session_reset(self.raw) })
    }

    pub fn eval(&mut self, ids: &[i32]) -> Result<()> {
        check(unsafe { sys::tandem_session_eval(self.raw, ids.as_ptr(), ids.len(), ptr::null_mut(), 0) })
    }

    /// Evaluate and return the logits of every id: `[ids.len() * n_vocab]`, row-major.
    pub fn eval_logits(&mut self, ids: &[i32]) -> Result<Vec<f32>> {
        let mut out = vec![0f32; ids.len() * self.n_vocab];
        check(unsafe { sys::tandem_session_eval(self.raw, ids.as_ptr(), ids.len(), out.as_mut_ptr(), out.len()) })?;
        Ok(out)
    }

    /// Logits after the last evaluated token (empty before the first evaluation).
    pub fn logits(&self) -> Result<Vec<f32>> {
        let mut n = 0usize;
        check(unsafe { sys::tandem_session_get_logits(self.raw, ptr::null_mut(), 0, &mut n) })?;
        let mut out = vec![0f32; n];
        check(unsafe { sys::tandem_session_get_logits(self.raw, out.as_mut_ptr(), out.len(), &mut n) })?;
        Ok(out)
    }

    /// Ids whose KV is in the cache.
    pub fn tokens(&self) -> Result<Vec<i32>> {
        let mut n = 0usize;
        check(unsafe { sys::tandem_session_get_tokens(self.raw, ptr::null_mut(), 0, &mut n) })?;
        let mut out = vec![0i32; n];
        check(unsafe { sys::tandem_session_get_tokens(self.raw, out.as_mut_ptr(), out.len(), &mut n) })?;
        Ok(out)
    }

    /// Generate from a text prompt, streaming each piece to `on_piece(text, token)`;
    /// return `true` from it to stop (finish reason Cancelled).
    pub fn generate<F: FnMut(&str, i32) -> bool>(
        &mut self,
        prompt: &str,
        opts: &GenerateOptions,
        mut on_piece: F,
    ) -> Result<GenerateResult> {
        self.run(Prompt::Text(prompt), opts, &mut on_piece)
    }

    /// As [`Session::generate`] with the prompt as token ids.
    pub fn generate_tokens<F: FnMut(&str, i32) -> bool>(
        &mut self,
        prompt: &[i32],
        opts: &GenerateOptions,
        mut on_piece: F,
    ) -> Result<GenerateResult> {
        self.run(Prompt::Tokens(prompt), opts, &mut on_piece)
    }

    /// Save the conversation (tokens, KV cache, sampler state) to `path` atomically.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let c = path_cstring(path.as_ref())?;
        check(unsafe { sys::tandem_session_save(self.raw, c.as_ptr()) })
    }

    /// Replace the conversation with the one saved in `path`; on any error the session is
    /// unchanged.
    pub fn restore(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let c = path_cstring(path.as_ref())?;
        check(unsafe { sys::tandem_session_restore(self.raw, c.as_ptr()) })
    }

    fn run(&mut self, prompt: Prompt, opts: &GenerateOptions, f: &mut dyn FnMut(&str, i32) -> bool) -> Result<GenerateResult> {
        let sampling = sampling_of(opts);
        let (_stops, stop_ptrs) = stops_of(opts)?;
        let mut params: sys::tandem_generate_params = init(sys::tandem_generate_params_init);
        params.sampling = &sampling;
        params.stop = if stop_ptrs.is_empty() { ptr::null() } else { stop_ptrs.as_ptr() };
        params.n_stop = stop_ptrs.len();
        params.max_tokens = opts.max_tokens;
        params.flags = if opts.ignore_eos { sys::TANDEM_GENERATE_IGNORE_EOS } else { 0 }
            | if opts.parse_special { sys::TANDEM_GENERATE_PARSE_SPECIAL } else { 0 };

        let mut tokens = vec![0i32; opts.max_tokens.max(0) as usize];
        let mut result: sys::tandem_generate_result = init(sys::tandem_generate_result_init);
        result.tokens = tokens.as_mut_ptr();
        result.tokens_cap = tokens.len();

        let mut state = CallbackState { f, text: String::new(), panic: None };
        let ud = &mut state as *mut CallbackState as *mut c_void;
        let status = match prompt {
            Prompt::Text(text) => {
                let c = CString::new(text).map_err(|_| invalid_arg("the prompt contains NUL"))?;
                unsafe { sys::tandem_session_generate(self.raw, c.as_ptr(), &params, Some(trampoline), ud, &mut result) }
            }
            Prompt::Tokens(ids) => unsafe {
                sys::tandem_session_generate_tokens(self.raw, ids.as_ptr(), ids.len(), &params, Some(trampoline), ud, &mut result)
            },
        };
        if let Some(p) = state.panic.take() {
            resume_unwind(p);
        }
        check(status)?;
        tokens.truncate(result.n_tokens.min(result.tokens_cap));
        Ok(GenerateResult {
            text: state.text,
            tokens,
            finish_reason: result.finish_reason.into(),
            n_prompt: result.n_prompt,
            prompt_seconds: result.prompt_seconds,
            generate_seconds: result.generate_seconds,
        })
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        unsafe { sys::tandem_session_free(self.raw) };
    }
}

/// Stops the generation running on a [`Session`] from any thread
/// (`tandem_session_abort`): it ends within one prefill chunk or one token with
/// [`FinishReason::Cancelled`]; with none running it does nothing. The library checks
/// the handle, so using it after the session was dropped is a harmless
/// `TANDEM_E_INVALID_HANDLE` error.
#[derive(Debug, Clone, Copy)]
pub struct AbortHandle {
    raw: *mut sys::tandem_session,
}

// The C call is thread-safe and never dereferences the handle value (a registry key).
unsafe impl Send for AbortHandle {}
unsafe impl Sync for AbortHandle {}

impl AbortHandle {
    pub fn abort(&self) -> Result<()> {
        check(unsafe { sys::tandem_session_abort(self.raw) })
    }
}

/// A CPU thread pool shared by sessions and executors (`tandem_pool_create`): their
/// steps take turns on its threads, so the process runs no more compute threads than it
/// has. Its users keep it alive after it is dropped.
pub struct Pool {
    raw: *mut sys::tandem_pool,
}

unsafe impl Send for Pool {}
unsafe impl Sync for Pool {}

impl Pool {
    /// A pool of `n_threads` threads (0 = one per physical core).
    pub fn new(n_threads: i32) -> Result<Pool> {
        let mut raw = ptr::null_mut();
        check(unsafe { sys::tandem_pool_create(n_threads, &mut raw) })?;
        Ok(Pool { raw })
    }

    pub fn n_threads(&self) -> Result<i32> {
        let mut n = 0;
        check(unsafe { sys::tandem_pool_get_threads(self.raw, &mut n) })?;
        Ok(n)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        unsafe { sys::tandem_pool_free(self.raw) };
    }
}

// ---- scheduler --------------------------------------------------------------------------------

/// Service class of a scheduled request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sla {
    Interactive,
    Standard,
    Batch,
}

/// One CPU executor of a [`Scheduler`] (fields as `tandem_executor_params`).
#[derive(Debug, Clone)]
pub struct ExecutorParams {
    pub n_threads: i32,
    pub max_running: i32,
    pub kv_pages: i32,
    /// `None`: by kind (a CPU executor is not an accelerator).
    pub accelerator: Option<bool>,
    /// Pages of a File tier below the compute tier (0 = none): preempted sequences swap
    /// there, and [`SchedulerSession::park`] parks there.
    pub kv_file_pages: i32,
    /// Directory of the File tier (`None`: the system temporary directory).
    pub kv_dir: Option<PathBuf>,
}

impl Default for ExecutorParams {
    fn default() -> Self {
        let e: sys::tandem_executor_params = init(sys::tandem_executor_params_init);
        ExecutorParams {
            n_threads: e.n_threads,
            max_running: e.max_running,
            kv_pages: e.kv_pages,
            accelerator: None,
            kv_file_pages: e.kv_file_pages,
            kv_dir: None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct SchedulerParams {
    /// "cpu+cpu" is two entries.
    pub executors: Vec<ExecutorParams>,
    pub max_queued: i32,
    pub max_context: i32,
    /// Finished prompts kept per executor for KV reuse (0 = off).
    pub prefix_cache_entries: i32,
}

impl Default for SchedulerParams {
    fn default() -> Self {
        let p: sys::tandem_scheduler_params = init(sys::tandem_scheduler_params_init);
        SchedulerParams {
            executors: vec![ExecutorParams::default()],
            max_queued: p.max_queued,
            max_context: p.max_context,
            prefix_cache_entries: p.prefix_cache_entries,
        }
    }
}

/// The outcome of a scheduled request.
#[derive(Debug, Clone)]
pub struct RequestResult {
    pub id: u64,
    pub finish_reason: FinishReason,
    pub tokens: Vec<i32>,
    pub text: String,
    /// For [`FinishReason::Error`]: the error status and message.
    pub status: i32,
    pub message: String,
    pub n_prompt: i32,
    pub ttft_seconds: f64,
    pub e2e_seconds: f64,
}

/// Many requests on one or more CPU executors. Thread-safe (`Send + Sync`). Dropping it
/// cancels outstanding requests; their [`Request`]s stay usable and report `Cancelled`.
pub struct Scheduler {
    raw: *mut sys::tandem_scheduler,
}

unsafe impl Send for Scheduler {}
unsafe impl Sync for Scheduler {}

/// A submitted request. `Send + Sync` (every request call is thread-safe).
pub struct Request {
    raw: *mut sys::tandem_request,
    max_tokens: usize,
}

unsafe impl Send for Request {}
unsafe impl Sync for Request {}

impl Scheduler {
    pub fn new(model: &Model, params: &SchedulerParams) -> Result<Scheduler> {
        let dirs = params
            .executors
            .iter()
            .map(|e| e.kv_dir.as_deref().map(path_cstring).transpose())
            .collect::<Result<Vec<Option<CString>>>>()?;
        let execs: Vec<sys::tandem_executor_params> = params
            .executors
            .iter()
            .zip(&dirs)
            .map(|(e, dir)| {
                let mut c: sys::tandem_executor_params = init(sys::tandem_executor_params_init);
                c.n_threads = e.n_threads;
                c.max_running = e.max_running;
                c.kv_pages = e.kv_pages;
                c.accelerator = match e.accelerator {
                    None => -1,
                    Some(b) => i32::from(b),
                };
                c.kv_file_pages = e.kv_file_pages;
                c.kv_dir = dir.as_ref().map_or(ptr::null(), |d| d.as_ptr());
                c
            })
            .collect();
        let mut p: sys::tandem_scheduler_params = init(sys::tandem_scheduler_params_init);
        p.executors = execs.as_ptr();
        p.n_executors = execs.len();
        p.max_queued = params.max_queued;
        p.max_context = params.max_context;
        p.prefix_cache_entries = params.prefix_cache_entries;
        let mut raw = ptr::null_mut();
        check(unsafe { sys::tandem_scheduler_create(model.as_ptr(), &p, &mut raw) })?;
        Ok(Scheduler { raw })
    }

    /// Submit a text prompt (sampling, stop strings and max_tokens from `opts`).
    pub fn submit(&self, prompt: &str, opts: &GenerateOptions, sla: Sla) -> Result<Request> {
        let c = CString::new(prompt).map_err(|_| invalid_arg("the prompt contains NUL"))?;
        self.submit_raw(c.as_ptr(), &[], opts, sla, 0)
    }

    /// Open a scheduler session: a conversation continued over several requests (its KV
    /// stays with the scheduler between them). Closed when dropped.
    pub fn open_session(&self) -> Result<SchedulerSession<'_>> {
        let mut id = 0u64;
        check(unsafe { sys::tandem_scheduler_session_open(self.raw, &mut id) })?;
        Ok(SchedulerSession { scheduler: self, id })
    }

    /// Submit a prompt of token ids.
    pub fn submit_tokens(&self, prompt: &[i32], opts: &GenerateOptions, sla: Sla) -> Result<Request> {
        if prompt.is_empty() {
            return Err(invalid_arg("the prompt is empty"));
        }
        self.submit_raw(ptr::null(), prompt, opts, sla, 0)
    }

    fn submit_raw(
        &self,
        text: *const c_char,
        ids: &[i32],
        opts: &GenerateOptions,
        sla: Sla,
        session: u64,
    ) -> Result<Request> {
        let sampling = sampling_of(opts);
        let (_stops, stop_ptrs) = stops_of(opts)?;
        let mut p: sys::tandem_request_params = init(sys::tandem_request_params_init);
        p.prompt = text;
        if !ids.is_empty() {
            p.prompt_tokens = ids.as_ptr();
            p.n_prompt_tokens = ids.len();
        }
        p.sampling = &sampling;
        p.stop = if stop_ptrs.is_empty() { ptr::null() } else { stop_ptrs.as_ptr() };
        p.n_stop = stop_ptrs.len();
        p.max_tokens = opts.max_tokens;
        p.flags = if opts.ignore_eos { sys::TANDEM_GENERATE_IGNORE_EOS } else { 0 }
            | if opts.parse_special { sys::TANDEM_GENERATE_PARSE_SPECIAL } else { 0 };
        p.sla = match sla {
            Sla::Interactive => sys::TANDEM_SLA_INTERACTIVE,
            Sla::Standard => sys::TANDEM_SLA_STANDARD,
            Sla::Batch => sys::TANDEM_SLA_BATCH,
        };
        p.session = session;
        let mut raw = ptr::null_mut();
        check(unsafe { sys::tandem_scheduler_submit(self.raw, &p, &mut raw) })?;
        Ok(Request { raw, max_tokens: opts.max_tokens.max(1) as usize })
    }

    pub fn drain(&self) -> Result<()> {
        check(unsafe { sys::tandem_scheduler_drain(self.raw) })
    }

    pub fn shutdown(&self) -> Result<()> {
        check(unsafe { sys::tandem_scheduler_shutdown(self.raw) })
    }

    /// The serving metrics as JSON text.
    pub fn metrics_json(&self) -> Result<String> {
        loop {
            let mut n = 0usize;
            check(unsafe { sys::tandem_scheduler_metrics_json(self.raw, ptr::null_mut(), 0, &mut n) })?;
            let mut buf = vec![0u8; n + 256];
            let st = unsafe { sys::tandem_scheduler_metrics_json(self.raw, buf.as_mut_ptr() as *mut c_char, buf.len(), &mut n) };
            if st == sys::TANDEM_E_BUFFER_TOO_SMALL {
                continue;
            }
            check(st)?;
            buf.truncate(n);
            return Ok(String::from_utf8_lossy(&buf).into_owned());
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        unsafe { sys::tandem_scheduler_free(self.raw) };
    }
}

/// One polled event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Token { token: i32, text: String },
    Finish { reason: FinishReason, text: String },
}

impl Request {
    /// The next event without blocking (`None`: nothing new yet).
    pub fn poll(&self) -> Result<Option<Event>> {
        self.take_event(None)
    }

    /// The next event, blocking inside the library until there is one or `timeout_ms`
    /// milliseconds have passed (< 0: no limit); `None` on a timeout. After the finish,
    /// every call returns the finish again at once.
    pub fn next_event(&self, timeout_ms: i32) -> Result<Option<Event>> {
        self.take_event(Some(timeout_ms))
    }

    /// The request's events, each waited for without a limit, ending with its finish.
    pub fn events(&self) -> Events<'_> {
        Events { request: self, done: false }
    }

    fn take_event(&self, timeout_ms: Option<i32>) -> Result<Option<Event>> {
        let mut buf = vec![0u8; 256];
        loop {
            let mut ev: sys::tandem_request_event = init(sys::tandem_request_event_init);
            ev.text = buf.as_mut_ptr() as *mut c_char;
            ev.text_cap = buf.len();
            let st = match timeout_ms {
                None => unsafe { sys::tandem_request_poll(self.raw, &mut ev) },
                Some(t) => unsafe { sys::tandem_request_next_event(self.raw, t, &mut ev) },
            };
            if st == sys::TANDEM_E_BUFFER_TOO_SMALL {
                buf.resize(ev.text_len + 1, 0);
                continue;
            }
            check(st)?;
            let text = String::from_utf8_lossy(&buf[..ev.text_len]).into_owned();
            return Ok(match ev.kind {
                sys::TANDEM_EVENT_TOKEN => Some(Event::Token { token: ev.token, text }),
                sys::TANDEM_EVENT_FINISH => Some(Event::Finish { reason: ev.finish_reason.into(), text }),
                _ => None,
            });
        }
    }

    pub fn cancel(&self) -> Result<()> {
        check(unsafe { sys::tandem_request_cancel(self.raw) })
    }

    /// Block until finished.
    pub fn wait(&self) -> Result<RequestResult> {
        self.wait_timeout(-1).map(|r| r.expect("finished"))
    }

    /// Block up to `timeout_ms` (< 0: without limit); `None` when it has not finished.
    pub fn wait_timeout(&self, timeout_ms: i32) -> Result<Option<RequestResult>> {
        let mut cap = self.max_tokens;
        let mut timeout = timeout_ms;
        loop {
            let mut tokens = vec![0i32; cap];
            let mut text = vec![0u8; cap * 16 + 64];
            let mut r: sys::tandem_request_result = init(sys::tandem_request_result_init);
            r.tokens = tokens.as_mut_ptr();
            r.tokens_cap = tokens.len();
            r.text = text.as_mut_ptr() as *mut c_char;
            r.text_cap = text.len();
            check(unsafe { sys::tandem_request_wait(self.raw, timeout, &mut r) })?;
            if r.finished == 0 {
                return Ok(None);
            }
            if r.n_tokens > r.tokens_cap || r.text_len >= r.text_cap {
                cap = r.n_tokens.max(r.text_len / 16 + 1);
                timeout = 0;
                continue;
            }
            tokens.truncate(r.n_tokens);
            text.truncate(r.text_len);
            return Ok(Some(RequestResult {
                id: r.id,
                finish_reason: r.finish_reason.into(),
                tokens,
                text: String::from_utf8_lossy(&text).into_owned(),
                status: r.status,
                message: cstr_to_string(r.message),
                n_prompt: r.n_prompt,
                ttft_seconds: r.ttft_seconds,
                e2e_seconds: r.e2e_seconds,
            }));
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        unsafe { sys::tandem_request_free(self.raw) };
    }
}

/// Iterator of [`Request::events`]: blocks for each event; the finish is the last item.
pub struct Events<'a> {
    request: &'a Request,
    done: bool,
}

impl Iterator for Events<'_> {
    type Item = Result<Event>;

    fn next(&mut self) -> Option<Result<Event>> {
        if self.done {
            return None;
        }
        let ev = self.request.next_event(-1).transpose()?; // no limit: never None
        self.done = !matches!(ev, Ok(Event::Token { .. }));
        Some(ev)
    }
}

/// Where a scheduler session's KV is ([`SchedulerSession::info`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerSessionInfo {
    /// Tokens of the conversation so far.
    pub n_tokens: i32,
    /// Positions whose KV the session holds.
    pub kv_tokens: i32,
    /// The executor holding its KV (`None`: none, or a request runs on it).
    pub executor: Option<usize>,
    pub busy: bool,
    pub pages_device: i32,
    pub pages_host: i32,
    pub pages_file: i32,
}

/// A conversation the [`Scheduler`] keeps between requests: each [`submit`] appends its
/// prompt and continues where the previous request stopped (nothing recomputed). One
/// request at a time. Closed (its KV released) when dropped.
///
/// [`submit`]: SchedulerSession::submit
pub struct SchedulerSession<'a> {
    scheduler: &'a Scheduler,
    id: u64,
}

impl SchedulerSession<'_> {
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Continue the conversation with `prompt` ("" continues it as it is).
    pub fn submit(&self, prompt: &str, opts: &GenerateOptions, sla: Sla) -> Result<Request> {
        let c = CString::new(prompt).map_err(|_| invalid_arg("the prompt contains NUL"))?;
        self.scheduler.submit_raw(c.as_ptr(), &[], opts, sla, self.id)
    }

    pub fn info(&self) -> Result<SchedulerSessionInfo> {
        let mut i: sys::tandem_scheduler_session_info = init(sys::tandem_scheduler_session_info_init);
        check(unsafe { sys::tandem_scheduler_session_get_info(self.scheduler.raw, self.id, &mut i) })?;
        Ok(SchedulerSessionInfo {
            n_tokens: i.n_tokens,
            kv_tokens: i.kv_tokens,
            executor: usize::try_from(i.executor).ok(),
            busy: i.busy != 0,
            pages_device: i.pages_device,
            pages_host: i.pages_host,
            pages_file: i.pages_file,
        })
    }

    /// Move the session's KV to its executor's File tier ([`ExecutorParams::kv_file_pages`])
    /// until its next request, which brings it back unchanged. Between requests only
    /// (`TANDEM_E_BUSY` while one runs).
    pub fn park(&self) -> Result<()> {
        check(unsafe { sys::tandem_scheduler_session_park(self.scheduler.raw, self.id) })
    }

    /// Bring a parked session's KV back to the compute tier ahead of its next request.
    pub fn unpark(&self) -> Result<()> {
        check(unsafe { sys::tandem_scheduler_session_unpark(self.scheduler.raw, self.id) })
    }
}

impl Drop for SchedulerSession<'_> {
    fn drop(&mut self) {
        unsafe { sys::tandem_scheduler_session_close(self.scheduler.raw, self.id) };
    }
}
