//! Tests of the Rust bindings against the installed libtandem and the shared golden data
//! (TANDEM_SHARED, default <repo>/../shared). No crates: a small JSON reader is below.

use std::collections::BTreeMap;
use std::os::raw::{c_char, c_int, c_void};
use std::path::PathBuf;
use std::ptr;
use std::sync::{Arc, Condvar, Mutex};

use tandem::{
    sys, Event, ExecutorParams, FinishReason, GenerateOptions, Model, Pool, Request, Scheduler, SchedulerParams, Session,
    SessionParams, Sla,
};

// ---- a minimal JSON reader (enough for cases.json) ------------------------------------

#[derive(Debug, Clone)]
#[allow(dead_code)]
enum Json {
    Null,
    Bool(bool),
    Num(f64),
    Str(String),
    Arr(Vec<Json>),
    Obj(BTreeMap<String, Json>),
}

impl Json {
    fn get(&self, key: &str) -> &Json {
        match self {
            Json::Obj(m) => m.get(key).unwrap_or_else(|| panic!("no key {key}")),
            _ => panic!("not an object"),
        }
    }
    fn arr(&self) -> &[Json] {
        match self {
            Json::Arr(a) => a,
            _ => panic!("not an array"),
        }
    }
    fn num(&self) -> f64 {
        match self {
            Json::Num(n) => *n,
            _ => panic!("not a number"),
        }
    }
    fn str(&self) -> &str {
        match self {
            Json::Str(s) => s,
            _ => panic!("not a string"),
        }
    }
    fn ints(&self) -> Vec<i32> {
        self.arr().iter().map(|v| v.num() as i32).collect()
    }
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl<'a> Parser<'a> {
    fn ws(&mut self) {
        while self.i < self.s.len() && (self.s[self.i] as char).is_ascii_whitespace() {
            self.i += 1;
        }
    }
    fn eat(&mut self, c: u8) {
        self.ws();
        assert_eq!(self.s[self.i], c, "JSON: expected {} at {}", c as char, self.i);
        self.i += 1;
    }
    fn hex4(&mut self) -> u32 {
        let h = std::str::from_utf8(&self.s[self.i..self.i + 4]).unwrap();
        self.i += 4;
        u32::from_str_radix(h, 16).unwrap()
    }
    fn string(&mut self) -> String {
        self.eat(b'"');
        let mut out: Vec<u8> = Vec::new();
        loop {
            let c = self.s[self.i];
            self.i += 1;
            match c {
                b'"' => break,
                b'\\' => {
                    let e = self.s[self.i];
                    self.i += 1;
                    match e {
                        b'n' => out.push(b'\n'),
                        b't' => out.push(b'\t'),
                        b'r' => out.push(b'\r'),
                        b'b' => out.push(8),
                        b'f' => out.push(12),
                        b'u' => {
                            let mut cp = self.hex4();
                            if (0xD800..0xDC00).contains(&cp) && self.s[self.i] == b'\\' && self.s[self.i + 1] == b'u' {
                                self.i += 2;
                                let lo = self.hex4();
                                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                            }
                            let ch = char::from_u32(cp).unwrap_or('\u{FFFD}');
                            let mut b = [0u8; 4];
                            out.extend_from_slice(ch.encode_utf8(&mut b).as_bytes());
                        }
                        other => out.push(other),
                    }
                }
                other => out.push(other),
            }
        }
        String::from_utf8(out).unwrap()
    }
    fn value(&mut self) -> Json {
        self.ws();
        match self.s[self.i] {
            b'{' => {
                self.i += 1;
                let mut m = BTreeMap::new();
                self.ws();
                if self.s[self.i] == b'}' {
                    self.i += 1;
                    return Json::Obj(m);
                }
                loop {
                    let k = self.string();
                    self.eat(b':');
                    let v = self.value();
                    m.insert(k, v);
                    self.ws();
                    let c = self.s[self.i];
                    self.i += 1;
                    if c == b'}' {
                        return Json::Obj(m);
                    }
                }
            }
            b'[' => {
                self.i += 1;
                let mut a = Vec::new();
                self.ws();
                if self.s[self.i] == b']' {
                    self.i += 1;
                    return Json::Arr(a);
                }
                loop {
                    a.push(self.value());
                    self.ws();
                    let c = self.s[self.i];
                    self.i += 1;
                    if c == b']' {
                        return Json::Arr(a);
                    }
                }
            }
            b'"' => Json::Str(self.string()),
            b't' => {
                self.i += 4;
                Json::Bool(true)
            }
            b'f' => {
                self.i += 5;
                Json::Bool(false)
            }
            b'n' => {
                self.i += 4;
                Json::Null
            }
            _ => {
                let start = self.i;
                while self.i < self.s.len() && b"+-.eE0123456789".contains(&self.s[self.i]) {
                    self.i += 1;
                }
                Json::Num(std::str::from_utf8(&self.s[start..self.i]).unwrap().parse().unwrap())
            }
        }
    }
}

// ---- data ---------------------------------------------------------------------------------

fn shared_dir() -> PathBuf {
    match std::env::var_os("TANDEM_SHARED") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../../../shared"),
    }
}

