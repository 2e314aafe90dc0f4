package tandem

// Tests against the installed libtandem and the shared golden data (TANDEM_SHARED,
// default <repo>/../shared). Standard library only.

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"unsafe"
)

type goldenCase struct {
	Name         string    `json:"name"`
	PromptText   string    `json:"prompt_text"`
	PromptIDs    []int32   `json:"prompt_ids"`
	GreedyIDs    []int32   `json:"greedy_ids"`
	GreedyText   string    `json:"greedy_text"`
	Margins      []float64 `json:"greedy_top1_margin"`
	LogitsMaxAbs float64   `json:"logits_max_abs"`
}

func sharedDir() string {
	if d := os.Getenv("TANDEM_SHARED"); d != "" {
		return d
	}
	wd, _ := os.Getwd()
	return filepath.Join(wd, "..", "..", "..", "..", "shared")
}

func modelPath() string {
	if d := os.Getenv("TANDEM_MODELS"); d != "" {
		return filepath.Join(d, "aidreams260K-q4_0.gguf")
	}
	return filepath.Join(sharedDir(), "models", "aidreams260K-q4_0.gguf")
}

func loadCase(t *testing.T, name string) goldenCase {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(sharedDir(), "golden", "aidreams260K-q4_0", "cases.json"))
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Cases []goldenCase `json:"cases"`
	}
	if err := json.Unmarshal(data, &doc); err != nil {
		t.Fatal(err)
	}
	for _, c := range doc.Cases {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no golden case %q", name)
	return goldenCase{}
}

// checkGolden: ids equal the reference up to the first step whose reference margin is
// within 2e-2 x max|logit| (shared/golden/README.md); all 64 equal -> the text too.
func checkGolden(t *testing.T, c goldenCase, ids []int32, text string) {
	t.Helper()
	tol := 2e-2 * c.LogitsMaxAbs
	clear := 0
	for clear < len(c.Margins) && c.Margins[clear] > tol {
		clear++
	}
	if len(ids) != len(c.GreedyIDs) {
		t.Fatalf("%d ids generated, %d expected", len(ids), len(c.GreedyIDs))
	}
	for i := 0; i < clear; i++ {
		if ids[i] != c.GreedyIDs[i] {
			t.Fatalf("step %d: id %d, golden %d", i, ids[i], c.GreedyIDs[i])
		}
	}
	same := 0
	for same < len(ids) && ids[same] == c.GreedyIDs[same] {
		same++
	}
	if same == len(ids) && text != c.GreedyText {
		t.Fatalf("text %q, golden %q", text, c.GreedyText)
	}
	t.Logf("%d of %d greedy ids equal the golden continuation (%d required)", same, len(ids), clear)
}

