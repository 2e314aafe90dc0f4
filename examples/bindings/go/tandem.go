// Package tandem is a cgo binding of the Tandem C ABI (tandem.h).
//
// Build against an installed library with pkg-config or plain flags:
//
//	CGO_CFLAGS="$(pkg-config --cflags tandem)" CGO_LDFLAGS="$(pkg-config --libs tandem)" go test
//	CGO_CFLAGS=-I$PREFIX/include CGO_LDFLAGS="-L$PREFIX/lib -Wl,-rpath,$PREFIX/lib" go test
//
// A Model is safe for concurrent use; a Session serves one call at a time (a concurrent
// call fails with StatusBusy). Memory handed to the library during a call (parameter
// structs, buffers) is C memory, as cgo's pointer rules require.
package tandem

/*
#cgo LDFLAGS: -ltandem
#include <stdlib.h>
#include <string.h>
#include <tandem.h>

// The exported Go callback (callback.go) and helpers that hand it, with a cgo.Handle as
// user_data, to the library. (A file with //export may only declare in its preamble, so
// these definitions live here.)
extern int goTandemPiece(char* piece, size_t len, int32_t token, void* user_data);

static tandem_status tandem_go_generate(tandem_session* s, const char* prompt, const tandem_generate_params* p,
                                        uintptr_t handle, tandem_generate_result* r) {
  return tandem_session_generate(s, prompt, p, (tandem_token_callback)goTandemPiece, (void*)handle, r);
}

static tandem_status tandem_go_generate_tokens(tandem_session* s, const int32_t* ids, size_t n,
                                               const tandem_generate_params* p, uintptr_t handle,
                                               tandem_generate_result* r) {
  return tandem_session_generate_tokens(s, ids, n, p, (tandem_token_callback)goTandemPiece, (void*)handle, r);
}
*/
import "C"

import (
	"fmt"
	"runtime"
	"runtime/cgo"
	"unsafe"
)

// Status codes (tandem.h).
const (
	StatusOK              = 0
	StatusInvalidArg      = 1
	StatusIO              = 2
	StatusOutOfMemory     = 3
	StatusContextOverflow = 50
	StatusSessionCorrupt  = 70
	StatusSessionModel    = 71 // SESSION_MODEL_MISMATCH
	StatusSessionVersion  = 72
	StatusInternal        = 99
	StatusInvalidHandle   = 100
	StatusBusy            = 101
	StatusBufferTooSmall  = 102
)

// Error is a failed call: the status, its name and the library's message.
type Error struct {
	Status  int
	Name    string
	Message string
}

func (e *Error) Error() string { return fmt.Sprintf("%s (%d): %s", e.Name, e.Status, e.Message) }

// StatusName is the stable name of a status ("OK", "INVALID_ARG", "BUSY", ...).
func StatusName(status int) string { return C.GoString(C.tandem_status_name(C.tandem_status(status))) }

// check turns a status into an error. The last-error message is per OS thread, so callers
// must hold the OS thread (runtime.LockOSThread) from the call to here.
func check(st C.tandem_status) error {
	if st == C.TANDEM_OK {
		return nil
	}
	return &Error{Status: int(st), Name: StatusName(int(st)), Message: C.GoString(C.tandem_last_error())}
}

// call runs f on one locked OS thread, so that the thread-local last error read by check
// belongs to f's call.
func call(f func() C.tandem_status) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return check(f())
}

// Version is the loaded library's version ("MAJOR.MINOR.PATCH").
func Version() string { return C.GoString(C.tandem_version()) }

// ---- model ---------------------------------------------------------------------------

// ModelInfo describes a loaded model.
type ModelInfo struct {
	Arch, Name                         string
	NVocab, NCtxTrain, NEmbd, NLayer   int
	NHead, NHeadKV, TokenBOS, TokenEOS int
	WeightBytes                        uint64
}

// Model is an immutable loaded GGUF model.
type Model struct{ raw *C.tandem_model }

// LoadModel loads and validates a GGUF file.
func LoadModel(path string) (*Model, error) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var raw *C.tandem_model
	if err := call(func() C.tandem_status { return C.tandem_model_load(cpath, nil, &raw) }); err != nil {
		return nil, err
	}
	m := &Model{raw: raw}
	runtime.SetFinalizer(m, func(m *Model) { m.Close() })
	return m, nil
}