fn model_path() -> PathBuf {
    match std::env::var_os("TANDEM_MODELS") {
        Some(p) if !p.is_empty() => PathBuf::from(p).join("aidreams260K-q4_0.gguf"),
        _ => shared_dir().join("models/aidreams260K-q4_0.gguf"),
    }
}

struct Case {
    prompt_text: String,
    prompt_ids: Vec<i32>,
    greedy_ids: Vec<i32>,
    greedy_text: String,
    margins: Vec<f64>,
    logits_max_abs: f64,
}

fn golden_case(name: &str) -> Case {
    let path = shared_dir().join("golden/aidreams260K-q4_0/cases.json");
    let text = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let doc = Parser { s: &text, i: 0 }.value();
    let c = doc.get("cases").arr().iter().find(|c| c.get("name").str() == name).expect("case");
    Case {
        prompt_text: c.get("prompt_text").str().to_string(),
        prompt_ids: c.get("prompt_ids").ints(),
        greedy_ids: c.get("greedy_ids").ints(),
        greedy_text: c.get("greedy_text").str().to_string(),
        margins: c.get("greedy_top1_margin").arr().iter().map(Json::num).collect(),
        logits_max_abs: c.get("logits_max_abs").num(),
    }
}

/// The golden rule (shared/golden/README.md): ids equal up to the first step whose reference
/// margin is within 2e-2 x max|logit|; when all 64 agree, the text must too.
fn check_golden(case: &Case, ids: &[i32], text: &str) {
    let tol = 2e-2 * case.logits_max_abs;
    let clear = case.margins.iter().take_while(|m| **m > tol).count();
    assert_eq!(ids.len(), case.greedy_ids.len());
    assert_eq!(&ids[..clear], &case.greedy_ids[..clear], "first {clear} greedy ids");
    let same = ids.iter().zip(&case.greedy_ids).take_while(|(a, b)| a == b).count();
    if same == case.greedy_ids.len() {
        assert_eq!(text, case.greedy_text);
    }
    println!("{same} of {} greedy ids equal the golden continuation ({clear} required)", ids.len());
}

fn greedy(max_tokens: i32) -> GenerateOptions {
    GenerateOptions { max_tokens, temperature: Some(0.0), ignore_eos: true, ..Default::default() }
}

fn one_thread() -> SessionParams {
    SessionParams { n_threads: 1, ..Default::default() }
}

// ---- tests ----------------------------------------------------------------------------------