func mustModel(t *testing.T) *Model {
	t.Helper()
	m, err := LoadModel(modelPath())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

func mustSession(t *testing.T, m *Model, p SessionParams) *Session {
	t.Helper()
	if p.NThreads == 0 {
		p.NThreads = 1
	}
	s, err := NewSession(m, p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func statusOf(err error) int {
	var te *Error
	if errors.As(err, &te) {
		return te.Status
	}
	return -1
}

func TestModelInfo(t *testing.T) {
	if parts := strings.Split(Version(), "."); len(parts) != 3 {
		t.Fatalf("version %q", Version())
	}
	m := mustModel(t)
	info, err := m.Info()
	if err != nil {
		t.Fatal(err)
	}
	if info.Arch != "llama" || info.NVocab != 512 || info.TokenBOS != 1 || info.TokenEOS != 2 {
		t.Fatalf("info %+v", info)
	}
	h1, _ := m.IdentityHash()
	h2, _ := m.IdentityHash()
	if h1 == 0 || h1 != h2 {
		t.Fatalf("hash %x %x", h1, h2)
	}
}

func TestGenerateMatchesGolden(t *testing.T) {
	c := loadCase(t, "once_upon")
	m := mustModel(t)
	s := mustSession(t, m, SessionParams{})
	var pieces []string
	r, err := s.Generate(c.PromptText, Greedy(64), func(piece string, token int32) bool {
		pieces = append(pieces, piece)
		return false
	})
	if err != nil {
		t.Fatal(err)
	}
	if r.FinishReason != FinishLength || r.NPrompt != len(c.PromptIDs) || len(pieces) < 2 {
		t.Fatalf("result %+v, %d pieces", r, len(pieces))
	}
	if strings.Join(pieces, "") != r.Text {
		t.Fatal("streamed pieces differ from the text")
	}
	checkGolden(t, c, r.Tokens, r.Text)

	s2 := mustSession(t, m, SessionParams{})
	r2, err := s2.GenerateTokens(c.PromptIDs, Greedy(64), nil)
	if err != nil {
		t.Fatal(err)
	}
	if r2.Text != r.Text || len(r2.Tokens) != 64 {
		t.Fatalf("token prompt: %q vs %q", r2.Text, r.Text)
	}
}

func TestTokenizer(t *testing.T) {
	c := loadCase(t, "once_upon")
	m := mustModel(t)
	ids, err := m.Tokenize(c.PromptText, true, false)
	if err != nil || len(ids) != len(c.PromptIDs) {
		t.Fatalf("%v %v", ids, err)
	}
	for i := range ids {
		if ids[i] != c.PromptIDs[i] {
			t.Fatalf("ids %v, golden %v", ids, c.PromptIDs)
		}
	}
	text, err := m.Detokenize(ids[1:], false, false)
	if err != nil || string(text) != c.PromptText {
		t.Fatalf("%q %v", text, err)
	}
	if _, err := m.TokenizeBytes([]byte("bad \xff"), false, false); statusOf(err) != StatusInvalidArg {
		t.Fatalf("invalid UTF-8: %v", err)
	}
	if _, err := m.Detokenize([]int32{1, 9999}, false, false); statusOf(err) != StatusInvalidArg {
		t.Fatalf("bad id: %v", err)
	}
}

func TestErrors(t *testing.T) {
	if _, err := LoadModel("/nonexistent/model.gguf"); statusOf(err) != StatusIO {
		t.Fatalf("missing file: %v", err)
	}
	m := mustModel(t)
	if _, err := NewSession(m, SessionParams{NCtx: -1}); statusOf(err) != StatusInvalidArg {
		t.Fatalf("n_ctx -1: %v", err)
	}
	s := mustSession(t, m, SessionParams{NCtx: 16})
	bad := float32(-1)
	_, err := s.Generate("Once", GenerateOptions{Temperature: &bad}, nil)
	if statusOf(err) != StatusInvalidArg || !strings.Contains(err.Error(), "temperature") {
		t.Fatalf("temperature -1: %v", err)
	}
	if _, err := s.Generate("Once \xff", Greedy(4), nil); statusOf(err) != StatusInvalidArg {
		t.Fatalf("invalid UTF-8 prompt: %v", err)
	}
	if err := s.Eval(make([]int32, 20)); statusOf(err) != StatusContextOverflow {
		t.Fatalf("overflow: %v", err)
	}
	// Closed handles: Close is idempotent, and the raw handle is refused after it.
	m2, _ := LoadModel(modelPath())
	m2.Close()
	m2.Close()
	if _, err := m2.Info(); err == nil {
		t.Fatal("info on a closed model succeeded")
	}
}

func TestCallbackStopAndStopString(t *testing.T) {
	c := loadCase(t, "once_upon")
	m := mustModel(t)
	s := mustSession(t, m, SessionParams{})
	calls := 0
	r, err := s.Generate(c.PromptText, Greedy(64), func(string, int32) bool { calls++; return calls == 3 })
	if err != nil || calls != 3 || r.FinishReason != FinishCancelled || len(r.Tokens) >= 64 {
		t.Fatalf("%v calls %d %+v", err, calls, r)
	}
	s.Reset()
	full, _ := s.Generate(c.PromptText, Greedy(64), nil)
	stop := full.Text[30:35]
	s.Reset()
	opts := Greedy(64)
	opts.Stop = []string{stop}
	r, err = s.Generate(c.PromptText, opts, nil)
	if err != nil || r.FinishReason != FinishStopString || r.Text != full.Text[:strings.Index(full.Text, stop)] {
		t.Fatalf("%v %+v", err, r)
	}
}

func TestAbortFromAnotherGoroutine(t *testing.T) {
	c := loadCase(t, "once_upon")
	m := mustModel(t)
	s := mustSession(t, m, SessionParams{NCtx: 512})
	if err := s.Abort(); err != nil { // nothing running: no effect on the next call
		t.Fatal(err)
	}
	pieces := 0
	// At the 5th piece another goroutine aborts; the callback waits until it has, so the
	// generation must end right there (by token count, not time).
	r, err := s.Generate(c.PromptText, Greedy(400), func(string, int32) bool {
		pieces++
		if pieces == 5 {
			done := make(chan error)
			go func() { done <- s.Abort() }()
			if err := <-done; err != nil {
				t.Error(err)
			}
		}
		return false
	})
	if err != nil || r.FinishReason != FinishCancelled || pieces != 5 || len(r.Tokens) > 8 {
		t.Fatalf("%v pieces %d finish %d tokens %d", err, pieces, r.FinishReason, len(r.Tokens))
	}
	if r, err = s.Generate("", Greedy(3), nil); err != nil || r.FinishReason != FinishLength {
		t.Fatalf("not usable after the abort: %v %+v", err, r)
	}
}

func TestCallbackPanicDoesNotCrossC(t *testing.T) {
	m := mustModel(t)
	s := mustSession(t, m, SessionParams{})
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("the panic was lost")
			}
		}()
		s.Generate("Hi", Greedy(8), func(string, int32) bool { panic("boom") })
	}()
	if err := s.Reset(); err != nil {
		t.Fatal(err)
	}
}

