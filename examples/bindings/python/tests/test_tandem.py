"""Tests of the Python package (examples/bindings/python/tandem): the installed one after
`pip install .`, else the sources with TANDEM_LIB or TANDEM_PREFIX naming the library.
Run with pytest (python3 -m pytest examples/bindings/python/tests) or, with no packages at all,
python3 -m unittest discover examples/bindings/python/tests. Needs the shared data
(TANDEM_SHARED)."""

import gc
import os
import sys
import threading
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # golden.py
try:  # the installed package (pip install .), else the sources next to this folder
    import tandem  # noqa: E402
except ImportError:
    sys.path.insert(1, os.path.dirname(HERE))
    import tandem  # noqa: E402

import golden  # noqa: E402
from tandem import _capi  # noqa: E402


class TandemTestCase(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.case = golden.load_case("once_upon")
        cls.model = tandem.Model(golden.model_path())

    @classmethod
    def tearDownClass(cls):
        cls.model.close()

    def session(self, **kw):
        kw.setdefault("n_threads", 1)
        return tandem.Session(self.model, **kw)


class TestLibrary(TandemTestCase):
    def test_version(self):
        self.assertRegex(tandem.version(), r"^\d+\.\d+\.\d+$")

    def test_struct_layouts_match_the_header(self):
        import ctypes
        if ctypes.sizeof(ctypes.c_void_p) != 8:
            self.skipTest("sizes below are LP64")
        sizes = {"ModelParams": 24, "ModelInfo": 64, "SessionParams": 48, "SessionInfo": 32,
                 "SamplingParams": 48, "GenerateParams": 64, "GenerateResult": 104, "ExecutorParams": 64,
                 "SchedulerParams": 56, "RequestParams": 104, "RequestEvent": 48, "RequestResult": 136,
                 "DeviceInfo": 48, "SchedulerSessionInfo": 40, "TokenLogprob": 172}
        for name, size in sizes.items():
            self.assertEqual(ctypes.sizeof(getattr(_capi, name)), size, name)

    def test_model_info(self):
        info = self.model.info
        self.assertEqual(info.arch, "llama")
        self.assertEqual(info.n_vocab, 512)
        self.assertGreater(info.n_ctx_train, 0)
        self.assertEqual((info.token_bos, info.token_eos), (1, 2))
        self.assertTrue(info.name)
        h = self.model.identity_hash()
        self.assertNotEqual(h, 0)
        self.assertEqual(h, self.model.identity_hash())

    def test_load_failures(self):
        with self.assertRaises(tandem.TandemError) as cm:
            tandem.Model("/nonexistent/model.gguf")
        self.assertEqual(cm.exception.status, tandem.E_IO)
        self.assertEqual(cm.exception.name, "IO")
        self.assertIn("nonexistent", cm.exception.message)

    def test_tokenize_round_trip(self):
        ids = self.model.tokenize(self.case["prompt_text"])
        self.assertEqual(ids, self.case["prompt_ids"])
        self.assertEqual(self.model.detokenize(ids[1:]), self.case["prompt_text"])
        self.assertEqual(self.model.tokenize(""), [1])
        self.assertEqual(self.model.tokenize("", add_special=False), [])
        self.assertEqual(self.model.token_to_piece(1), b"")
        self.assertEqual(self.model.token_to_piece(1, special=True), b"<s>")

    def test_invalid_utf8_and_ids(self):
        for bad in (b"\xff", b"a\xc0\x80", b"\xed\xa0\x80"):
            with self.assertRaises(tandem.TandemError) as cm:
                self.model.tokenize(bad)
            self.assertEqual(cm.exception.status, tandem.E_INVALID_ARG)
        with self.assertRaises(tandem.TandemError) as cm:
            self.model.detokenize([1, 9999])
        self.assertEqual(cm.exception.status, tandem.E_INVALID_ARG)

    def test_closed_handles(self):
        m = tandem.Model(golden.model_path())
        s = tandem.Session(m, n_ctx=32, n_threads=1)
        m.close()
        m.close()  # idempotent in Python; the C double free is tested in C
        with self.assertRaises(tandem.TandemError):
            m.info
        self.assertEqual(s.complete("Hi", max_tokens=3, temperature=0, ignore_eos=True).finish_reason, "length")
        s.close()
        with self.assertRaises(tandem.TandemError) as cm:
            s.reset()
        self.assertEqual(cm.exception.status, tandem.E_INVALID_HANDLE)
        # Freeing a handle twice through the C entry point.
        h = tandem.Model(golden.model_path())
        raw = h.handle
        h.close()
        self.assertEqual(_capi.model_free(raw), tandem.E_INVALID_HANDLE)
        self.assertEqual(_capi.model_free(None), tandem.OK)


class TestGenerate(TandemTestCase):
    def test_streaming_generate_matches_golden(self):
        with self.session() as s:
            gen = s.generate(self.case["prompt_text"], max_tokens=64, temperature=0, ignore_eos=True)
            pieces = list(gen)
            self.assertGreater(len(pieces), 1)
            r = gen.result
            self.assertEqual(r.finish_reason, "length")
            self.assertEqual(r.n_prompt, len(self.case["prompt_ids"]))
            self.assertEqual("".join(pieces), r.text)
            print(golden.check(self.case, r.tokens, r.text))

    def test_token_prompt_matches_text_prompt(self):
        with self.session() as a, self.session() as b:
            ra = a.complete(self.case["prompt_text"], max_tokens=64, temperature=0, ignore_eos=True)
            rb = b.complete(self.case["prompt_ids"], max_tokens=64, temperature=0, ignore_eos=True)
            self.assertEqual(ra.tokens, rb.tokens)
            self.assertEqual(ra.text, rb.text)
            golden.check(self.case, rb.tokens, rb.text)

    def test_callback_stop(self):
        calls = []

        def on_piece(text, token):
            calls.append((text, token))
            return len(calls) >= 3

        with self.session() as s:
            r = s.complete(self.case["prompt_text"], max_tokens=64, temperature=0, on_piece=on_piece)
        self.assertEqual(r.finish_reason, "cancelled")
        self.assertEqual(len(calls), 3)
        self.assertLess(len(r.tokens), 64)

    def test_callback_exception_propagates(self):
        def on_piece(text, token):
            raise ValueError("boom")

        with self.session() as s:
            with self.assertRaises(ValueError):
                s.complete("Hi", max_tokens=8, temperature=0, on_piece=on_piece)
            self.assertEqual(s.complete("", max_tokens=2, temperature=0).n_prompt, 1)  # still usable

    def test_iterator_close_cancels(self):
        with self.session() as s:
            # lookahead 1: the worker cannot run to the end before close() (deterministic)
            gen = s.generate(self.case["prompt_text"], max_tokens=64, temperature=0, ignore_eos=True, lookahead=1)
            first = next(gen)
            self.assertTrue(first)
            gen.close()
            self.assertEqual(gen.result.finish_reason, "cancelled")
            self.assertLess(len(gen.result.tokens), 64)
            s.reset()  # the session is free again

    def test_stop_string(self):
        with self.session() as s:
            full = s.complete(self.case["prompt_text"], max_tokens=64, temperature=0, ignore_eos=True).text
            stop = full[30:35]
            s.reset()
            r = s.complete(self.case["prompt_text"], max_tokens=64, temperature=0, stop=[stop])
        self.assertEqual(r.finish_reason, "stop_string")
        self.assertEqual(r.text, full[: full.index(stop)])

    def test_sampling_seed_and_errors(self):
        outs = []
        for _ in range(2):
            with self.session() as s:
                outs.append(s.complete("Once", max_tokens=24, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                       seed=77, ignore_eos=True).tokens)
        self.assertEqual(outs[0], outs[1])
        with self.session() as s:
            with self.assertRaises(tandem.TandemError) as cm:
                s.complete("Once", temperature=-1)
            self.assertEqual(cm.exception.status, tandem.E_INVALID_ARG)
            self.assertIn("temperature", cm.exception.message)
            with self.assertRaises(tandem.TandemError) as cm:
                s.complete(b"Once \xff", max_tokens=4)
            self.assertEqual(cm.exception.status, tandem.E_INVALID_ARG)
            with self.assertRaises(TypeError):
                s.complete("Once", temprature=0)

    def test_eval_logits_and_overflow(self):
        with self.session(n_ctx=16) as s:
            rows = s.eval(self.case["prompt_ids"], all_logits=True)
            self.assertEqual(len(rows), len(self.case["prompt_ids"]))
            last = rows[-1]
            self.assertEqual(len(last), 512)
            self.assertEqual(max(range(512), key=lambda i: (last[i], -i)), self.case["greedy_ids"][0])
            self.assertEqual(list(s.logits()), list(last))
            self.assertEqual(s.tokens(), self.case["prompt_ids"])
            self.assertTrue(s.info.has_logits)
            with self.assertRaises(tandem.TandemError) as cm:
                s.eval([5] * 10)
            self.assertEqual(cm.exception.status, tandem.E_CONTEXT_OVERFLOW)
            self.assertEqual(s.info.n_tokens, len(self.case["prompt_ids"]))  # unchanged
            r = s.complete("", max_tokens=100, temperature=0, ignore_eos=True)
            self.assertEqual(r.finish_reason, "length")

    def test_session_busy_from_two_threads(self):
        with self.session() as s:
            entered = threading.Event()
            release = threading.Event()
            errors = []

            def on_piece(text, token):
                entered.set()
                release.wait(10)
                return False

            def worker():
                try:
                    s.complete(self.case["prompt_text"], max_tokens=8, temperature=0, on_piece=on_piece)
                except Exception as e:  # pragma: no cover
                    errors.append(e)

            t = threading.Thread(target=worker)
            t.start()
            self.assertTrue(entered.wait(10))
            with self.assertRaises(tandem.TandemError) as cm:
                s.complete("Hello", max_tokens=2)
            self.assertEqual(cm.exception.status, tandem.E_BUSY)
            with self.assertRaises(tandem.TandemError) as cm:
                s.info
            self.assertEqual(cm.exception.status, tandem.E_BUSY)
            self.assertEqual(self.model.tokenize("Hello")[0], 1)  # the model is not busy
            release.set()
            t.join()
            self.assertEqual(errors, [])
            self.assertGreater(s.info.n_tokens, 0)

    def test_parallel_sessions(self):
        results = [None] * 3

        def worker(i):
            with self.session() as s:
                results[i] = s.complete(self.case["prompt_text"], max_tokens=64, temperature=0,
                                        ignore_eos=True).tokens

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(results[0], results[1])
        self.assertEqual(results[1], results[2])
        golden.check(self.case, results[0], self.model.detokenize(results[0]))

    def test_abandoned_iterator_is_cleaned_up(self):
        s = self.session()
        gen = s.generate(self.case["prompt_text"], max_tokens=64, temperature=0, ignore_eos=True)
        next(gen)
        del gen
        gc.collect()
        s.reset()  # not busy: the dropped generation was cancelled and joined
        s.close()


class TestSaveRestore(TandemTestCase):
    def test_round_trip_and_bad_files(self):
        import tempfile
        with tempfile.TemporaryDirectory() as d, self.session(n_ctx=128) as a, \
                self.session(n_ctx=128, n_threads=2) as b:
            path = os.path.join(d, "s.tss")
            a.complete(self.case["prompt_text"], max_tokens=20, temperature=0, ignore_eos=True)
            a.save(path)
            ref = a.complete([], max_tokens=12, temperature=0, ignore_eos=True).tokens
            b.restore(path)
            self.assertEqual(b.complete([], max_tokens=12, temperature=0, ignore_eos=True).tokens, ref)
            # Failures leave the session as it was.
            b.restore(path)
            before = b.tokens()
            with open(path, "rb") as f:
                data = f.read()
            bad = os.path.join(d, "bad.tss")
            for damaged in (data[: len(data) // 2], data[:8], bytes([data[0] ^ 1]) + data[1:],
                            data[:-1] + bytes([data[-1] ^ 0xFF])):
                with open(bad, "wb") as f:
                    f.write(damaged)
                with self.assertRaises(tandem.TandemError) as cm:
                    b.restore(bad)
                self.assertEqual(cm.exception.status, tandem.E_SESSION_CORRUPT)
            with self.assertRaises(tandem.TandemError) as cm:
                b.restore(golden.model_path())  # a foreign file
            self.assertEqual(cm.exception.status, tandem.E_SESSION_CORRUPT)
            with self.assertRaises(tandem.TandemError) as cm:
                b.restore(os.path.join(d, "missing.tss"))
            self.assertEqual(cm.exception.status, tandem.E_IO)
            with self.session(n_ctx=16) as small, self.assertRaises(tandem.TandemError) as cm:
                small.restore(path)
            self.assertEqual(cm.exception.status, tandem.E_CONTEXT_OVERFLOW)
            self.assertEqual(b.tokens(), before)
            self.assertEqual(b.complete([], max_tokens=12, temperature=0, ignore_eos=True).tokens, ref)

    def test_saved_at_a_full_context(self):
        # A session saved with its context full (the last sampled token has no position)
        # restores (it was E_CONTEXT_OVERFLOW) and behaves as the live one.
        import tempfile
        with tempfile.TemporaryDirectory() as d, self.session(n_ctx=32) as a, self.session(n_ctx=32) as b:
            path = os.path.join(d, "full.tss")
            a.complete(self.case["prompt_text"], max_tokens=100, temperature=0, ignore_eos=True)
            self.assertEqual(len(a.tokens()), 32)
            a.save(path)
            b.restore(path)
            self.assertEqual(b.tokens(), a.tokens())
            # Continuing needs a position for the last sampled token: refused in both.
            for s in (a, b):
                with self.assertRaises(tandem.TandemError) as cm:
                    s.complete([], max_tokens=8, temperature=0, ignore_eos=True)
                self.assertEqual(cm.exception.status, tandem.E_CONTEXT_OVERFLOW)
            self.assertEqual(b.tokens(), a.tokens())


class TestScheduler(TandemTestCase):
    def cpu_cpu(self, **kw):
        return tandem.Scheduler(self.model, [tandem.Executor(n_threads=1, accelerator=True),
                                             tandem.Executor(n_threads=1)], max_context=256, **kw)

    def test_two_requests_match_golden(self):
        with self.cpu_cpu() as sched:
            r1 = sched.submit(self.case["prompt_text"], max_tokens=64, temperature=0, ignore_eos=True,
                              sla="interactive")
            r2 = sched.submit(self.case["prompt_ids"], max_tokens=64, temperature=0, ignore_eos=True, sla="batch")
            streamed = r1.text()  # the blocking wait for each event
            a, b = r1.wait(), r2.wait(timeout=60)
            self.assertEqual(a.finish_reason, "length")
            self.assertEqual(a.n_prompt, len(self.case["prompt_ids"]))
            self.assertEqual(streamed, a.text)
            self.assertEqual(a.tokens, b.tokens)
            self.assertEqual(a.text, b.text)
            print(golden.check(self.case, a.tokens, a.text))
            self.assertEqual(r1.poll().kind, "finish")  # again after the finish
            r1.cancel()  # after the finish: no change
            self.assertEqual(r1.wait().finish_reason, "length")
            m = sched.metrics()
            self.assertEqual(m["submitted"], 2)
            self.assertEqual(len(m["executors"]), 2)
            r1.close()
            with self.assertRaises(tandem.TandemError) as cm:
                r1.poll()
            self.assertEqual(cm.exception.status, tandem.E_INVALID_HANDLE)
            r2.close()

    def test_scheduler_session_save_and_restore(self):
        # A scheduler session saved between requests restores as a new session that
        # continues with the live one's ids; the file is a Session file both ways.
        import tempfile
        greedy = dict(temperature=0, ignore_eos=True)
        with tempfile.TemporaryDirectory() as d, \
                tandem.Scheduler(self.model, [tandem.Executor(n_threads=1, kv_file_pages=64)],
                                 max_context=256) as sched:
            path = os.path.join(d, "sched.tss")
            live = sched.open_session()
            first = live.submit(self.case["prompt_text"], max_tokens=20, **greedy).wait()
            live.save(path)
            cont = live.submit("", max_tokens=12, **greedy).wait().tokens
            clear = min(32, golden.clear_prefix(self.case))
            self.assertEqual((first.tokens + cont)[:clear], self.case["greedy_ids"][:clear])
            back = sched.restore_session(path)
            self.assertNotEqual(back.id, live.id)
            info = back.info
            self.assertEqual(info.n_tokens, len(self.case["prompt_ids"]) + 20)
            self.assertEqual(info.kv_tokens, info.n_tokens - 1)
            self.assertEqual(info.executor, 0)
            self.assertEqual(back.submit("", max_tokens=12, **greedy).wait().tokens, cont)
            with self.session(n_ctx=256) as s:
                s.restore(path)
                self.assertEqual(s.complete([], max_tokens=12, **greedy).tokens, cont)
            # Refusals: nothing written, nothing opened.
            with open(path, "rb") as f:
                data = f.read()
            with self.assertRaises(tandem.TandemError) as cm:
                sched.restore_session(path, executor=1)
            self.assertEqual(cm.exception.status, tandem.E_INVALID_ARG)
            bad = os.path.join(d, "bad.tss")
            with open(bad, "wb") as f:
                f.write(data[: len(data) // 2])
            with self.assertRaises(tandem.TandemError) as cm:
                sched.restore_session(bad)
            self.assertEqual(cm.exception.status, tandem.E_SESSION_CORRUPT)
            with self.assertRaises(tandem.TandemError) as cm:
                sched.restore_session(os.path.join(d, "missing.tss"))
            self.assertEqual(cm.exception.status, tandem.E_IO)
            live.close()
            with self.assertRaises(tandem.TandemError) as cm:
                tandem.SchedulerSession(sched, live.id).save(path)  # closed: unknown now
            self.assertEqual(cm.exception.status, tandem.E_INVALID_ARG)
            with open(path, "rb") as f:
                self.assertEqual(f.read(), data)
            back.close()

    def test_cancel_overload_errors_and_close_with_live_requests(self):
        sched = tandem.Scheduler(self.model, [tandem.Executor(n_threads=1, max_running=1)], max_context=256)
        reqs = [sched.submit(self.case["prompt_ids"], max_tokens=240, temperature=0, ignore_eos=True)
                for _ in range(4)]
        last = sched.submit("Once", max_tokens=8)
        last.cancel()
        self.assertEqual(last.wait().finish_reason, "cancelled")
        self.assertIsNone(reqs[-1].wait(timeout=0.001))
        with self.assertRaises(tandem.TandemError) as cm:
            sched.submit("x", sla="urgent")
        self.assertEqual(cm.exception.status, tandem.E_INVALID_ARG)
        with self.assertRaises(tandem.TandemError) as cm:
            sched.submit(b"caf\xc3")
        self.assertEqual(cm.exception.status, tandem.E_INVALID_ARG)
        sched.close()  # cancels the outstanding ones; their handles stay usable
        for r in reqs:
            self.assertIn(r.wait().finish_reason, ("cancelled", "length"))
            r.close()
        with self.assertRaises(tandem.TandemError) as cm:
            reqs[-1].poll()  # closed
        self.assertEqual(cm.exception.status, tandem.E_INVALID_HANDLE)
        with tandem.Scheduler(self.model, [tandem.Executor(n_threads=1)], max_queued=0) as full:
            self.assertEqual(full.submit("Once", max_tokens=4).wait().finish_reason, "overloaded")


if __name__ == "__main__":
    unittest.main()