#[test]
fn struct_layouts_match_the_header() {
    // tandem.h on LP64 (the C test checks the same numbers).
    use std::mem::size_of;
    assert_eq!(size_of::<sys::tandem_model_params>(), 16);
    assert_eq!(size_of::<sys::tandem_model_info>(), 64);
    assert_eq!(size_of::<sys::tandem_session_params>(), 48);
    assert_eq!(size_of::<sys::tandem_session_info>(), 32);
    assert_eq!(size_of::<sys::tandem_sampling_params>(), 48);
    assert_eq!(size_of::<sys::tandem_generate_params>(), 40);
    assert_eq!(size_of::<sys::tandem_generate_result>(), 80);
    assert_eq!(size_of::<sys::tandem_executor_params>(), 64);
    assert_eq!(size_of::<sys::tandem_scheduler_params>(), 56);
    assert_eq!(size_of::<sys::tandem_request_params>(), 80);
    assert_eq!(size_of::<sys::tandem_scheduler_session_info>(), 40);
    assert_eq!(size_of::<sys::tandem_request_event>(), 48);
    assert_eq!(size_of::<sys::tandem_request_result>(), 112);
}

#[test]
fn version_and_model_info() {
    assert_eq!(tandem::version().split('.').count(), 3);
    let model = Model::load(model_path()).unwrap();
    let info = model.info().unwrap();
    assert_eq!(info.arch, "llama");
    assert_eq!(info.n_vocab, 512);
    assert_eq!((info.token_bos, info.token_eos), (1, 2));
    let h = model.identity_hash().unwrap();
    assert_ne!(h, 0);
    assert_eq!(h, model.identity_hash().unwrap());
}

#[test]
fn generate_streams_the_golden_continuation() {
    let case = golden_case("once_upon");
    let model = Model::load(model_path()).unwrap();
    let mut session = Session::new(&model, &one_thread()).unwrap();
    let mut pieces = Vec::new();
    let r = session
        .generate(&case.prompt_text, &greedy(64), |piece, _tok| {
            pieces.push(piece.to_string());
            false
        })
        .unwrap();
    assert_eq!(r.finish_reason, FinishReason::Length);
    assert_eq!(r.n_prompt as usize, case.prompt_ids.len());
    assert!(pieces.len() > 1);
    assert_eq!(pieces.concat(), r.text);
    check_golden(&case, &r.tokens, &r.text);

    // The token-id prompt gives the same continuation.
    let mut s2 = Session::new(&model, &one_thread()).unwrap();
    let r2 = s2.generate_tokens(&case.prompt_ids, &greedy(64), |_, _| false).unwrap();
    assert_eq!(r2.tokens, r.tokens);
    assert_eq!(r2.text, r.text);
}

#[test]
fn tokenizer_round_trip_and_utf8() {
    let case = golden_case("once_upon");
    let model = Model::load(model_path()).unwrap();
    let ids = model.tokenize(&case.prompt_text, true, false).unwrap();
    assert_eq!(ids, case.prompt_ids);
    assert_eq!(model.detokenize(&ids[1..], false, false).unwrap(), case.prompt_text.as_bytes());
    assert_eq!(model.token_to_piece(1, true).unwrap(), b"<s>");
    let err = model.tokenize_bytes(b"bad \xff byte", false, false).unwrap_err();
    assert_eq!(err.status, sys::TANDEM_E_INVALID_ARG);
    assert!(err.message.contains("UTF-8"), "{err}");
    let err = model.detokenize(&[1, 4096], false, false).unwrap_err();
    assert_eq!(err.status, sys::TANDEM_E_INVALID_ARG);
}