// Close releases the handle (sessions made from it keep working). Idempotent.
func (m *Model) Close() error {
	if m.raw == nil {
		return nil
	}
	raw := m.raw
	m.raw = nil
	runtime.SetFinalizer(m, nil)
	return call(func() C.tandem_status { return C.tandem_model_free(raw) })
}

// Raw is the C handle (nil after Close).
func (m *Model) Raw() unsafe.Pointer { return unsafe.Pointer(m.raw) }

// Info returns the model's hyper-parameters and names.
func (m *Model) Info() (ModelInfo, error) {
	var i C.tandem_model_info
	C.tandem_model_info_init(&i, C.size_t(unsafe.Sizeof(i)))
	if err := call(func() C.tandem_status { return C.tandem_model_get_info(m.raw, &i) }); err != nil {
		return ModelInfo{}, err
	}
	defer runtime.KeepAlive(m)
	return ModelInfo{
		Arch: C.GoString(i.arch), Name: C.GoString(i.name),
		NVocab: int(i.n_vocab), NCtxTrain: int(i.n_ctx_train), NEmbd: int(i.n_embd), NLayer: int(i.n_layer),
		NHead: int(i.n_head), NHeadKV: int(i.n_head_kv), TokenBOS: int(i.token_bos), TokenEOS: int(i.token_eos),
		WeightBytes: uint64(i.weight_bytes),
	}, nil
}

// IdentityHash is the hash of the weights and hyper-parameters.
func (m *Model) IdentityHash() (uint64, error) {
	var h C.uint64_t
	err := call(func() C.tandem_status { return C.tandem_model_identity_hash(m.raw, &h) })
	runtime.KeepAlive(m)
	return uint64(h), err
}

// Tokenize returns the token ids of text.
func (m *Model) Tokenize(text string, addSpecial, parseSpecial bool) ([]int32, error) {
	return m.TokenizeBytes([]byte(text), addSpecial, parseSpecial)
}

// TokenizeBytes tokenizes raw bytes (invalid UTF-8 is refused with StatusInvalidArg).
func (m *Model) TokenizeBytes(text []byte, addSpecial, parseSpecial bool) ([]int32, error) {
	defer runtime.KeepAlive(m)
	var flags C.uint32_t
	if addSpecial {
		flags |= C.TANDEM_TOKENIZE_ADD_SPECIAL
	}
	if parseSpecial {
		flags |= C.TANDEM_TOKENIZE_PARSE_SPECIAL
	}
	var tp *C.char
	if len(text) > 0 {
		tp = (*C.char)(unsafe.Pointer(&text[0]))
	}
	var n C.size_t
	if err := call(func() C.tandem_status {
		return C.tandem_tokenize(m.raw, tp, C.size_t(len(text)), flags, nil, 0, &n)
	}); err != nil {
		return nil, err
	}
	out := make([]int32, int(n)+1)
	if err := call(func() C.tandem_status {
		return C.tandem_tokenize(m.raw, tp, C.size_t(len(text)), flags, (*C.int32_t)(unsafe.Pointer(&out[0])), n, &n)
	}); err != nil {
		return nil, err
	}
	return out[:n], nil
}

// Detokenize returns the bytes of ids (possibly invalid UTF-8, e.g. half a character).
func (m *Model) Detokenize(ids []int32, removeSpecial, unparseSpecial bool) ([]byte, error) {
	defer runtime.KeepAlive(m)
	var flags C.uint32_t
	if removeSpecial {
		flags |= C.TANDEM_DETOKENIZE_REMOVE_SPECIAL
	}
	if unparseSpecial {
		flags |= C.TANDEM_DETOKENIZE_UNPARSE_SPECIAL
	}
	var ip *C.int32_t
	if len(ids) > 0 {
		ip = (*C.int32_t)(unsafe.Pointer(&ids[0]))
	}
	var n C.size_t
	if err := call(func() C.tandem_status {
		return C.tandem_detokenize(m.raw, ip, C.size_t(len(ids)), flags, nil, 0, &n)
	}); err != nil {
		return nil, err
	}
	buf := make([]byte, int(n)+1)
	if err := call(func() C.tandem_status {
		return C.tandem_detokenize(m.raw, ip, C.size_t(len(ids)), flags, (*C.char)(unsafe.Pointer(&buf[0])), n+1, &n)
	}); err != nil {
		return nil, err
	}
	return buf[:n], nil
}

