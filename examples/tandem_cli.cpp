// tandem-cli: generate text with a GGUF model on the CPU, or tokenize text.
//
//   tandem-cli -m MODEL.gguf -p "Once upon a time" -n 64 [-t N] [--temp T] [--top-k K]
//              [--top-p P] [--min-p P] [--repeat-penalty R] [--seed S] [-c N_CTX]
//              [--prompt-ids 1,2,3] [--logits-out FILE] [--json]
//              [--chat [-sys|--system-prompt TEXT] [-st|--single-turn]]
//              [--session FILE] [--kv-tier host|file] [--kv-dir DIR] [--migrate-after N]
//   tandem-cli tokenize -m MODEL.gguf -p TEXT [--no-bos] [--parse-special]
//
// Flags follow llama.cpp's llama-cli where one exists. Errors: one line on stderr,
// exit status 1.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tandem/chat_session.hpp"
#include "tandem/chat_template.hpp"
#include "tandem/cpu_q4_executor.hpp"
#include "tandem/gguf.hpp"
#include "tandem/model.hpp"
#include "tandem/session.hpp"
#include "tandem/tokenizer.hpp"

namespace {

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    long v = 0;
    try {
      v = std::stol(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || v < 0 || v > INT32_MAX) {
      throw tandem::Error(tandem::ErrorCode::kInvalidArgument,
                          fmt::format("--prompt-ids: '{}' is not a token id", item));
    }
    ids.push_back(static_cast<int32_t>(v));
  }
  if (ids.empty()) throw tandem::Error(tandem::ErrorCode::kInvalidArgument, "--prompt-ids: no ids given");
  return ids;
}

// llama-cli's multi-letter single-dash chat flags, which CLI11 cannot declare: -sys, -st.
std::vector<std::string> expand_chat_flags(int argc, char** argv) {
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    args.push_back(a == "-sys" ? "--system-prompt" : a == "-st" ? "--single-turn" : a);
  }
  std::reverse(args.begin(), args.end());  // CLI11 parses a reversed vector
  return args;
}

