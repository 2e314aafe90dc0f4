package tandem

// The scheduler (many requests, continuous batching, one or more executors), its
// requests with a blocking event wait, scheduler sessions (multi-turn conversations whose
// KV the scheduler keeps, parkable to the File tier) and shared CPU thread pools.

/*
#include <stdlib.h>
#include <tandem.h>
*/
import "C"

import (
	"runtime"
	"time"
	"unsafe"
)

// ---- pools -------------------------------------------------------------------------------

// Pool is a CPU thread pool that sessions and executors share (tandem_pool_create): their
// steps take turns on its threads, so the process never runs more compute threads than
// the pool has. Safe for concurrent use. Closing it early is fine: its users keep it.
type Pool struct{ raw *C.tandem_pool }

// NewPool starts a pool of nThreads threads (0 = one per physical core).
func NewPool(nThreads int) (*Pool, error) {
	var raw *C.tandem_pool
	if err := call(func() C.tandem_status { return C.tandem_pool_create(C.int32_t(nThreads), &raw) }); err != nil {
		return nil, err
	}
	p := &Pool{raw: raw}
	runtime.SetFinalizer(p, func(p *Pool) { p.Close() })
	return p, nil
}

// NThreads is the pool's thread count (the calling thread of a step included).
func (p *Pool) NThreads() (int, error) {
	defer runtime.KeepAlive(p)
	var n C.int32_t
	err := call(func() C.tandem_status { return C.tandem_pool_get_threads(p.raw, &n) })
	return int(n), err
}

// Close releases the handle. Idempotent.
func (p *Pool) Close() error {
	if p.raw == nil {
		return nil
	}
	raw := p.raw
	p.raw = nil
	runtime.SetFinalizer(p, nil)
	return call(func() C.tandem_status { return C.tandem_pool_free(raw) })
}

// ---- scheduler ---------------------------------------------------------------------------

// ExecutorParams describes one CPU executor of a scheduler; zero fields take the library
// defaults (NThreads 0 = the shared node pool, MaxRunning 16, KVPages 0 = room for
// MaxRunning + the prefix cache's sequences). KVFilePages > 0 adds a File tier (in KVDir, "" = the temporary
// directory) that preempted sequences swap to and SchedulerSession.Park parks in.
type ExecutorParams struct {
	NThreads, MaxRunning, KVPages, KVFilePages int
	KVDir                                      string
	Accelerator                                *bool // nil: by kind (a CPU executor is not one)
	Pool                                       *Pool // compute on this pool (NThreads must be 0)
}

// SchedulerParams: Executors (nil = one default executor; "cpu+cpu" is two), MaxQueued
// (0 = library default 1024), MaxContext (0 = the model's, capped at 4096),
// PrefixCacheEntries (nil = library default 4).
type SchedulerParams struct {
	Executors          []ExecutorParams
	MaxQueued          int
	MaxContext         int
	PrefixCacheEntries *int
}

// Scheduler runs requests on one or more executors. Safe for concurrent use. Close
// cancels outstanding requests; their Requests stay usable and report FinishCancelled.
type Scheduler struct{ raw *C.tandem_scheduler }