func TestSessionBusyFromTwoGoroutines(t *testing.T) {
	c := loadCase(t, "once_upon")
	m := mustModel(t)
	s := mustSession(t, m, SessionParams{})
	entered := make(chan struct{})
	release := make(chan struct{})
	done := make(chan error)
	go func() {
		first := true
		_, err := s.Generate(c.PromptText, Greedy(8), func(string, int32) bool {
			if first {
				first = false
				close(entered)
				<-release
			}
			return false
		})
		done <- err
	}()
	<-entered
	if _, err := s.Info(); statusOf(err) != StatusBusy {
		t.Fatalf("info while generating: %v", err)
	}
	if _, err := s.Generate("Hello", Greedy(2), nil); statusOf(err) != StatusBusy {
		t.Fatalf("generate while generating: %v", err)
	}
	if _, err := m.Tokenize("Hello", true, false); err != nil {
		t.Fatalf("the model must not be busy: %v", err)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func TestParallelSessionsShareAModel(t *testing.T) {
	c := loadCase(t, "once_upon")
	m := mustModel(t)
	var wg sync.WaitGroup
	results := make([]GenerateResult, 3)
	errs := make([]error, 3)
	for i := 0; i < 3; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			s, err := NewSession(m, SessionParams{NThreads: 1})
			if err != nil {
				errs[i] = err
				return
			}
			defer s.Close()
			results[i], errs[i] = s.Generate(c.PromptText, Greedy(64), nil)
		}(i)
	}
	wg.Wait()
	for i := 0; i < 3; i++ {
		if errs[i] != nil || results[i].Text != results[0].Text {
			t.Fatalf("goroutine %d: %v", i, errs[i])
		}
	}
	checkGolden(t, c, results[0].Tokens, results[0].Text)
}

// Handles are kept in pointer-typed Go variables; their values must not upset the Go
// runtime when it copies a goroutine stack (it aborts on pointers below 4096).
func TestHandlesSurviveStackGrowth(t *testing.T) {
	m := mustModel(t)
	s := mustSession(t, m, SessionParams{NCtx: 32})
	var grow func(n int, h unsafe.Pointer) uintptr
	grow = func(n int, h unsafe.Pointer) uintptr {
		var pad [256]byte
		pad[n%256] = byte(n)
		if n == 0 {
			return uintptr(h) + uintptr(pad[0])
		}
		r := grow(n-1, h) // h stays live across the call: the stack copy sees it
		runtime.KeepAlive(h)
		return r + uintptr(pad[n%256]&0)
	}
	if grow(2000, s.Raw()) == 0 || grow(2000, m.Raw()) == 0 {
		t.Fatal("zero handle")
	}
	if uintptr(s.Raw()) < 4096 || uintptr(m.Raw()) < 4096 {
		t.Fatalf("handle values %p %p below 4096", s.Raw(), m.Raw())
	}
	if _, err := s.Info(); err != nil {
		t.Fatal(err)
	}
}

func TestSessionSaveRestore(t *testing.T) {
	c := loadCase(t, "once_upon")
	m := mustModel(t)
	a := mustSession(t, m, SessionParams{NCtx: 128})
	b := mustSession(t, m, SessionParams{NCtx: 128, NThreads: 2})
	dir := t.TempDir()
	path := filepath.Join(dir, "s.tss")
	if _, err := a.Generate(c.PromptText, Greedy(20), nil); err != nil {
		t.Fatal(err)
	}
	if err := a.Save(path); err != nil {
		t.Fatal(err)
	}
	ref, err := a.GenerateTokens(nil, Greedy(12), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Restore(path); err != nil {
		t.Fatal(err)
	}
	// A damaged file is refused and leaves b as it was.
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	bad := filepath.Join(dir, "bad.tss")
	if err := os.WriteFile(bad, data[:len(data)/2], 0o600); err != nil {
		t.Fatal(err)
	}
	if err := b.Restore(bad); statusOf(err) != StatusSessionCorrupt {
		t.Fatalf("truncated file: %v", err)
	}
	if err := b.Restore(filepath.Join(dir, "missing.tss")); statusOf(err) != StatusIO {
		t.Fatalf("missing file: %v", err)
	}
	got, err := b.GenerateTokens(nil, Greedy(12), nil)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(got.Tokens) != fmt.Sprint(ref.Tokens) || got.Text != ref.Text {
		t.Fatalf("restored continuation %v, saved session's %v", got.Tokens, ref.Tokens)
	}
	b.Close()
	if err := b.Save(path); err == nil {
		t.Fatal("save on a closed session succeeded")
	}
}
