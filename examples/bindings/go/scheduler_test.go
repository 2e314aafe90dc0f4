package tandem

import (
	"strings"
	"testing"
	"time"
)

func mustScheduler(t *testing.T, m *Model, p SchedulerParams) *Scheduler {
	t.Helper()
	s, err := NewScheduler(m, p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// stream reads a request's events with the blocking wait until its finish.
func stream(t *testing.T, r *Request) (ids []int32, text string, finish FinishReason) {
	t.Helper()
	var sb strings.Builder
	for {
		ev, err := r.NextEvent(-1)
		if err != nil {
			t.Fatal(err)
		}
		sb.WriteString(ev.Text)
		switch ev.Kind {
		case EventToken:
			ids = append(ids, ev.Token)
		case EventFinish:
			return ids, sb.String(), ev.Finish
		default:
			t.Fatalf("NextEvent without a limit returned kind %d", ev.Kind)
		}
	}
}

func TestSchedulerStreamsGolden(t *testing.T) {
	c := loadCase(t, "once_upon")
	m := mustModel(t)
	yes, no := true, false
	s := mustScheduler(t, m, SchedulerParams{MaxContext: 256, Executors: []ExecutorParams{
		{NThreads: 1, Accelerator: &yes}, {NThreads: 1, Accelerator: &no}}})
	r, err := s.Submit(c.PromptText, Greedy(64))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ids, text, finish := stream(t, r)
	if finish != FinishLength {
		t.Fatalf("finish %d", finish)
	}
	checkGolden(t, c, ids, text)
	res, err := r.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if res.Text != text || len(res.Tokens) != len(ids) || res.NPrompt != len(c.PromptIDs) {
		t.Fatalf("result %q (%d ids, %d prompt), streamed %q (%d ids)", res.Text, len(res.Tokens), res.NPrompt, text, len(ids))
	}
	// After the finish the finish event repeats, at once.
	if ev, err := r.NextEvent(0); err != nil || ev.Kind != EventFinish {
		t.Fatalf("after the finish: %+v %v", ev, err)
	}
	// Errors are values with the status.
	if _, err := s.Submit("\xff", Greedy(4)); statusOf(err) != StatusInvalidArg {
		t.Fatalf("invalid UTF-8 prompt: %v", err)
	}
}

// A session continued over three requests, parked to the File tier between them, equals
// one long generation: the KV comes back bit-exact.
func TestSchedulerSessionParkedEqualsOneGeneration(t *testing.T) {
	c := loadCase(t, "once_upon")
	m := mustModel(t)
	zero := 0
	s := mustScheduler(t, m, SchedulerParams{MaxContext: 256, PrefixCacheEntries: &zero, Executors: []ExecutorParams{
		{NThreads: 1, MaxRunning: 1, KVFilePages: 64, KVDir: t.TempDir()}}})
	ss, err := s.OpenSession()
	if err != nil {
		t.Fatal(err)
	}
	defer ss.Close()
	var ids []int32
	var text string
	for i, n := range []int{20, 20, 24} {
		prompt := ""
		if i == 0 {
			prompt = c.PromptText
		}
		r, err := ss.Submit(prompt, Greedy(n))
		if err != nil {
			t.Fatal(err)
		}
		got, part, finish := stream(t, r)
		r.Close()
		if finish != FinishLength || len(got) != n {
			t.Fatalf("request %d: %d tokens, finish %d", i, len(got), finish)
		}
		ids, text = append(ids, got...), text+part
		info, err := ss.Info()
		if err != nil {
			t.Fatal(err)
		}
		if info.Busy || info.Executor != 0 || info.PagesHost == 0 || info.PagesFile != 0 ||
			info.NTokens != len(c.PromptIDs)+len(ids) || info.KVTokens != info.NTokens-1 {
			t.Fatalf("after request %d: %+v", i, info)
		}
		if err := ss.Park(); err != nil {
			t.Fatal(err)
		}
		parked, _ := ss.Info()
		if parked.PagesHost != 0 || parked.PagesFile != info.PagesHost {
			t.Fatalf("parked: %+v, before %+v", parked, info)
		}
		if i == 1 {
			if err := ss.Unpark(); err != nil {
				t.Fatal(err)
			}
			if back, _ := ss.Info(); back.PagesHost != info.PagesHost || back.PagesFile != 0 {
				t.Fatalf("unparked: %+v", back)
			}
		}
	}
	checkGolden(t, c, ids, text)
	ss.Close()
	if err := ss.Park(); statusOf(err) != StatusInvalidArg {
		t.Fatalf("park of a closed session: %v", err)
	}
}

// Cancel from another goroutine wakes a goroutine blocked in NextEvent.
func TestCancelWakesABlockedWaiter(t *testing.T) {
	c := loadCase(t, "once_upon")
	m := mustModel(t)
	s := mustScheduler(t, m, SchedulerParams{MaxContext: 256, Executors: []ExecutorParams{{NThreads: 1}}})
	r, err := s.Submit(c.PromptText, Greedy(240))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	type outcome struct {
		finish FinishReason
		err    error
	}
	done := make(chan outcome)
	go func() { // blocks in NextEvent until the finish (t.Fatal is for the test goroutine only)
		for {
			ev, err := r.NextEvent(-1)
			if err != nil || ev.Kind == EventFinish {
				done <- outcome{ev.Finish, err}
				return
			}
		}
	}()
	if err := r.Cancel(); err != nil {
		t.Fatal(err)
	}
	out := <-done
	if out.err != nil {
		t.Fatal(out.err)
	}
	finish := out.finish
	if finish != FinishCancelled && finish != FinishLength {
		t.Fatalf("finish %d", finish)
	}
	res, err := r.Wait()
	if err != nil || res.Finish != finish {
		t.Fatalf("wait: %+v %v", res, err)
	}
	// A timeout returns EventNone only while the request runs; after the finish it is the
	// finish again.
	if ev, err := r.NextEvent(time.Millisecond); err != nil || ev.Kind != EventFinish {
		t.Fatalf("%+v %v", ev, err)
	}
}

// Sessions on one Pool compute on its threads and generate what a session with a pool of
// its own does.
func TestSessionsShareAPool(t *testing.T) {
	c := loadCase(t, "once_upon")
	m := mustModel(t)
	pool, err := NewPool(2)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := pool.NThreads(); err != nil || n != 2 {
		t.Fatalf("NThreads %d %v", n, err)
	}
	if _, err := NewSession(m, SessionParams{NCtx: 256, NThreads: 2, Pool: pool}); statusOf(err) != StatusInvalidArg {
		t.Fatalf("pool and NThreads: %v", err)
	}
	a, err := NewSession(m, SessionParams{NCtx: 256, Pool: pool}) // not mustSession: it sets NThreads
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	pool.Close() // the sessions keep it
	info, err := a.Info()
	if err != nil || info.NThreads != 2 {
		t.Fatalf("%+v %v", info, err)
	}
	r, err := a.Generate(c.PromptText, Greedy(64), nil)
	if err != nil {
		t.Fatal(err)
	}
	checkGolden(t, c, r.Tokens, r.Text)
}