// ---- session -------------------------------------------------------------------------

// SessionParams configures a session; zero fields take the library defaults
// (NCtx 0 = the model's, capped at 4096; NThreads 0 = the process-wide pool of one thread
// per physical core, shared by every session and executor made with 0). Pool: compute on
// this shared Pool instead (NThreads must be 0).
type SessionParams struct {
	NCtx, NBatch, PageSize, NThreads int
	Pool                             *Pool
}

// Abort stops the generation running on s (called from another goroutine): it ends within
// one prefill chunk or one token with FinishCancelled, and the session stays usable. With
// no generation running it does nothing.
func (s *Session) Abort() error {
	defer runtime.KeepAlive(s)
	return call(func() C.tandem_status { return C.tandem_session_abort(s.raw) })
}

// SessionInfo describes a session's state.
type SessionInfo struct {
	NCtx, NTokens, NBatch, PageSize, NThreads int
	HasLogits                                 bool
}

// Session is one conversation with its own CPU executor.
type Session struct {
	raw    *C.tandem_session
	nVocab int
}

// NewSession creates a session on model.
func NewSession(m *Model, p SessionParams) (*Session, error) {
	defer runtime.KeepAlive(m)
	var cp C.tandem_session_params
	C.tandem_session_params_init(&cp, C.size_t(unsafe.Sizeof(cp)))
	cp.n_ctx = C.int32_t(p.NCtx)
	if p.NBatch != 0 {
		cp.n_batch = C.int32_t(p.NBatch)
	}
	if p.PageSize != 0 {
		cp.page_size = C.int32_t(p.PageSize)
	}
	cp.n_threads = C.int32_t(p.NThreads)
	if p.Pool != nil {
		cp.pool = p.Pool.raw
	}
	defer runtime.KeepAlive(p.Pool)
	var raw *C.tandem_session
	if err := call(func() C.tandem_status { return C.tandem_session_create(m.raw, &cp, &raw) }); err != nil {
		return nil, err
	}
	info, err := m.Info()
	if err != nil {
		C.tandem_session_free(raw)
		return nil, err
	}
	s := &Session{raw: raw, nVocab: info.NVocab}
	runtime.SetFinalizer(s, func(s *Session) { s.Close() })
	return s, nil
}

// Close releases the session. Idempotent.
func (s *Session) Close() error {
	if s.raw == nil {
		return nil
	}
	raw := s.raw
	s.raw = nil
	runtime.SetFinalizer(s, nil)
	return call(func() C.tandem_status { return C.tandem_session_free(raw) })
}

// Raw is the C handle (nil after Close).
func (s *Session) Raw() unsafe.Pointer { return unsafe.Pointer(s.raw) }

// Info returns the session's state.
func (s *Session) Info() (SessionInfo, error) {
	defer runtime.KeepAlive(s)
	var i C.tandem_session_info
	C.tandem_session_info_init(&i, C.size_t(unsafe.Sizeof(i)))
	if err := call(func() C.tandem_status { return C.tandem_session_get_info(s.raw, &i) }); err != nil {
		return SessionInfo{}, err
	}
	return SessionInfo{NCtx: int(i.n_ctx), NTokens: int(i.n_tokens), NBatch: int(i.n_batch),
		PageSize: int(i.page_size), NThreads: int(i.n_threads), HasLogits: i.has_logits != 0}, nil
}

// Save writes the conversation (tokens, KV cache, sampler state) to path atomically.
func (s *Session) Save(path string) error {
	defer runtime.KeepAlive(s)
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	return call(func() C.tandem_status { return C.tandem_session_save(s.raw, cpath) })
}

// Restore replaces the conversation with the one saved in path. On any error
// (StatusIO, StatusSessionCorrupt, StatusSessionVersion, StatusSessionModel,
// StatusContextOverflow) the session is unchanged.
func (s *Session) Restore(path string) error {
	defer runtime.KeepAlive(s)
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	return call(func() C.tandem_status { return C.tandem_session_restore(s.raw, cpath) })
}

// Reset forgets the conversation.
func (s *Session) Reset() error {
	defer runtime.KeepAlive(s)
	return call(func() C.tandem_status { return C.tandem_session_reset(s.raw) })
}

