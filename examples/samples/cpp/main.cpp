// tandem-sample-cpp: a C++ program outside the Tandem project that uses only the installed
// tandem.hpp (the header-only RAII layer over the C ABI) and libtandem. It walks the whole
// API -- devices and executors, a cpu+cpu scheduler with requests waited for, polled and
// streamed, a scheduler session parked, saved and restored, a Session saved and restored,
// evaluated and its logits read, tokenizer, metadata, chat templates, logging -- and
// checks each result against another way of computing it (a restored session continues
// with the same greedy tokens as the unsaved one, the scheduler's greedy tokens are the
// Session's, the argmax of the logits is the greedy token, ...). Exits 1 on any mismatch.
//
//   tandem-sample-cpp MODEL.gguf ["Once upon a time"] [N_TOKENS] [--ids]
//
// With --ids stdout is the greedy continuation as examples/samples/c/generate.c prints it
// (the ids on the first line, then the text), which scripts/test-ffi checks against the
// golden continuation; otherwise the prompt and its continuation. Progress goes to stderr.
#include <tandem.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "MISMATCH: %s\n", what.c_str());
  }
}

// Runs `fn`, which must throw tandem::c::Error with `status`.
template <class Fn>
void expect_error(tandem_status status, const std::string& what, Fn&& fn) {
  try {
    fn();
    expect(false, what + ": no error");
  } catch (const tandem::c::Error& e) {
    expect(e.status() == status,
           what + ": expected " + std::string(tandem::c::status_name(status)) + ", got " + e.what());
  }
}