// NewScheduler creates a scheduler (its executors, KV stores and step-loop threads).
func NewScheduler(m *Model, p SchedulerParams) (*Scheduler, error) {
	defer runtime.KeepAlive(m)
	defer runtime.KeepAlive(p)
	execs := p.Executors
	if len(execs) == 0 {
		execs = []ExecutorParams{{}}
	}
	// The executor array is pointed to by the params struct: C memory (cgo pointer rules).
	size := C.size_t(unsafe.Sizeof(C.tandem_executor_params{}))
	arr := (*[1 << 16]C.tandem_executor_params)(C.calloc(C.size_t(len(execs)), size))[:len(execs):len(execs)]
	defer C.free(unsafe.Pointer(&arr[0]))
	for i, e := range execs {
		c := &arr[i]
		C.tandem_executor_params_init(c, size)
		c.n_threads = C.int32_t(e.NThreads)
		if e.MaxRunning != 0 {
			c.max_running = C.int32_t(e.MaxRunning)
		}
		c.kv_pages = C.int32_t(e.KVPages)
		c.kv_file_pages = C.int32_t(e.KVFilePages)
		if e.KVDir != "" {
			c.kv_dir = C.CString(e.KVDir)
			defer C.free(unsafe.Pointer(c.kv_dir))
		}
		if e.Accelerator != nil {
			c.accelerator = 0
			if *e.Accelerator {
				c.accelerator = 1
			}
		}
		if e.Pool != nil {
			c.pool = e.Pool.raw
		}
	}
	var cp C.tandem_scheduler_params
	C.tandem_scheduler_params_init(&cp, C.size_t(unsafe.Sizeof(cp)))
	cp.executors = &arr[0]
	cp.n_executors = C.size_t(len(execs))
	if p.MaxQueued != 0 {
		cp.max_queued = C.int32_t(p.MaxQueued)
	}
	cp.max_context = C.int32_t(p.MaxContext)
	if p.PrefixCacheEntries != nil {
		cp.prefix_cache_entries = C.int32_t(*p.PrefixCacheEntries)
	}
	var raw *C.tandem_scheduler
	if err := call(func() C.tandem_status { return C.tandem_scheduler_create(m.raw, &cp, &raw) }); err != nil {
		return nil, err
	}
	s := &Scheduler{raw: raw}
	runtime.SetFinalizer(s, func(s *Scheduler) { s.Close() })
	return s, nil
}

// Close shuts the scheduler down (outstanding requests are cancelled). Idempotent.
func (s *Scheduler) Close() error {
	if s.raw == nil {
		return nil
	}
	raw := s.raw
	s.raw = nil
	runtime.SetFinalizer(s, nil)
	return call(func() C.tandem_status { return C.tandem_scheduler_free(raw) })
}

// Submit queues a text prompt (sampling, stop strings and MaxTokens from opts).
func (s *Scheduler) Submit(prompt string, opts GenerateOptions) (*Request, error) {
	return s.submit(prompt, opts, 0)
}

func (s *Scheduler) submit(prompt string, opts GenerateOptions, session uint64) (*Request, error) {
	defer runtime.KeepAlive(s)
	sampling := newSampling(opts)
	defer C.free(unsafe.Pointer(sampling))
	stops, freeStops := cStrings(opts.Stop)
	defer freeStops()
	cprompt := C.CString(prompt)
	defer C.free(unsafe.Pointer(cprompt))
	var rp C.tandem_request_params
	C.tandem_request_params_init(&rp, C.size_t(unsafe.Sizeof(rp)))
	rp.prompt = cprompt
	rp.sampling = sampling
	rp.stop = stops
	rp.n_stop = C.size_t(len(opts.Stop))
	if opts.MaxTokens != 0 {
		rp.max_tokens = C.int32_t(opts.MaxTokens)
	}
	if opts.IgnoreEOS {
		rp.flags |= C.TANDEM_GENERATE_IGNORE_EOS
	}
	if opts.ParseSpecial {
		rp.flags |= C.TANDEM_GENERATE_PARSE_SPECIAL
	}
	rp.session = C.uint64_t(session)
	var raw *C.tandem_request
	if err := call(func() C.tandem_status { return C.tandem_scheduler_submit(s.raw, &rp, &raw) }); err != nil {
		return nil, err
	}
	r := &Request{raw: raw}
	runtime.SetFinalizer(r, func(r *Request) { r.Close() })
	return r, nil
}

// ---- requests ----------------------------------------------------------------------------

// More finish reasons, of scheduled requests only.
const (
	FinishTimeout    FinishReason = 4
	FinishOverloaded FinishReason = 5
	FinishError      FinishReason = 6
)

// EventKind of a streamed request event.
type EventKind int