// Eval appends ids to the conversation.
func (s *Session) Eval(ids []int32) error {
	defer runtime.KeepAlive(s)
	var ip *C.int32_t
	if len(ids) > 0 {
		ip = (*C.int32_t)(unsafe.Pointer(&ids[0]))
	}
	return call(func() C.tandem_status { return C.tandem_session_eval(s.raw, ip, C.size_t(len(ids)), nil, 0) })
}

// Logits returns the logits after the last evaluated token (empty before any).
func (s *Session) Logits() ([]float32, error) {
	defer runtime.KeepAlive(s)
	var n C.size_t
	if err := call(func() C.tandem_status { return C.tandem_session_get_logits(s.raw, nil, 0, &n) }); err != nil {
		return nil, err
	}
	out := make([]float32, int(n)+1)
	err := call(func() C.tandem_status {
		return C.tandem_session_get_logits(s.raw, (*C.float)(unsafe.Pointer(&out[0])), n, &n)
	})
	return out[:n], err
}

// GenerateOptions: zero values of the pointer fields keep the library defaults.
type GenerateOptions struct {
	MaxTokens                              int // 0 = library default (128)
	Temperature, TopP, MinP, RepeatPenalty *float32
	TopK, RepeatLastN                      *int32
	FrequencyPenalty, PresencePenalty      *float32
	Seed                                   *uint64
	Stop                                   []string
	IgnoreEOS, ParseSpecial                bool
}

// Greedy returns options for greedy decoding of maxTokens tokens past end-of-generation.
func Greedy(maxTokens int) GenerateOptions {
	t := float32(0)
	return GenerateOptions{MaxTokens: maxTokens, Temperature: &t, IgnoreEOS: true}
}

// FinishReason of a generation.
type FinishReason int

const (
	FinishStop       FinishReason = 0
	FinishStopString FinishReason = 1
	FinishLength     FinishReason = 2
	FinishCancelled  FinishReason = 3
)

// GenerateResult of a generation.
type GenerateResult struct {
	Text            string // the streamed text
	Tokens          []int32
	FinishReason    FinishReason
	NPrompt         int
	PromptSeconds   float64
	GenerateSeconds float64
}

// Generate generates from a text prompt, streaming pieces to onPiece (may be nil);
// onPiece returning true stops the generation (FinishCancelled).
func (s *Session) Generate(prompt string, opts GenerateOptions, onPiece func(piece string, token int32) bool) (GenerateResult, error) {
	return s.generate(&prompt, nil, opts, onPiece)
}

// GenerateTokens is Generate with the prompt as token ids.
func (s *Session) GenerateTokens(ids []int32, opts GenerateOptions, onPiece func(piece string, token int32) bool) (GenerateResult, error) {
	return s.generate(nil, ids, opts, onPiece)
}

func cAlloc[T any]() *T {
	var zero T
	return (*T)(C.calloc(1, C.size_t(unsafe.Sizeof(zero))))
}

// newSampling returns opts' sampling parameters in C memory (free with C.free).
func newSampling(opts GenerateOptions) *C.tandem_sampling_params {
	sampling := cAlloc[C.tandem_sampling_params]()
	C.tandem_sampling_params_init(sampling, C.size_t(unsafe.Sizeof(*sampling)))
	if opts.Temperature != nil {
		sampling.temperature = C.float(*opts.Temperature)
	}
	if opts.TopK != nil {
		sampling.top_k = C.int32_t(*opts.TopK)
	}
	if opts.TopP != nil {
		sampling.top_p = C.float(*opts.TopP)
	}
	if opts.MinP != nil {
		sampling.min_p = C.float(*opts.MinP)
	}
	if opts.RepeatPenalty != nil {
		sampling.repeat_penalty = C.float(*opts.RepeatPenalty)
	}
	if opts.RepeatLastN != nil {
		sampling.repeat_last_n = C.int32_t(*opts.RepeatLastN)
	}
	if opts.FrequencyPenalty != nil {
		sampling.frequency_penalty = C.float(*opts.FrequencyPenalty)
	}
	if opts.PresencePenalty != nil {
		sampling.presence_penalty = C.float(*opts.PresencePenalty)
	}
	if opts.Seed != nil {
		sampling.seed = C.uint64_t(*opts.Seed)
	}
	return sampling
}