#[test]
fn errors_are_values() {
    let err = Model::load("/nonexistent/model.gguf").err().unwrap();
    assert_eq!(err.status, sys::TANDEM_E_IO);
    assert_eq!(err.name, "IO");
    let model = Model::load(model_path()).unwrap();
    let bad = SessionParams { n_ctx: -1, ..Default::default() };
    assert_eq!(Session::new(&model, &bad).err().unwrap().status, sys::TANDEM_E_INVALID_ARG);
    let mut s = Session::new(&model, &SessionParams { n_ctx: 16, n_threads: 1, ..Default::default() }).unwrap();
    let opts = GenerateOptions { temperature: Some(-1.0), ..Default::default() };
    let err = s.generate("Once", &opts, |_, _| false).unwrap_err();
    assert_eq!(err.status, sys::TANDEM_E_INVALID_ARG);
    assert!(err.message.contains("temperature"), "{err}");
    let err = s.eval(&[5; 20]).unwrap_err();
    assert_eq!(err.status, sys::TANDEM_E_CONTEXT_OVERFLOW);
    assert_eq!(s.info().unwrap().n_tokens, 0);
    assert!(s.generate("a\0b", &greedy(2), |_, _| false).is_err());
}

#[test]
fn callback_stop_and_panic() {
    let case = golden_case("once_upon");
    let model = Model::load(model_path()).unwrap();
    let mut s = Session::new(&model, &one_thread()).unwrap();
    let mut calls = 0;
    let r = s
        .generate(&case.prompt_text, &greedy(64), |_, _| {
            calls += 1;
            calls == 3
        })
        .unwrap();
    assert_eq!(calls, 3);
    assert_eq!(r.finish_reason, FinishReason::Cancelled);
    assert!(r.tokens.len() < 64);

    // A panic in the callback does not cross C; it resumes after the call.
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = s.generate("Hi", &greedy(8), |_, _| panic!("boom"));
    }));
    assert!(caught.is_err());
    s.reset().unwrap();
    assert_eq!(s.generate("Hi", &greedy(4), |_, _| false).unwrap().tokens.len(), 4);
}

#[test]
fn eval_logits_match_first_greedy_token() {
    let case = golden_case("once_upon");
    let model = Model::load(model_path()).unwrap();
    let mut s = Session::new(&model, &one_thread()).unwrap();
    let logits = s.eval_logits(&case.prompt_ids).unwrap();
    let last = &logits[(case.prompt_ids.len() - 1) * 512..];
    let argmax = (0..512).fold(0usize, |b, i| if last[i] > last[b] { i } else { b });
    assert_eq!(argmax as i32, case.greedy_ids[0]);
    assert_eq!(s.logits().unwrap(), last);
    assert_eq!(s.tokens().unwrap(), case.prompt_ids);
    assert!(s.info().unwrap().has_logits);
}

#[test]
fn raw_double_free_and_null() {
    let path = std::ffi::CString::new(model_path().to_str().unwrap()).unwrap();
    let mut m: *mut sys::tandem_model = ptr::null_mut();
    unsafe {
        assert_eq!(sys::tandem_model_load(path.as_ptr(), ptr::null(), &mut m), sys::TANDEM_OK);
        assert_eq!(sys::tandem_model_free(m), sys::TANDEM_OK);
        assert_eq!(sys::tandem_model_free(m), sys::TANDEM_E_INVALID_HANDLE);
        assert_eq!(sys::tandem_model_free(ptr::null_mut()), sys::TANDEM_OK);
        assert_eq!(sys::tandem_session_free(ptr::null_mut()), sys::TANDEM_OK);
        assert_eq!(sys::tandem_session_reset(ptr::null_mut()), sys::TANDEM_E_INVALID_ARG);
        let mut h = 0u64;
        assert_eq!(sys::tandem_model_identity_hash(m, &mut h), sys::TANDEM_E_INVALID_HANDLE);
    }
}

// A session used from two threads at once through the raw API: the second call is refused
// with TANDEM_E_BUSY while the first is inside its callback.
struct Gate {
    state: Mutex<(bool, bool)>, // (entered, release)
    cv: Condvar,
}

unsafe extern "C" fn blocking(_p: *const c_char, _n: usize, _t: i32, ud: *mut c_void) -> c_int {
    let gate = &*(ud as *const Gate);
    let mut g = gate.state.lock().unwrap();
    g.0 = true;
    gate.cv.notify_all();
    while !g.1 {
        g = gate.cv.wait(g).unwrap();
    }
    0
}

