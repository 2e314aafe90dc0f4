// Greedy generation through tandem.hpp (the installed C++ layer over the C ABI), printed
// as examples/samples/c/generate.c prints it with --ids (ids line, then the text) so that
// scripts/test-ffi checks it against the golden continuation. It also checks that a
// failure arrives as tandem::c::Error with the status, and that a scheduler session
// continued over two requests, parked to the File tier between them and computing on a
// shared tandem::c::Pool, gives the same text as the session.
//
// Usage: tandem-outside-cxx MODEL.gguf PROMPT N_TOKENS
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tandem.hpp"

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s MODEL.gguf PROMPT N_TOKENS\n", argv[0]);
    return 2;
  }
  try {
    try {
      tandem::c::Model missing("/nonexistent/model.gguf");
      std::fprintf(stderr, "loading a missing file did not throw\n");
      return 1;
    } catch (const tandem::c::Error& e) {
      if (e.status() != TANDEM_E_IO) {
        std::fprintf(stderr, "expected IO, got %s\n", e.what());
        return 1;
      }
    }
    tandem::c::Model model(argv[1]);
    const int n = std::atoi(argv[3]);
    auto sp = tandem::c::make_struct<tandem_session_params, tandem_session_params_init>();
    sp.n_threads = 1;
    tandem::c::Session session(model, sp);
    auto smp = tandem::c::make_struct<tandem_sampling_params, tandem_sampling_params_init>();
    smp.temperature = 0.0f;
    auto gp = tandem::c::make_struct<tandem_generate_params, tandem_generate_params_init>();
    gp.sampling = &smp;
    gp.max_tokens = n;
    gp.flags = TANDEM_GENERATE_IGNORE_EOS;
    const tandem::c::GenerateResult r = session.generate(argv[2], gp);

    // The same continuation through a scheduler session, in two requests.
    tandem::c::Pool pool(1);
    auto ep = tandem::c::make_struct<tandem_executor_params, tandem_executor_params_init>();
    ep.pool = pool.get();
    ep.kv_file_pages = 64;
    auto scp = tandem::c::make_struct<tandem_scheduler_params, tandem_scheduler_params_init>();
    scp.executors = &ep;
    scp.max_context = 256;
    tandem::c::Scheduler sched(model, scp);
    const uint64_t conv = sched.open_session();
    std::string text, piece;
    for (int part = 0; part < 2; ++part) {
      auto rp = tandem::c::make_struct<tandem_request_params, tandem_request_params_init>();
      rp.prompt = part == 0 ? argv[2] : "";
      rp.sampling = &smp;
      rp.max_tokens = part == 0 ? n / 2 : n - n / 2;
      rp.flags = TANDEM_GENERATE_IGNORE_EOS;
      rp.session = conv;
      tandem::c::Request req = sched.submit(rp);
      for (;;) {
        const tandem_request_event ev = req.next_event(-1, piece);
        text += piece;
        if (ev.kind == TANDEM_EVENT_FINISH) break;
      }
      sched.park_session(conv);  // its KV to the File tier until the next request
      if (sched.session_info(conv).pages_host != 0) {
        std::fprintf(stderr, "a parked session still holds Host pages\n");
        return 1;
      }
    }
    sched.close_session(conv);
    if (text != r.text) {
      std::fprintf(stderr, "scheduler session text differs:\n%s\n---\n%s\n", text.c_str(), r.text.c_str());
      return 1;
    }
    for (size_t i = 0; i < r.tokens.size(); ++i) std::printf(i ? " %d" : "%d", int(r.tokens[i]));
    std::printf("\n%s", r.text.c_str());
    return 0;
  } catch (const tandem::c::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