// cStrings copies ss into a C array of C strings; free releases all of it.
func cStrings(ss []string) (arr **C.char, free func()) {
	if len(ss) == 0 {
		return nil, func() {}
	}
	ptrs := (*[1 << 20]*C.char)(C.calloc(C.size_t(len(ss)), C.size_t(unsafe.Sizeof((*C.char)(nil)))))[:len(ss):len(ss)]
	for i, st := range ss {
		ptrs[i] = C.CString(st)
	}
	return &ptrs[0], func() {
		for _, p := range ptrs {
			C.free(unsafe.Pointer(p))
		}
		C.free(unsafe.Pointer(&ptrs[0]))
	}
}

func (s *Session) generate(text *string, ids []int32, opts GenerateOptions, onPiece func(string, int32) bool) (GenerateResult, error) {
	defer runtime.KeepAlive(s)
	// Everything the library reads during the call lives in C memory (cgo pointer rules).
	sampling := newSampling(opts)
	defer C.free(unsafe.Pointer(sampling))
	params := cAlloc[C.tandem_generate_params]()
	defer C.free(unsafe.Pointer(params))
	C.tandem_generate_params_init(params, C.size_t(unsafe.Sizeof(*params)))
	params.sampling = sampling
	if opts.MaxTokens != 0 {
		params.max_tokens = C.int32_t(opts.MaxTokens)
	}
	if opts.IgnoreEOS {
		params.flags |= C.TANDEM_GENERATE_IGNORE_EOS
	}
	if opts.ParseSpecial {
		params.flags |= C.TANDEM_GENERATE_PARSE_SPECIAL
	}
	if len(opts.Stop) > 0 {
		stops := (*[1 << 20]*C.char)(C.calloc(C.size_t(len(opts.Stop)), C.size_t(unsafe.Sizeof((*C.char)(nil)))))[:len(opts.Stop):len(opts.Stop)]
		for i, st := range opts.Stop {
			stops[i] = C.CString(st)
		}
		defer func() {
			for _, p := range stops {
				C.free(unsafe.Pointer(p))
			}
			C.free(unsafe.Pointer(&stops[0]))
		}()
		params.stop = &stops[0]
		params.n_stop = C.size_t(len(opts.Stop))
	}
	capTokens := int(params.max_tokens)
	if capTokens < 1 {
		capTokens = 1
	}
	tokens := (*C.int32_t)(C.calloc(C.size_t(capTokens), 4))
	defer C.free(unsafe.Pointer(tokens))
	result := cAlloc[C.tandem_generate_result]()
	defer C.free(unsafe.Pointer(result))
	C.tandem_generate_result_init(result, C.size_t(unsafe.Sizeof(*result)))
	result.tokens = tokens
	result.tokens_cap = C.size_t(capTokens)

	sink := &pieceSink{onPiece: onPiece}
	handle := cgo.NewHandle(sink)
	defer handle.Delete()
	var err error
	if text != nil {
		ctext := C.CString(*text)
		defer C.free(unsafe.Pointer(ctext))
		err = call(func() C.tandem_status {
			return C.tandem_go_generate(s.raw, ctext, params, C.uintptr_t(handle), result)
		})
	} else {
		cids := (*C.int32_t)(C.calloc(C.size_t(len(ids)+1), 4))
		defer C.free(unsafe.Pointer(cids))
		C.memcpy(unsafe.Pointer(cids), unsafe.Pointer(&append(ids, 0)[0]), C.size_t(4*len(ids)))
		err = call(func() C.tandem_status {
			return C.tandem_go_generate_tokens(s.raw, cids, C.size_t(len(ids)), params, C.uintptr_t(handle), result)
		})
	}
	if sink.panic != nil {
		panic(sink.panic)
	}
	if err != nil {
		return GenerateResult{}, err
	}
	n := int(result.n_tokens)
	if n > capTokens {
		n = capTokens
	}
	out := make([]int32, n)
	copy(out, (*[1 << 28]int32)(unsafe.Pointer(tokens))[:n:n])
	return GenerateResult{Text: string(sink.text), Tokens: out, FinishReason: FinishReason(result.finish_reason),
		NPrompt: int(result.n_prompt), PromptSeconds: float64(result.prompt_seconds),
		GenerateSeconds: float64(result.generate_seconds)}, nil
}