struct SendPtr(*mut sys::tandem_session);
unsafe impl Send for SendPtr {}

#[test]
fn session_busy_from_two_threads() {
    let case = golden_case("once_upon");
    let model = Model::load(model_path()).unwrap();
    let session = Session::new(&model, &one_thread()).unwrap();
    let gate = Arc::new(Gate { state: Mutex::new((false, false)), cv: Condvar::new() });
    let raw = SendPtr(session.as_ptr());
    let prompt = std::ffi::CString::new(case.prompt_text.clone()).unwrap();
    let g2 = Arc::clone(&gate);
    let worker = std::thread::spawn(move || {
        let raw = raw;
        let mut params: sys::tandem_generate_params = unsafe { std::mem::zeroed() };
        unsafe { sys::tandem_generate_params_init(&mut params, std::mem::size_of_val(&params)) };
        params.max_tokens = 8;
        unsafe {
            sys::tandem_session_generate(raw.0, prompt.as_ptr(), &params, Some(blocking),
                                         Arc::as_ptr(&g2) as *mut c_void, ptr::null_mut())
        }
    });
    {
        let mut g = gate.state.lock().unwrap();
        while !g.0 {
            g = gate.cv.wait(g).unwrap();
        }
    }
    let err = session.info().unwrap_err();
    assert_eq!(err.status, sys::TANDEM_E_BUSY);
    let hi = std::ffi::CString::new("Hi").unwrap();
    let st = unsafe {
        sys::tandem_session_generate(session.as_ptr(), hi.as_ptr(), ptr::null(), None, ptr::null_mut(), ptr::null_mut())
    };
    assert_eq!(st, sys::TANDEM_E_BUSY);
    assert!(model.tokenize("Hi", true, false).is_ok()); // the model is not busy
    {
        let mut g = gate.state.lock().unwrap();
        g.1 = true;
        gate.cv.notify_all();
    }
    assert_eq!(worker.join().unwrap(), sys::TANDEM_OK);
    assert!(session.info().unwrap().n_tokens > 0);
}