const (
	EventNone   EventKind = 0 // NextEvent timed out
	EventToken  EventKind = 1 // one generated token and the text it completed (may be "")
	EventFinish EventKind = 2 // the request finished (Finish), with any text flushed at the end
)

// Event is one streamed event of a Request.
type Event struct {
	Kind   EventKind
	Token  int32 // EventToken: the generated id; else -1
	Text   string
	Finish FinishReason // EventFinish only
}

// RequestResult is a finished request's outcome.
type RequestResult struct {
	ID           uint64
	Finish       FinishReason
	Tokens       []int32
	Text         string
	Status       int    // FinishError: the error status
	Message      string // FinishError / FinishOverloaded: why
	NPrompt      int
	TTFTSeconds  float64
	E2ESeconds   float64
	QueueSeconds float64
}

// Request is a submitted request. Safe for concurrent use.
type Request struct{ raw *C.tandem_request }

// NextEvent blocks until the next event or until timeout passes (negative: no limit);
// on a timeout it returns an Event of kind EventNone. The wait sleeps inside the library,
// and a request always ends with one EventFinish (repeated by later calls), so a loop of
// NextEvent(-1) until EventFinish always ends.
func (r *Request) NextEvent(timeout time.Duration) (Event, error) {
	defer runtime.KeepAlive(r)
	ms := C.int32_t(-1)
	if timeout >= 0 {
		ms = C.int32_t(timeout / time.Millisecond)
	}
	capacity := C.size_t(256)
	for {
		buf := (*C.char)(C.malloc(capacity))
		var ev C.tandem_request_event
		C.tandem_request_event_init(&ev, C.size_t(unsafe.Sizeof(ev)))
		ev.text = buf
		ev.text_cap = capacity
		err := call(func() C.tandem_status { return C.tandem_request_next_event(r.raw, ms, &ev) })
		if te, ok := err.(*Error); ok && te.Status == StatusBufferTooSmall { // the event stays first in line
			C.free(unsafe.Pointer(buf))
			capacity = ev.text_len + 1
			continue
		}
		text := C.GoStringN(buf, C.int(ev.text_len))
		C.free(unsafe.Pointer(buf))
		if err != nil {
			return Event{}, err
		}
		return Event{Kind: EventKind(ev.kind), Token: int32(ev.token), Text: text,
			Finish: FinishReason(ev.finish_reason)}, nil
	}
}

// Cancel asks the request to stop; it finishes with FinishCancelled within one step
// unless it had finished already.
func (r *Request) Cancel() error {
	defer runtime.KeepAlive(r)
	return call(func() C.tandem_status { return C.tandem_request_cancel(r.raw) })
}

// Wait blocks until the request has finished and returns its outcome.
func (r *Request) Wait() (RequestResult, error) {
	defer runtime.KeepAlive(r)
	capTokens := 256
	for {
		tokens := (*C.int32_t)(C.calloc(C.size_t(capTokens), 4))
		textCap := capTokens*16 + 64
		text := (*C.char)(C.malloc(C.size_t(textCap)))
		var res C.tandem_request_result
		C.tandem_request_result_init(&res, C.size_t(unsafe.Sizeof(res)))
		res.tokens = tokens
		res.tokens_cap = C.size_t(capTokens)
		res.text = text
		res.text_cap = C.size_t(textCap)
		err := call(func() C.tandem_status { return C.tandem_request_wait(r.raw, -1, &res) })
		n, tl := int(res.n_tokens), int(res.text_len)
		if err == nil && (n > capTokens || tl >= textCap) {
			C.free(unsafe.Pointer(tokens))
			C.free(unsafe.Pointer(text))
			capTokens = n + tl/16 + 1
			continue
		}
		out := RequestResult{ID: uint64(res.id), Finish: FinishReason(res.finish_reason), Status: int(res.status),
			NPrompt: int(res.n_prompt), TTFTSeconds: float64(res.ttft_seconds), E2ESeconds: float64(res.e2e_seconds),
			QueueSeconds: float64(res.queue_seconds)}
		if err == nil {
			out.Tokens = make([]int32, n)
			if n > 0 {
				copy(out.Tokens, (*[1 << 28]int32)(unsafe.Pointer(tokens))[:n:n])
			}
			out.Text = C.GoStringN(text, C.int(tl))
			out.Message = C.GoString(res.message)
		}
		C.free(unsafe.Pointer(tokens))
		C.free(unsafe.Pointer(text))
		return out, err
	}
}