// The greedy choice: the largest logit, the lowest id on ties (as the sampler picks).
int32_t argmax(const float* row, size_t n) {
  return int32_t(std::max_element(row, row + n) - row);
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s MODEL.gguf [PROMPT] [N_TOKENS] [--ids]\n", argv[0]);
    return 2;
  }
  bool print_ids = false;
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--ids") == 0)
      print_ids = true;
    else
      args.emplace_back(argv[i]);
  }
  const std::string path = args[0];
  const std::string prompt = args.size() > 1 ? args[1] : "Once upon a time";
  const int32_t n = args.size() > 2 ? std::atoi(args[2].c_str()) : 64;
  if (n < 2) {
    std::fprintf(stderr, "N_TOKENS must be at least 2\n");
    return 2;
  }
  namespace tc = tandem::c;
  try {
    // ---- library, errors, log ------------------------------------------------------------
    expect(tc::version() == TANDEM_VERSION_STRING, "library version " + tc::version() + " is the header's");
    expect(tc::version_number() == TANDEM_VERSION_NUMBER, "version number");
    expect(tc::status_name(TANDEM_E_IO) == "IO", "status name of TANDEM_E_IO");
    expect_error(TANDEM_E_IO, "loading a missing file", [] { tc::Model missing("/nonexistent/model.gguf"); });
    expect(tc::last_error().find("/nonexistent/model.gguf") != std::string::npos,
           "the last error names the file: " + tc::last_error());
    std::mutex log_mutex;
    std::vector<std::string> log_lines;
    tc::set_log(
        [&](int32_t, std::string_view line) {
          std::lock_guard<std::mutex> lock(log_mutex);
          log_lines.emplace_back(line);
        },
        TANDEM_LOG_INFO);
    expect_error(TANDEM_E_INVALID_ARG, "a log level out of range", [] { tc::set_log({}, 7); });

    // ---- devices -----------------------------------------------------------------------------
    const std::vector<tandem_device_info> devices = tc::devices();
    expect(!devices.empty() && devices.size() == tc::device_count(), "devices() lists device_count() devices");
    expect(devices[0].kind == TANDEM_DEVICE_CPU && std::string(devices[0].name) == "cpu", "device 0 is the CPU");
    expect_error(TANDEM_E_INVALID_ARG, "a device index out of range", [&] { tc::device_info(devices.size()); });

    // ---- model: info, metadata, tokenizer, chat ------------------------------------------------
    const tc::Model model(path);
    const tandem_model_info info = model.info();
    const size_t n_vocab = size_t(info.n_vocab);
    expect(model.meta("general.architecture") == info.arch, "general.architecture is info().arch");
    expect(model.identity_hash() != 0 && model.identity_hash() == tc::Model(path).identity_hash(),
           "the identity hash of the same file twice");
    bool keys_ok = model.meta_count() > 0;
    for (size_t i = 0; i < model.meta_count(); ++i) keys_ok = keys_ok && !model.meta(model.meta_key(i)).empty();
    expect(keys_ok, "every metadata key has a value");
    expect_error(TANDEM_E_INVALID_ARG, "an absent metadata key", [&] { model.meta("no.such.key"); });

    const std::vector<int32_t> ids = model.tokenize(prompt);
    const std::vector<int32_t> ids_plain = model.tokenize(prompt, 0);
    expect(info.token_bos < 0 || (!ids.empty() && ids[0] == info.token_bos), "tokenize adds BOS");
    expect(ids.size() >= ids_plain.size() && std::equal(ids_plain.rbegin(), ids_plain.rend(), ids.rbegin()),
           "the ids with BOS end with the ids without");
    std::string pieces;
    for (int32_t id : ids_plain) pieces += model.token_to_piece(id);
    // llama.cpp's rules: without a BOS the space a SentencePiece vocabulary puts before the
    // first word is dropped; REMOVE_SPECIAL drops the BOS and keeps that space.
    expect(model.detokenize(ids_plain) == prompt, "detokenize(tokenize(prompt)) is the prompt");
    expect(model.detokenize(ids, TANDEM_DETOKENIZE_REMOVE_SPECIAL) == pieces,
           "detokenize with REMOVE_SPECIAL is the concatenated pieces");
    expect(model.tokenize(model.detokenize(ids_plain), 0) == ids_plain, "detokenize then tokenize");

    const std::vector<tc::ChatMessage> chat = {{"system", "Be brief."}, {"user", "Hi"}};
    const std::string rendered = model.chat_render(chat);
    const std::string request_json =
        R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]})";
    expect(rendered.find("Be brief.") != std::string::npos && rendered.find("Hi") != std::string::npos,
           "the rendered chat holds the messages");
    expect(model.chat_apply_template(request_json) == rendered, "apply_template of the same messages renders the same");
    expect(model.chat_apply_template_tokens(request_json) == model.chat_tokenize(chat),
           "apply_template_tokens of the same messages gives the same ids");
    expect(model.chat_render(chat, false, "chatml").size() < model.chat_render(chat, true, "chatml").size(),
           "add_assistant adds the assistant's opening");
    expect_error(TANDEM_E_INVALID_ARG, "an unknown template name", [&] { model.chat_render(chat, true, "nope"); });
    expect(model.chat_parse_tool_calls("no calls here").find("\"tool_calls\": []") != std::string::npos ||
               model.chat_parse_tool_calls("no calls here").find("\"tool_calls\":[]") != std::string::npos,
           "text without a call has no tool calls: " + model.chat_parse_tool_calls("no calls here"));
    std::fprintf(stderr, "model: %s (%s), %zu vocab, %zu metadata keys, prompt %zu ids\n", info.name, info.arch,
                 n_vocab, model.meta_count(), ids.size());

    // ---- sessions: generate, save/restore, eval and logits ------------------------------------
    tandem_session_params sp = tc::session_params();
    sp.n_threads = 1;
    tandem_sampling_params greedy = tc::sampling_params();
    greedy.temperature = 0.0f;
    tandem_generate_params gp = tc::generate_params();
    gp.sampling = &greedy;
    gp.max_tokens = n;
    gp.flags = TANDEM_GENERATE_IGNORE_EOS;

    tc::Session session(model, sp);
    std::string streamed;
    const tc::GenerateResult golden = session.generate(prompt, gp, [&](std::string_view piece) {
      streamed += piece;
      return true;
    });
    expect(golden.tokens.size() == size_t(n) && golden.finish_reason == TANDEM_FINISH_LENGTH,
           "generate gives N tokens, finish LENGTH");
    expect(streamed == golden.text, "the streamed pieces are the text");
    expect(golden.n_prompt == int32_t(ids.size()), "generate evaluated the tokenized prompt");

    tc::Session from_ids(model, sp);
    expect(from_ids.generate_tokens(ids, gp).tokens == golden.tokens, "generate_tokens(tokenize(prompt))");

    // Half, save, restore into another session, the other half: the same tokens as in one go,
    // and as the saved session going on.
    tandem_generate_params half = gp;
    half.max_tokens = n / 2;
    tandem_generate_params rest = gp;
    rest.max_tokens = n - n / 2;
    tc::Session first(model, sp);
    const tc::GenerateResult part1 = first.generate(prompt, half);
    std::random_device rd;
    const std::filesystem::path file =
        std::filesystem::temp_directory_path() / ("tandem-sample-cpp-" + std::to_string(rd()) + ".session");
    first.save(file.string());
    tc::Session second(model, sp);
    second.restore(file.string());
    expect(second.tokens() == first.tokens() && second.logits() == first.logits(),
           "the restored session has the saved tokens and logits");
    const tc::GenerateResult part2 = second.generate("", rest);
    const tc::GenerateResult unsaved = first.generate("", rest);
    expect(part2.tokens == unsaved.tokens, "the restored session continues as the saved one does");
    expect(concat(part1.tokens, part2.tokens) == golden.tokens && part1.text + part2.text == golden.text,
           "half, save, restore, half is the whole greedy continuation");
    std::ofstream(file, std::ios::binary | std::ios::trunc) << "not a session file";
    const std::vector<int32_t> before = second.tokens();
    expect_error(TANDEM_E_SESSION_CORRUPT, "restoring a damaged file", [&] { second.restore(file.string()); });
    expect(second.tokens() == before, "a failed restore leaves the session as it was");
    std::filesystem::remove(file);

    tc::Session evaluator(model, sp);
    expect(evaluator.logits().empty(), "no logits before the first eval");
    const std::vector<float> rows = evaluator.eval_logits(ids);
    const std::vector<float> last = evaluator.logits();
    expect(rows.size() == ids.size() * n_vocab && last.size() == n_vocab, "logits shapes");
    expect(std::equal(last.begin(), last.end(), rows.end() - long(n_vocab)), "logits() is the last row of eval's");
    expect(argmax(last.data(), n_vocab) == golden.tokens[0], "the argmax after the prompt is the first greedy token");
    evaluator.eval({golden.tokens[0]});
    expect(argmax(evaluator.logits().data(), n_vocab) == golden.tokens[1], "and after it the second");
    const tandem_session_info si = evaluator.info();
    expect(si.n_tokens == int32_t(ids.size() + 1) && si.has_logits != 0, "session info after eval");
    expect(evaluator.tokens() == concat(ids, {golden.tokens[0]}), "tokens() are the evaluated ids");
    evaluator.abort();  // nothing running: no effect
    evaluator.reset();
    expect(evaluator.info().n_tokens == 0 && evaluator.tokens().empty(), "reset empties the conversation");
    expect_error(TANDEM_E_INVALID_ARG, "eval of an id outside the vocabulary",
                 [&] { evaluator.eval({int32_t(n_vocab)}); });

    tandem_generate_params with_logprobs = gp;
    with_logprobs.logprobs = 2;
    const tc::GenerateResult lp = tc::Session(model, sp).generate(prompt, with_logprobs);
    bool lp_ok = lp.logprobs.size() == lp.tokens.size();
    for (size_t i = 0; lp_ok && i < lp.logprobs.size(); ++i)
      lp_ok = lp.logprobs[i].token == lp.tokens[i] && lp.logprobs[i].n_top == 2 &&
              lp.logprobs[i].top_tokens[0] == lp.tokens[i] && lp.logprobs[i].logprob <= 0.0f;
    expect(lp_ok && lp.tokens == golden.tokens, "greedy logprobs: one per token, the token ranked first");
    expect_error(TANDEM_E_INVALID_ARG, "an exception thrown by on_piece comes back", [&] {
      tc::Session(model, sp).generate(
          prompt, gp, [](std::string_view) -> bool { throw tc::Error(TANDEM_E_INVALID_ARG, "thrown by on_piece"); });
    });
    std::fprintf(stderr, "session: %zu greedy tokens; generate, save/restore, eval/logits, logprobs checked\n",
                 golden.tokens.size());

    // ---- a cpu+cpu scheduler on two executors ---------------------------------------------
    std::vector<tandem_executor_params> eps(2, tc::executor_params());
    for (tandem_executor_params& ep : eps) {
      ep.n_threads = 1;
      ep.kv_file_pages = 64;  // a File tier, for parking sessions
    }
    eps[0].accelerator = 1;  // the primary of the pair
    std::vector<tc::Executor> executors;
    for (const tandem_executor_params& ep : eps) executors.emplace_back(model, ep);
    for (const tc::Executor& e : executors)
      expect(e.device().kind == TANDEM_DEVICE_CPU && e.device().n_cores == 1, "a CPU executor of one thread");
    tandem_scheduler_params scp = tc::scheduler_params();
    scp.executors = eps.data();
    scp.n_executors = eps.size();
    scp.max_context = 256;
    tc::Scheduler sched(model, executors, scp);
    expect_error(TANDEM_E_BUSY, "an executor serves one scheduler", [&] { (void)tc::Scheduler(model, executors); });
    scp.n_executors = 1;
    expect_error(TANDEM_E_INVALID_ARG, "params.executors of another count",
                 [&] { (void)tc::Scheduler(model, executors, scp); });
    {
      std::lock_guard<std::mutex> lock(log_mutex);
      expect(!log_lines.empty(), "the log function received the executors' creation");
    }

    tandem_request_params rp = tc::request_params();
    rp.prompt = prompt.c_str();
    rp.sampling = &greedy;
    rp.max_tokens = n;
    rp.flags = TANDEM_GENERATE_IGNORE_EOS;
    tc::Request waited = sched.submit(rp);
    tc::Request streamed_req = sched.submit(rp);
    std::vector<tc::Request> choices = sched.submit_n(rp, 2);

    // wait: the Session's greedy continuation.
    const tc::RequestResult rw = waited.wait();
    expect(rw.finished && rw.finish_reason == TANDEM_FINISH_LENGTH && rw.status == TANDEM_OK,
           "a waited request finished with LENGTH");
    expect(rw.tokens == golden.tokens && rw.text == golden.text, "the scheduler's greedy tokens are the session's");
    expect(rw.n_prompt == int32_t(ids.size()), "the request's prompt is the tokenized prompt");
    // next_event: the streamed events make up the result.
    std::vector<int32_t> ev_tokens;
    std::string ev_text;
    tc::Event ev;
    do {
      ev = streamed_req.next_event(-1);
      if (ev.kind == TANDEM_EVENT_TOKEN) ev_tokens.push_back(ev.token);
      ev_text += ev.text;
    } while (ev.kind != TANDEM_EVENT_FINISH);
    // The FINISH event can arrive just before the result is published: wait, not result().
    const tc::RequestResult rs = streamed_req.wait();
    expect(rs.finished && ev.finish_reason == rs.finish_reason, "the FINISH event's reason is the result's");
    const tc::RequestResult again = streamed_req.result();
    expect(again.finished && again.tokens == rs.tokens && again.text == rs.text && again.id == rs.id,
           "result() after wait() is the same outcome");
    expect(ev_tokens == rs.tokens && ev_text == rs.text && rs.tokens == golden.tokens,
           "the streamed events are the result");
    // wait, then poll: every event is there without blocking, and they agree with wait.
    for (tc::Request& choice : choices) {
      const tc::RequestResult rc = choice.wait();
      std::vector<int32_t> polled;
      std::string polled_text;
      bool none = false;
      for (ev = choice.poll(); ev.kind != TANDEM_EVENT_FINISH; ev = choice.poll()) {
        none = none || ev.kind == TANDEM_EVENT_NONE;
        if (ev.kind == TANDEM_EVENT_TOKEN) polled.push_back(ev.token);
        polled_text += ev.text;
        if (none) break;
      }
      expect(!none, "after wait, poll finds every event");
      expect(polled == rc.tokens && polled_text + ev.text == rc.text && rc.tokens == golden.tokens,
             "wait and poll agree (a greedy choice of submit_n)");
      const tc::Event repeat = choice.poll();
      expect(repeat.kind == TANDEM_EVENT_FINISH && repeat.text.empty(), "a poll after the finish repeats it");
      expect(choice.wait(0).finished, "wait(0) of a finished request");
    }

    // A scheduler session in two requests, parked to the File tier between them, and saved
    // then restored into a second session that takes the same second request.
    const uint64_t conv = sched.open_session();
    std::string conv_text, first_text;
    uint64_t conv2 = 0;
    for (int part = 0; part < 2; ++part) {
      tandem_request_params cp = rp;
      cp.prompt = part == 0 ? prompt.c_str() : "";
      cp.max_tokens = part == 0 ? n / 2 : n - n / 2;
      cp.session = conv;
      const std::string text = sched.submit(cp).wait().text;
      conv_text += text;
      if (part == 1) {
        cp.session = conv2;
        expect(first_text + sched.submit(cp).wait().text == golden.text,
               "a restored scheduler session continues as the saved one does");
      }
      if (part == 0) {
        first_text = text;
        std::random_device rd;
        const std::filesystem::path file =
            std::filesystem::temp_directory_path() / ("tandem-sample-cpp-" + std::to_string(rd()) + ".sched-session");
        sched.save_session(conv, file.string());
        conv2 = sched.restore_session(file.string(), 1);
        std::filesystem::remove(file);
        expect(conv2 != 0 && conv2 != conv, "restore_session opens a new session");
        sched.park_session(conv);
        const tandem_scheduler_session_info parked = sched.session_info(conv);
        expect(parked.pages_host == 0 && parked.pages_file > 0, "a parked session's pages are in the File tier");
        sched.unpark_session(conv);
        const tandem_scheduler_session_info back = sched.session_info(conv);
        expect(back.pages_host > 0 && back.pages_file == 0, "unpark brings them back");
      }
    }
    sched.close_session(conv);
    sched.close_session(conv2);
    expect(conv_text == golden.text, "a scheduler session in two requests continues as one generation");

    // Cancel, metrics, drain, shutdown.
    tandem_request_params long_rp = rp;
    long_rp.max_tokens = 200;
    tc::Request cancelled = sched.submit(long_rp);
    cancelled.cancel();
    const tc::RequestResult rcan = cancelled.wait();
    expect(rcan.finished && (rcan.finish_reason == TANDEM_FINISH_CANCELLED ||
                             (rcan.finish_reason == TANDEM_FINISH_LENGTH && rcan.tokens.size() == 200)),
           "a cancelled request ends CANCELLED (or had finished)");
    sched.drain();
    const std::string metrics = sched.metrics_json();
    expect(metrics.find("\"submitted\":8") != std::string::npos, "the metrics count 8 submitted requests: " + metrics);
    expect(sched.submit(rp).wait().finish_reason == TANDEM_FINISH_OVERLOADED, "a request after drain is refused");
    sched.shutdown();
    expect_error(TANDEM_E_INVALID_ARG, "submit after shutdown", [&] { sched.submit(rp); });
    std::fprintf(stderr,
                 "scheduler: cpu+cpu; wait, next_event, poll, submit_n, a parked session, cancel, drain checked\n");

    // With the log function removed, nothing reaches it.
    tc::set_log({});
    size_t lines_before = 0;
    {
      std::lock_guard<std::mutex> lock(log_mutex);
      lines_before = log_lines.size();
    }
    (void)tc::Executor(model, eps[1]);
    {
      std::lock_guard<std::mutex> lock(log_mutex);
      expect(log_lines.size() == lines_before, "no log line after set_log({})");
    }

    if (print_ids) {
      for (size_t i = 0; i < golden.tokens.size(); ++i) std::printf(i ? " %d" : "%d", int(golden.tokens[i]));
      std::printf("\n%s", golden.text.c_str());
    } else {
      std::printf("%s%s\n", prompt.c_str(), golden.text.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  if (failures > 0) {
    std::fprintf(stderr, "%d mismatches\n", failures);
    return 1;
  }
  return 0;
}