int run_tokenize(const std::string& model_path, const std::string& text, bool no_bos, bool parse_special) {
  auto gguf = tandem::GgufFile::open(model_path);
  const tandem::Tokenizer tok = tandem::Tokenizer::from_gguf(*gguf);
  const auto ids = tok.tokenize(text, !no_bos, parse_special);
  std::cout << nlohmann::json(ids).dump() << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tandem-cli: generate text with a GGUF model on the CPU"};
  app.require_subcommand(0, 1);
  std::string model_path, prompt = "", prompt_ids, logits_out;
  int n_predict = 128, n_threads = 0, n_ctx = 0, n_batch = 512;
  tandem::SamplingParams sp;
  int64_t seed = -1;
  bool json_out = false, chat = false, ignore_eos = false, single_turn = false;
  std::string system_prompt;
  std::string session_path, kv_tier = "host", kv_dir;
  int migrate_after = -1;
  std::vector<std::string> stops;
  app.add_option("-m,--model", model_path, "GGUF model file")->required();
  app.add_option("-p,--prompt", prompt, "prompt text");
  app.add_option("-n,--n-predict", n_predict, "tokens to generate")->check(CLI::Range(0, INT32_MAX));
  app.add_option("-t,--threads", n_threads, "threads, 1..512 (0 = physical cores)")->check(CLI::Range(0, 512));
  app.add_option("-c,--ctx-size", n_ctx, "context size in tokens (0 = the model's training context, capped at 4096)")
      ->check(CLI::Range(0, 1 << 24));
  app.add_option("-b,--batch-size", n_batch, "prompt tokens per step")->check(CLI::Range(1, 1 << 16));
  app.add_option("--temp", sp.temperature, "temperature (0 = greedy)");
  app.add_option("--top-k", sp.top_k, "top-k (0 = off)");
  app.add_option("--top-p", sp.top_p, "top-p (1 = off)");
  app.add_option("--min-p", sp.min_p, "min-p (0 = off)");
  app.add_option("--repeat-penalty", sp.repeat_penalty, "repetition penalty (1 = off)");
  app.add_option("--repeat-last-n", sp.repeat_last_n, "tokens of history to penalise");
  app.add_option("--frequency-penalty", sp.frequency_penalty, "frequency penalty");
  app.add_option("--presence-penalty", sp.presence_penalty, "presence penalty");
  app.add_option("-s,--seed", seed, "sampling seed (-1 = random)");
  app.add_option("--stop", stops, "stop string (repeatable)");
  app.add_flag("--ignore-eos", ignore_eos, "keep generating past end-of-generation tokens");
  app.add_option("--prompt-ids", prompt_ids, "comma-separated token ids instead of -p")->excludes("--prompt");
  app.add_option("--logits-out", logits_out, "write prompt logits as float32 [n_prompt, n_vocab]");
  app.add_flag("--json", json_out, "print ids, text and timings as one JSON object");
  app.add_flag("--chat", chat, "chat with the model's template (-p: the first user message)");
  app.add_option("--system-prompt", system_prompt, "chat: system message (also -sys)");
  app.add_flag("--single-turn", single_turn, "chat: answer the first message (-p) and exit (also -st)");
  app.add_option("--session", session_path,
                 "restore the conversation from FILE if it exists (no recompute), save it there at the end");
  app.add_option("--kv-tier", kv_tier, "where KV pages live: host (RAM) or file (memory-mapped file)")
      ->check(CLI::IsMember({"host", "file"}));
  app.add_option("--kv-dir", kv_dir, "directory of the file tier (default: the temp directory)");
  app.add_option("--migrate-after", migrate_after,
                 "hand the session to a second CPU executor after N generated tokens")
      ->check(CLI::Range(0, INT32_MAX));

  auto* tok_cmd = app.add_subcommand("tokenize", "print the token ids of a text as a JSON array");
  std::string tok_model, tok_text;
  bool no_bos = false, parse_special = false;
  tok_cmd->add_option("-m,--model", tok_model, "GGUF model or vocabulary file")->required();
  tok_cmd->add_option("-p,--prompt", tok_text, "text")->required();
  tok_cmd->add_flag("--no-bos", no_bos, "do not add BOS");
  tok_cmd->add_flag("--parse-special", parse_special, "parse special-token text");
  // The generate options are required only without a subcommand.
  app.get_option("--model")->required(false);

  try {
    app.parse(expand_chat_flags(argc, argv));
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  try {
    if (tok_cmd->parsed()) return run_tokenize(tok_model, tok_text, no_bos, parse_special);
    if (model_path.empty()) throw tandem::Error(tandem::ErrorCode::kInvalidArgument, "--model is required");
    if (seed < 0) seed = static_cast<int64_t>(std::random_device{}() & 0x7fffffff);
    sp.validate();

    const auto t_load = std::chrono::steady_clock::now();
    auto model = tandem::Model::load(model_path);
    tandem::CpuQ4Executor exec(model, tandem::CpuExecutorOptions{n_threads});
    std::optional<tandem::CpuQ4Executor> second;  // the --migrate-after target; outlives the session's use
    tandem::SessionOptions so;
    so.n_ctx = n_ctx;
    so.n_batch = n_batch;
    so.seed = static_cast<uint64_t>(seed);
    so.kv_tier = kv_tier == "file" ? tandem::KvTier::kFile : tandem::KvTier::kHost;
    if (!kv_dir.empty()) so.kv_dir = kv_dir;
    tandem::Session session(model, exec, so);
    if (!session_path.empty() && std::filesystem::exists(session_path)) {
      session.restore(session_path);
      std::fprintf(stderr, "tandem-cli: restored %zu tokens from %s\n", session.tokens().size(), session_path.c_str());
    }
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();

    tandem::GenerateOptions go;
    go.max_tokens = n_predict;
    go.sampling = sp;
    go.stop = stops;
    go.ignore_eos = ignore_eos;
    if (!json_out) {
      go.on_text = [](std::string_view text, int32_t) {
        std::fwrite(text.data(), 1, text.size(), stdout);
        std::fflush(stdout);
        return true;
      };
    }

    if (chat) {
      const tandem::ChatTemplate tmpl = tandem::ChatTemplate::for_model(*model);
      tandem::ChatSession chat_session(session, tmpl, system_prompt);
      std::fprintf(stderr, "tandem-cli: chat template %s%s\n", std::string(tmpl.name()).c_str(),
                   tmpl.matched() ? "" : " (fallback: no known template in the model)");
      auto turn = [&](const std::string& message) {
        try {
          chat_session.send(message, go);
        } catch (const tandem::Error& e) {
          if (e.code() != tandem::ErrorCode::kContextOverflow) throw;
          std::fprintf(stderr, "tandem-cli: this turn does not fit the context (%s); the chat keeps its history\n",
                       e.what());
        }
        std::fprintf(stdout, "\n");
        std::fflush(stdout);
      };
      if (!prompt.empty()) turn(prompt);
      if (!single_turn) {
        std::string line;
        std::fprintf(stderr, "tandem-cli: chat mode, one message per line, Ctrl-D to end\n> ");
        while (std::getline(std::cin, line)) {
          turn(line);
          std::fprintf(stderr, "> ");
        }
      }
      if (!session_path.empty()) session.save(session_path);
      return 0;
    }

    const bool fresh = session.tokens().empty();
    std::vector<int32_t> ids = prompt_ids.empty() ? model->tokenizer().tokenize(prompt, fresh, false)
                                                  : parse_ids(prompt_ids);
    if (ids.empty() && fresh) throw tandem::Error(tandem::ErrorCode::kInvalidArgument, "the prompt has no tokens");
    if (session.tokens().size() + ids.size() > size_t(session.n_ctx())) {  // refuse before printing anything
      throw tandem::Error(tandem::ErrorCode::kContextOverflow,
                          fmt::format("context overflow: the prompt needs {} positions, n_ctx is {}",
                                      session.tokens().size() + ids.size(), session.n_ctx()));
    }
    const int32_t n_vocab = model->hparams().n_vocab;
    tandem::GenerateResult r;
    if (!logits_out.empty()) {
      std::vector<float> all(ids.size() * size_t(n_vocab));
      const auto t0 = std::chrono::steady_clock::now();
      session.eval(ids, all);
      const double prompt_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::ofstream f(logits_out, std::ios::binary);
      f.write(reinterpret_cast<const char*>(all.data()), static_cast<std::streamsize>(all.size() * sizeof(float)));
      if (!f) throw tandem::Error(tandem::ErrorCode::kIo, fmt::format("cannot write '{}'", logits_out));
      r = session.generate(std::span<const int32_t>(), go);
      r.n_prompt = static_cast<int32_t>(ids.size());
      r.prompt_seconds = prompt_s;
    } else {
      if (!json_out) {
        const std::string shown = model->tokenizer().detokenize(ids, true, false);
        std::fwrite(shown.data(), 1, shown.size(), stdout);
      }
      if (migrate_after >= 0 && migrate_after < n_predict) {
        // Generate N tokens here, hand the session (KV pages under the contract) to a
        // second executor with its own thread pool, and continue there.
        second.emplace(model, tandem::CpuExecutorOptions{n_threads});
        tandem::GenerateOptions first = go;
        first.max_tokens = migrate_after;
        first.flush_text = false;
        r = session.generate(std::span<const int32_t>(ids), first);
        if (r.finish == tandem::FinishReason::kLength && static_cast<int>(r.tokens.size()) == migrate_after) {
          const auto m = session.migrate(*second);
          std::fprintf(stderr, "\ntandem-cli: migrated after %d tokens: %d pages, %llu bytes, %.0f us\n",
                       migrate_after, m.pages, static_cast<unsigned long long>(m.bytes), m.seconds * 1e6);
          go.max_tokens = n_predict - migrate_after;
          auto rest = session.generate(std::span<const int32_t>(), go);
          r.tokens.insert(r.tokens.end(), rest.tokens.begin(), rest.tokens.end());
          r.text += rest.text;
          r.finish = rest.finish;
          r.generate_seconds += rest.generate_seconds;
        }
      } else {
        r = session.generate(std::span<const int32_t>(ids), go);
      }
    }
    if (!session_path.empty()) session.save(session_path);
    const double pp_tps = r.prompt_seconds > 0 ? r.n_prompt / r.prompt_seconds : 0.0;
    const double tg_tps = r.generate_seconds > 0 ? double(r.tokens.size()) / r.generate_seconds : 0.0;
    if (json_out) {
      nlohmann::json j;
      j["model"] = model->name();
      j["prompt_ids"] = ids;
      j["ids"] = r.tokens;
      j["text"] = r.text;
      j["finish_reason"] = std::string(tandem::finish_reason_name(r.finish));
      j["timings"] = {{"load_s", load_s}, {"prompt_s", r.prompt_seconds}, {"prompt_tokens_per_s", pp_tps},
                      {"generate_s", r.generate_seconds}, {"generate_tokens_per_s", tg_tps},
                      {"threads", exec.n_threads()}};
      std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    } else {
      std::fprintf(stdout, "\n");
    }
    std::fprintf(stderr,
                 "\ntandem-cli: load %.1f ms | prompt %d tokens, %.1f tokens/s | generate %zu tokens, %.1f tokens/s "
                 "| %d threads | finish: %s\n",
                 load_s * 1e3, r.n_prompt, pp_tps, r.tokens.size(), tg_tps, exec.n_threads(),
                 std::string(tandem::finish_reason_name(r.finish)).c_str());
    return 0;
  } catch (const tandem::Error& e) {
    std::fprintf(stderr, "tandem-cli: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem-cli: error: %s\n", e.what());
    return 1;
  }
}