// Close releases the request (cancelling it if it has not finished). Idempotent.
func (r *Request) Close() error {
	if r.raw == nil {
		return nil
	}
	raw := r.raw
	r.raw = nil
	runtime.SetFinalizer(r, nil)
	return call(func() C.tandem_status { return C.tandem_request_free(raw) })
}

// ---- scheduler sessions ------------------------------------------------------------------

// SchedulerSession is a conversation whose KV the scheduler keeps between requests: each
// Submit appends its prompt and continues where the last request stopped (nothing is
// recomputed). One request at a time.
type SchedulerSession struct {
	s  *Scheduler
	id uint64
}

// SchedulerSessionInfo says where a session's KV is.
type SchedulerSessionInfo struct {
	NTokens, KVTokens int  // conversation tokens; positions whose KV the session holds
	Executor          int  // executor holding the KV; -1 = none
	Busy              bool // a request runs on it
	PagesDevice       int
	PagesHost         int
	PagesFile         int
}

// OpenSession opens a scheduler session.
func (s *Scheduler) OpenSession() (*SchedulerSession, error) {
	defer runtime.KeepAlive(s)
	var id C.uint64_t
	if err := call(func() C.tandem_status { return C.tandem_scheduler_session_open(s.raw, &id) }); err != nil {
		return nil, err
	}
	return &SchedulerSession{s: s, id: uint64(id)}, nil
}

// ID is the scheduler's session id.
func (ss *SchedulerSession) ID() uint64 { return ss.id }

// Submit continues the conversation with prompt ("" continues it as it is).
func (ss *SchedulerSession) Submit(prompt string, opts GenerateOptions) (*Request, error) {
	return ss.s.submit(prompt, opts, ss.id)
}

// Info reports where the session's KV is.
func (ss *SchedulerSession) Info() (SchedulerSessionInfo, error) {
	defer runtime.KeepAlive(ss.s)
	var i C.tandem_scheduler_session_info
	C.tandem_scheduler_session_info_init(&i, C.size_t(unsafe.Sizeof(i)))
	err := call(func() C.tandem_status { return C.tandem_scheduler_session_get_info(ss.s.raw, C.uint64_t(ss.id), &i) })
	return SchedulerSessionInfo{NTokens: int(i.n_tokens), KVTokens: int(i.kv_tokens), Executor: int(i.executor),
		Busy: i.busy != 0, PagesDevice: int(i.pages_device), PagesHost: int(i.pages_host),
		PagesFile: int(i.pages_file)}, err
}

// Park moves the session's KV to its executor's File tier (ExecutorParams.KVFilePages)
// until its next request, which brings it back unchanged. Between requests only
// (StatusBusy otherwise).
func (ss *SchedulerSession) Park() error {
	defer runtime.KeepAlive(ss.s)
	return call(func() C.tandem_status { return C.tandem_scheduler_session_park(ss.s.raw, C.uint64_t(ss.id)) })
}

// Unpark brings a parked session's KV back to the compute tier ahead of its next request.
func (ss *SchedulerSession) Unpark() error {
	defer runtime.KeepAlive(ss.s)
	return call(func() C.tandem_status { return C.tandem_scheduler_session_unpark(ss.s.raw, C.uint64_t(ss.id)) })
}

// Close releases the session's KV. Idempotent.
func (ss *SchedulerSession) Close() error {
	defer runtime.KeepAlive(ss.s)
	if ss.s.raw == nil {
		return nil
	}
	return call(func() C.tandem_status { return C.tandem_scheduler_session_close(ss.s.raw, C.uint64_t(ss.id)) })
}