#[test]
fn sessions_in_parallel_threads_share_a_model() {
    let case = golden_case("once_upon");
    let model = Model::load(model_path()).unwrap();
    let results: Vec<Vec<i32>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..3)
            .map(|_| {
                scope.spawn(|| {
                    let mut s = Session::new(&model, &one_thread()).unwrap();
                    s.generate(&case.prompt_text, &greedy(64), |_, _| false).unwrap().tokens
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(results[0], results[1]);
    assert_eq!(results[1], results[2]);
    let text = String::from_utf8_lossy(&model.detokenize(&results[0], false, false).unwrap()).into_owned();
    check_golden(&case, &results[0], &text);
}

#[test]
fn scheduler_cpu_cpu_submit_and_wait_equal_golden() {
    let case = golden_case("once_upon");
    let model = Model::load(model_path()).unwrap();
    let one = |accel: bool| ExecutorParams { n_threads: 1, accelerator: Some(accel), ..Default::default() };
    let params = SchedulerParams { executors: vec![one(true), one(false)], max_context: 256, ..Default::default() };
    let sched = Scheduler::new(&model, &params).unwrap();
    let a = sched.submit(&case.prompt_text, &greedy(64), Sla::Interactive).unwrap();
    let b = sched.submit_tokens(&case.prompt_ids, &greedy(64), Sla::Batch).unwrap();
    let ra = a.wait().unwrap();
    let rb = b.wait().unwrap();
    assert_eq!(ra.finish_reason, FinishReason::Length);
    assert_eq!(ra.n_prompt as usize, case.prompt_ids.len());
    assert_eq!(ra.tokens, rb.tokens);
    assert_eq!(ra.text, rb.text);
    check_golden(&case, &ra.tokens, &ra.text);
    // Polling after the finish: every token event, then the finish, then the finish again.
    let mut streamed = String::new();
    let mut n = 0;
    loop {
        match a.poll().unwrap() {
            Some(Event::Token { text, .. }) => {
                streamed.push_str(&text);
                n += 1;
            }
            Some(Event::Finish { reason, text }) => {
                assert_eq!(reason, FinishReason::Length);
                streamed.push_str(&text);
                break;
            }
            None => std::thread::sleep(std::time::Duration::from_millis(1)),
        }
    }
    assert_eq!(n, 64);
    assert_eq!(streamed, ra.text);
    assert!(matches!(a.poll().unwrap(), Some(Event::Finish { .. })));
    a.cancel().unwrap(); // after the finish: no change
    assert_eq!(a.wait().unwrap().finish_reason, FinishReason::Length);
    assert!(sched.metrics_json().unwrap().contains("\"submitted\""));
    drop(sched); // the requests outlive it
    assert_eq!(b.wait().unwrap().tokens, ra.tokens);
}

/// Stream a request with the blocking wait; returns (ids, text, finish).
fn stream(r: &Request) -> (Vec<i32>, String, FinishReason) {
    let (mut ids, mut text, mut finish) = (Vec::new(), String::new(), None);
    for ev in r.events() {
        match ev.unwrap() {
            Event::Token { token, text: t } => {
                ids.push(token);
                text.push_str(&t);
            }
            Event::Finish { reason, text: t } => {
                text.push_str(&t);
                finish = Some(reason);
            }
        }
    }
    (ids, text, finish.expect("the last event is the finish"))
}

#[test]
fn scheduler_session_parked_between_requests_equals_one_generation() {
    let case = golden_case("once_upon");
    let model = Model::load(model_path()).unwrap();
    let dir = std::env::temp_dir().join(format!("tandem-rust-park-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ex = ExecutorParams { n_threads: 1, max_running: 1, kv_file_pages: 64, kv_dir: Some(dir.clone()), ..Default::default() };
    let params = SchedulerParams { executors: vec![ex], max_context: 256, prefix_cache_entries: 0, ..Default::default() };
    let sched = Scheduler::new(&model, &params).unwrap();
    {
        let conv = sched.open_session().unwrap();
        assert_eq!(conv.info().unwrap().executor, None);
        let (mut ids, mut text) = (Vec::new(), String::new());
        for (i, n) in [20, 20, 24].into_iter().enumerate() {
            let prompt = if i == 0 { case.prompt_text.as_str() } else { "" };
            let r = conv.submit(prompt, &greedy(n), Sla::Interactive).unwrap();
            let (got, part, finish) = stream(&r);
            assert_eq!((got.len(), finish), (n as usize, FinishReason::Length));
            ids.extend(got);
            text.push_str(&part);
            let info = conv.info().unwrap();
            assert_eq!(info.executor, Some(0));
            assert_eq!(info.n_tokens as usize, case.prompt_ids.len() + ids.len());
            assert_eq!(info.kv_tokens, info.n_tokens - 1);
            assert!(info.pages_host > 0 && info.pages_file == 0 && !info.busy);
            conv.park().unwrap(); // every page to the File tier
            let parked = conv.info().unwrap();
            assert_eq!((parked.pages_host, parked.pages_file), (0, info.pages_host));
            if i == 1 {
                conv.unpark().unwrap();
                let back = conv.info().unwrap();
                assert_eq!((back.pages_host, back.pages_file), (info.pages_host, 0));
            }
        }
        check_golden(&case, &ids, &text);
    } // dropped: closed
    let r = sched.submit(&case.prompt_text, &greedy(4), Sla::Standard).unwrap();
    assert_eq!(stream(&r).2, FinishReason::Length);
    drop(sched);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn cancel_wakes_a_thread_blocked_on_next_event() {
    let case = golden_case("once_upon");
    let model = Model::load(model_path()).unwrap();
    let params = SchedulerParams {
        executors: vec![ExecutorParams { n_threads: 1, ..Default::default() }],
        max_context: 256,
        ..Default::default()
    };
    let sched = Scheduler::new(&model, &params).unwrap();
    let r = sched.submit(&case.prompt_text, &greedy(240), Sla::Standard).unwrap();
    let finish = std::thread::scope(|scope| {
        let waiter = scope.spawn(|| stream(&r).2);
        r.cancel().unwrap();
        waiter.join().unwrap()
    });
    assert!(matches!(finish, FinishReason::Cancelled | FinishReason::Length), "{finish:?}");
    assert_eq!(r.wait().unwrap().finish_reason, finish);
    // After the finish the finish again, at once, whatever the timeout.
    assert!(matches!(r.next_event(1).unwrap(), Some(Event::Finish { .. })));
}

#[test]
fn abort_from_another_thread_stops_a_generation() {
    let case = golden_case("once_upon");
    let model = Model::load(model_path()).unwrap();
    let mut session = Session::new(&model, &SessionParams { n_ctx: 256, n_threads: 1, ..Default::default() }).unwrap();
    let abort = session.abort_handle();
    let stale = session.abort_handle();
    let (to_aborter, aborter_rx) = std::sync::mpsc::channel::<()>();
    let (to_gen, gen_rx) = std::sync::mpsc::channel::<()>();
    let aborter = std::thread::spawn(move || {
        aborter_rx.recv().unwrap();
        abort.abort().unwrap();
        to_gen.send(()).unwrap();
    });
    let mut pieces = 0;
    // The first piece waits until the other thread has aborted: the generation is running
    // then, and must end at the next token.
    let r = session
        .generate(&case.prompt_text, &greedy(200), |_, _| {
            pieces += 1;
            if pieces == 1 {
                to_aborter.send(()).unwrap();
                gen_rx.recv().unwrap();
            }
            false
        })
        .unwrap();
    aborter.join().unwrap();
    assert_eq!(r.finish_reason, FinishReason::Cancelled);
    assert!(r.tokens.len() < 200, "{} tokens", r.tokens.len());
    // The session stays usable and the abort does not outlive the call.
    let r2 = session.generate("", &greedy(4), |_, _| false).unwrap();
    assert_eq!((r2.tokens.len(), r2.finish_reason), (4, FinishReason::Length));
    drop(session);
    // The handle of a dropped session is refused by the library, never used.
    assert_eq!(stale.abort().err().unwrap().status, sys::TANDEM_E_INVALID_HANDLE);
}

#[test]
fn sessions_on_one_pool_generate_what_a_pool_of_their_own_does() {
    let case = golden_case("once_upon");
    let model = Model::load(model_path()).unwrap();
    let pool = Pool::new(2).unwrap();
    assert_eq!(pool.n_threads().unwrap(), 2);
    let params = SessionParams { n_ctx: 256, n_threads: 0, ..Default::default() };
    let bad = SessionParams { n_threads: 2, ..params.clone() };
    assert_eq!(Session::with_pool(&model, &bad, &pool).err().unwrap().status, sys::TANDEM_E_INVALID_ARG);
    let mut a = Session::with_pool(&model, &params, &pool).unwrap();
    let mut b = Session::with_pool(&model, &params, &pool).unwrap();
    drop(pool); // the sessions keep it
    assert_eq!(a.info().unwrap().n_threads, 2);
    let (ra, rb) = std::thread::scope(|scope| {
        let ta = scope.spawn(|| a.generate(&case.prompt_text, &greedy(64), |_, _| false).unwrap());
        let tb = scope.spawn(|| b.generate(&case.prompt_text, &greedy(64), |_, _| false).unwrap());
        (ta.join().unwrap(), tb.join().unwrap())
    });
    assert_eq!(ra.tokens, rb.tokens);
    check_golden(&case, &ra.tokens, &ra.text);
}
