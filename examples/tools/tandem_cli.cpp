// tandem-cli: generate text with a GGUF model on the CPU, or tokenize text.
//
//   tandem-cli -m MODEL.gguf -p "Once upon a time" | -f PROMPT_FILE -n 64 [-t N] [--temp T] [--top-k K]
//              [--top-p P] [--min-p P] [--repeat-penalty R] [--seed S] [-c N_CTX]
//              [--prompt-ids 1,2,3] [--logits-out FILE] [--json]
//              [--chat [-sys|--system-prompt TEXT] [-st|--single-turn]
//                      [--chat-template NAME_OR_JINJA | --chat-template-file FILE]]
//              [--session FILE] [--kv-tier host|file] [--kv-dir DIR] [--migrate-after N]
//              [-ctk|--cache-type-k f16|f32|q8_0] [-ctv|--cache-type-v f16|f32|q8_0]
//   tandem-cli tokenize -m MODEL.gguf -p TEXT [--no-bos] [--parse-special]
//   tandem-cli apply-template -m MODEL.gguf --messages REQUEST.json   (the prompt the model's
//              chat template makes of an OpenAI chat request: messages, tools,
//              add_generation_prompt (default true), chat_template_kwargs; printed exactly)
//              [--chat-template NAME_OR_JINJA | --chat-template-file FILE]
//   tandem-cli --version | --help   (--help shows every default)
//
// Flags follow llama.cpp's llama-cli where one exists. Errors: one line on stderr and exit
// status 1; bad flags (usage): exit status 2; the first SIGINT/SIGTERM/SIGHUP stops at the
// next token (in the prompt: after the current chunk of -b tokens), saves --session and
// exits 128 + the signal (130 for Ctrl-C), a second one exits at once
// (examples/tools/cli_signals.hpp). A write error on stdout is an error. --session FILE with a
// prompt is a prompt cache (the matching prefix is reused); without one it continues.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "chat_template_flags.hpp"
#include "cli_session_lock.hpp"
#include "cli_signals.hpp"
#include "cli_stdout.hpp"
#include "gpu_layers.hpp"
#include "kv_cache_type.hpp"
#include "tandem/core/atomic_file.hpp"
#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/gguf/gguf.hpp"
#include "tandem/model/model.hpp"
#include "tandem/node/node.hpp"
#include "tandem/session/chat_session.hpp"
#include "tandem/session/session.hpp"
#include "tandem/template/chat_template.hpp"
#include "tandem/template/tool_calls.hpp"
#include "tandem/tokenizer/tokenizer.hpp"

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

// A bad flag or flag combination: exit status 2, as for the flags CLI11 refuses itself.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
/// A signal arrived while an input was being read: exit 128 + the signal, nothing done.
struct InterruptedRead {};

/// Most bytes a prompt file (-f) or an apply-template request (--messages) may hold: far
/// above any context, far below what would exhaust memory (/dev/zero, a runaway pipe).
constexpr size_t kMaxInputBytes = size_t{64} << 20;

/// All of `in` (named `name` in errors), read in chunks: more than kMaxInputBytes is an
/// error, an interrupt (Ctrl-C, SIGTERM) between chunks stops the read (InterruptedRead).
std::string read_bounded(std::istream& in, const std::string& name) {
  std::string out;
  std::vector<char> buf(size_t{1} << 16);
  while (in) {
    if (tandem::cli::interrupted()) throw InterruptedRead{};
    in.read(buf.data(), std::streamsize(buf.size()));
    out.append(buf.data(), size_t(in.gcount()));
    if (out.size() > kMaxInputBytes) {
      throw tandem::Error(tandem::ErrorCode::kInvalidArgument,
                          fmt::format("{} holds more than {} MiB: refused", name, kMaxInputBytes >> 20));
    }
  }
  if (tandem::cli::interrupted()) throw InterruptedRead{};
  if (in.bad()) throw tandem::Error(tandem::ErrorCode::kIo, fmt::format("cannot read {}", name));
  return out;
}

/// Opens `path` for read_bounded; a directory or an unopenable path is a clear error.
std::ifstream open_input(const std::string& path, const std::string& what) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw tandem::Error(tandem::ErrorCode::kIo, fmt::format("cannot read {} '{}': it is a directory", what, path));
  }
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    throw tandem::Error(tandem::ErrorCode::kIo,
                        fmt::format("cannot read {} '{}': {}", what, path, std::strerror(errno ? errno : ENOENT)));
  }
  return f;
}

// Flags that CLI11's per-option checks cannot see: values that parse but mean nothing,
// and flags that contradict each other.
void check_generate_flags(const CLI::App& app, const tandem::SamplingParams& sp, int n_predict,
                          const std::string& kv_tier, int migrate_after, bool chat, bool json_out,
                          const std::string& logits_out) {
  const std::pair<const char*, float> finite[] = {{"--temp", sp.temperature},
                                                  {"--top-p", sp.top_p},
                                                  {"--min-p", sp.min_p},
                                                  {"--repeat-penalty", sp.repeat_penalty},
                                                  {"--frequency-penalty", sp.frequency_penalty},
                                                  {"--presence-penalty", sp.presence_penalty}};
  for (const auto& [flag, v] : finite) {
    if (!std::isfinite(v)) throw UsageError(fmt::format("{} {} is not a finite number", flag, v));
  }
  if (sp.temperature < 0) throw UsageError(fmt::format("--temp {} must be >= 0 (0 = greedy)", sp.temperature));
  if (app.count("--kv-dir") > 0 && kv_tier != "file") throw UsageError("--kv-dir needs --kv-tier file");
  if (migrate_after >= n_predict && app.count("--migrate-after") > 0) {
    throw UsageError(fmt::format("--migrate-after {} must be below -n {} (no token would run after the move)",
                                 migrate_after, n_predict));
  }
  if (chat && json_out) throw UsageError("--chat and --json cannot be combined");
  if (chat && !logits_out.empty()) throw UsageError("--chat and --logits-out cannot be combined");
  if (chat && app.count("--prompt-ids") > 0) throw UsageError("--chat and --prompt-ids cannot be combined");
}

// --seed: -1 (random) or 0..INT64_MAX, every digit checked (no wrapping, no saturation).
int64_t parse_seed(const std::string& text) {
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v < -1) {
    throw UsageError(fmt::format("--seed {} must be -1 (random) or 0..{}", text, INT64_MAX));
  }
  return v;
}

// Refuses text that is not well-formed UTF-8 (as the C ABI does), naming the byte offset.
void check_utf8(const std::string& text, const char* what) {
  const std::string clean = tandem::utf8_sanitize(text);
  if (clean == text) return;
  size_t at = 0;
  while (at < text.size() && at < clean.size() && text[at] == clean[at]) ++at;
  throw UsageError(fmt::format("{} is not valid UTF-8 (byte offset {})", what, at));
}

std::string read_prompt_file(const std::string& path) {
  std::ifstream f = open_input(path, "prompt file");
  return read_bounded(f, fmt::format("the prompt file '{}'", path));
}

// Evaluates a long prompt in pieces of n_batch tokens with progress on stderr, stopping
// early (at a chunk boundary) on an interrupt. Returns the tokens evaluated and the seconds taken.
std::pair<size_t, double> prefill_with_progress(tandem::Session& session, std::span<const int32_t> ids, int n_batch) {
  const auto t0 = std::chrono::steady_clock::now();
  size_t done = 0;
  while (done < ids.size() && !tandem::cli::interrupted()) {
    const size_t n = std::min(ids.size() - done, size_t(n_batch));
    session.eval(ids.subspan(done, n));
    done += n;
    std::fprintf(stderr, "\rtandem-cli: prompt %zu / %zu tokens (%.0f%%)", done, ids.size(),
                 100.0 * double(done) / double(ids.size()));
  }
  std::fprintf(stderr, "\n");
  return {done, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()};
}

// llama-cli's multi-letter single-dash flags, which CLI11 cannot declare: -sys, -st, -ctk,
// -ctv, -ngl.
std::vector<std::string> expand_chat_flags(int argc, char** argv) {
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    args.push_back(a == "-sys"  ? "--system-prompt"
                   : a == "-st" ? "--single-turn"
                                : tandem::cli::expand_gpu_layers_flag(tandem::cli::expand_cache_type_flag(a)));
  }
  std::reverse(args.begin(), args.end());  // CLI11 parses a reversed vector
  return args;
}

int run_tokenize(const std::string& model_path, const std::string& text, bool no_bos, bool parse_special) {
  auto gguf = tandem::GgufFile::open(model_path);
  const tandem::Tokenizer tok = tandem::Tokenizer::from_gguf(*gguf);
  const auto ids = tok.tokenize(text, !no_bos, parse_special);
  std::cout << nlohmann::json(ids).dump() << "\n";
  return tandem::cli::finish_stdout("tandem-cli", 0);
}

// The rendered prompt of an OpenAI chat-completions request body (llama-server's
// /apply-template): exactly the template's text on stdout, no newline added.
int run_apply_template(const std::string& model_path, const std::string& request_path,
                       const tandem::cli::ChatTemplateFlags& template_flags) {
  const auto override = tandem::cli::chat_template_override(template_flags);
  std::string body;
  if (request_path == "-") {
    body = read_bounded(std::cin, "standard input");
  } else {
    std::ifstream in = open_input(request_path, "messages file");
    body = read_bounded(in, fmt::format("the messages file '{}'", request_path));
  }
  nlohmann::ordered_json req;
  try {
    req = nlohmann::ordered_json::parse(body);
  } catch (const nlohmann::json::exception& e) {
    throw tandem::Error(tandem::ErrorCode::kInvalidArgument, request_path + " is not JSON: " + e.what());
  }
  if (!req.is_object() || !req.contains("messages") || !req["messages"].is_array()) {
    throw tandem::Error(tandem::ErrorCode::kInvalidArgument,
                        request_path + ": expected a chat request object with a \"messages\" array");
  }
  const auto& agp = req.contains("add_generation_prompt") ? req["add_generation_prompt"] : nlohmann::ordered_json(true);
  if (!agp.is_boolean())
    throw tandem::Error(tandem::ErrorCode::kInvalidArgument, "add_generation_prompt must be a boolean");
  auto gguf = tandem::GgufFile::open(model_path);
  const tandem::Tokenizer tok = tandem::Tokenizer::from_gguf(*gguf);
  const tandem::ChatTemplate tmpl = tandem::ChatTemplate::for_tokenizer(tok, override ? &*override : nullptr);
  if (!tmpl.fallback_reason().empty()) {
    std::fprintf(stderr, "tandem-cli: the model's chat template is not used (%s); built-in template %s\n",
                 tmpl.fallback_reason().c_str(), std::string(tmpl.name()).c_str());
  }
  const auto tools = req.value("tools", nlohmann::ordered_json());
  const auto kwargs = req.value("chat_template_kwargs", nlohmann::ordered_json());
  std::string prompt;
  if (tandem::chat_request_uses_tools(req)) {  // as a chat endpoint renders it (tandem-server's)
    const auto in =
        tandem::tool_template_input(tandem::tool_prompt_for_template(tmpl.source()), req["messages"], tools);
    prompt = tmpl.render_json(in.messages, agp.get<bool>(), in.tools, kwargs);
  } else {
    prompt = tmpl.render_json(req["messages"], agp.get<bool>(), tools, kwargs);
  }
  if (!tandem::cli::write_stdout(prompt)) return tandem::cli::finish_stdout("tandem-cli", 1);
  return tandem::cli::finish_stdout("tandem-cli", 0);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tandem-cli: generate text with a GGUF model on the CPU", "tandem-cli"};
  app.require_subcommand(0, 1);
  app.option_defaults()->always_capture_default();  // --help shows each default
#if TANDEM_HAVE_CUDA
  app.set_version_flag("--version", "tandem-cli " TANDEM_VERSION "\ngpu executor: cuda");
#else
  app.set_version_flag("--version", "tandem-cli " TANDEM_VERSION "\ngpu executor: none (built without CUDA)");
#endif
  std::string model_path, prompt = "", prompt_ids, logits_out, prompt_file;
  int n_predict = 128, n_threads = 0, n_ctx = 0, n_batch = 512;
  tandem::SamplingParams sp;
  int64_t seed = -1;
  bool json_out = false, chat = false, ignore_eos = false, single_turn = false;
  std::string system_prompt;
  std::string session_path, kv_tier = "host", kv_dir, cache_type_k = "f16", cache_type_v = "f16";
  std::string gpu_layers = "0";
  int migrate_after = -1;
  std::vector<std::string> stops;
  app.add_option("-m,--model", model_path, "GGUF model file")->required();
  app.add_option("-p,--prompt", prompt, "prompt text");
  app.add_option("-f,--file", prompt_file, "read the prompt from FILE")->excludes("--prompt");
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
  std::string seed_text = "-1";  // parsed here: CLI11 saturates out-of-range integers silently
  app.add_option("-s,--seed", seed_text, "sampling seed (-1 = random)");
  app.add_option("--stop", stops, "stop string (repeatable)");
  app.add_flag("--ignore-eos", ignore_eos, "keep generating past end-of-generation tokens");
  app.add_option("--prompt-ids", prompt_ids, "comma-separated token ids instead of -p")
      ->excludes("--prompt")
      ->excludes("--file");
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
  app.add_option("--cache-type-k", cache_type_k, "KV cache type of K: f16, f32 or q8_0 (also -ctk; same as V)");
  app.add_option("--cache-type-v", cache_type_v, "KV cache type of V: f16, f32 or q8_0 (also -ctv; same as K)");
  app.add_option("--n-gpu-layers,--gpu-layers", gpu_layers,
                 "llama.cpp's -ngl: 0 runs the CPU executor; all, auto, -1 or a count >= the model's layers the GPU "
                 "executor (CUDA builds; no partial offload)");
  app.add_option("--migrate-after", migrate_after, "hand the session to a second CPU executor after N generated tokens")
      ->check(CLI::Range(0, INT32_MAX));

  auto* tok_cmd = app.add_subcommand("tokenize", "print the token ids of a text as a JSON array");
  std::string tok_model, tok_text;
  bool no_bos = false, parse_special = false;
  tok_cmd->add_option("-m,--model", tok_model, "GGUF model or vocabulary file")->required();
  tok_cmd->add_option("-p,--prompt", tok_text, "text")->required();
  tok_cmd->add_flag("--no-bos", no_bos, "do not add BOS");
  tok_cmd->add_flag("--parse-special", parse_special, "parse special-token text");
  auto* tmpl_cmd = app.add_subcommand(
      "apply-template", "print the prompt the model's chat template makes of an OpenAI chat request (JSON file)");
  std::string tmpl_model, tmpl_messages;
  tmpl_cmd->add_option("-m,--model", tmpl_model, "GGUF model or vocabulary file")->required();
  tmpl_cmd
      ->add_option("--messages", tmpl_messages,
                   "chat request JSON: messages, optional tools, add_generation_prompt, chat_template_kwargs "
                   "(- reads stdin)")
      ->required();
  tandem::cli::ChatTemplateFlags tmpl_flags, chat_flags;
  tandem::cli::add_chat_template_flags(*tmpl_cmd, tmpl_flags);
  tandem::cli::add_chat_template_flags(app, chat_flags);
  // The generate options are required only without a subcommand.
  app.get_option("--model")->required(false);

  try {
    app.parse(expand_chat_flags(argc, argv));
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // --help and --version: 0; a refused flag: usage, 2
    return rc == 0 ? 0 : 2;
  }
  tandem::cli::install_interrupt_handlers();

  try {
    if (tok_cmd->parsed()) {
      check_utf8(tok_text, "the text");
      return run_tokenize(tok_model, tok_text, no_bos, parse_special);
    }
    if (tmpl_cmd->parsed()) return run_apply_template(tmpl_model, tmpl_messages, tmpl_flags);
    if (model_path.empty()) throw UsageError("--model is required");
    // -ngl: a value that is no layer count is refused before loading; the count is read
    // against the model's layers once it is loaded.
    if (const std::string bad = tandem::cli::check_layer_count(gpu_layers); !bad.empty()) throw UsageError(bad);
    seed = parse_seed(seed_text);
    check_generate_flags(app, sp, n_predict, kv_tier, migrate_after, chat, json_out, logits_out);
    if (!chat && (chat_flags.text || chat_flags.file)) {
      throw UsageError("--chat-template and --chat-template-file apply to --chat");
    }
    const auto chat_override = tandem::cli::chat_template_override(chat_flags);  // before the model loads
    tandem::KvDtype kv_dtype = tandem::KvDtype::kF16;
    if (const std::string bad = tandem::cli::resolve_cache_types(cache_type_k, cache_type_v, kv_dtype); !bad.empty())
      throw UsageError(bad);
    try {
      sp.validate();
    } catch (const tandem::Error& e) {
      throw UsageError(e.what());
    }
    if (!prompt_file.empty()) prompt = read_prompt_file(prompt_file);
    check_utf8(prompt, prompt_file.empty() ? "the prompt" : "the prompt file");
    const bool seed_given = seed >= 0;
    if (seed < 0) seed = static_cast<int64_t>(std::random_device{}() & 0x7fffffff);

    const auto t_load = std::chrono::steady_clock::now();
    auto model = tandem::Model::load(model_path);
    const int32_t n_ctx_train = model->hparams().n_ctx_train;
    if (n_ctx > n_ctx_train && n_ctx_train > 0) {
      std::fprintf(stderr,
                   "tandem-cli: warning: -c %d exceeds the model's training context of %d tokens; "
                   "output past it may degrade\n",
                   n_ctx, n_ctx_train);
    }
    const auto ngl = tandem::cli::whole_model_gpu_layers(gpu_layers, model->hparams().n_layer);
    if (!ngl.error.empty()) throw UsageError(ngl.error);
    tandem::ExecutorSpec es;
    es.n_threads = n_threads;
    if (ngl.gpu) {
#if !TANDEM_HAVE_CUDA
      throw UsageError(tandem::cli::cpu_only_gpu_layers_error("tandem-cli (built without CUDA)", gpu_layers));
#endif
      es.kind = tandem::ExecutorKind::kGpu;
    }
    // The GPU executor throws without a CUDA device.
    const std::unique_ptr<tandem::Executor> exec_owner = tandem::make_executor(model, es);
    if (ngl.gpu) std::fprintf(stderr, "tandem-cli: all %d layers on the GPU executor\n", model->hparams().n_layer);
    tandem::Executor& exec = *exec_owner;
    const auto* cpu_exec = dynamic_cast<const tandem::CpuQ4Executor*>(exec_owner.get());
    std::optional<tandem::CpuQ4Executor> second;  // the --migrate-after target; outlives the session's use
    tandem::SessionOptions so;
    so.n_ctx = n_ctx;
    so.n_batch = n_batch;
    so.seed = static_cast<uint64_t>(seed);
    so.kv_tier = kv_tier == "file" ? tandem::KvTier::kFile : tandem::KvTier::kHost;
    so.kv_dtype = kv_dtype;
    if (!kv_dir.empty()) so.kv_dir = kv_dir;
    tandem::Session session(model, exec, so);
    // One run at a time per session file: restore, generate and save under one lock.
    std::optional<tandem::cli::SessionFileLock> session_lock;
    if (!session_path.empty()) session_lock.emplace(session_path);
    // With a saved session, -p/-f/--prompt-ids is the whole prompt and the file a prompt cache
    // (llama.cpp's --prompt-cache): the saved tokens that match the prompt's start are reused,
    // the rest of the file's conversation is dropped. Without a prompt the run continues the
    // saved conversation. --chat always continues it.
    const bool prompt_given = !prompt.empty() || !prompt_ids.empty();
    const bool prompt_cache = prompt_given && !chat;
    if (session_lock && session_lock->has_saved_state()) {
      const auto restored = session.restore(session_path);
      std::fprintf(stderr, "tandem-cli: restored %zu tokens from %s\n", session.tokens().size(), session_path.c_str());
      if (restored.kv_converted()) {  // -ctk/-ctv other than the saved session's: converted on load
        std::fprintf(stderr, "tandem-cli: the session's KV cache was converted from %s to %s (-ctk/-ctv)\n",
                     std::string(tandem::kv_dtype_name(restored.saved_kv_dtype)).c_str(),
                     std::string(tandem::kv_dtype_name(restored.kv_dtype)).c_str());
      }
      if (prompt_cache) {
        session.reseed(static_cast<uint64_t>(seed));  // as a fresh run: the seed applies
      } else if (seed_given) {
        std::fprintf(stderr,
                     "tandem-cli: warning: --seed is ignored: the restored session continues its saved "
                     "random state\n");
      }
    }
    auto save_session = [&] {
      if (session_path.empty()) return;
      session.save(session_path);
      std::fprintf(stderr, "tandem-cli: saved %zu tokens to %s\n", session.tokens().size(), session_path.c_str());
    };
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();

    tandem::GenerateOptions go;
    go.max_tokens = n_predict;
    go.sampling = sp;
    go.stop = stops;
    go.ignore_eos = ignore_eos;
    go.should_stop = [] { return tandem::cli::interrupted(); };  // between prompt chunks and tokens
    if (json_out) {
      go.on_text = [](std::string_view, int32_t) { return !tandem::cli::interrupted(); };
    } else {
      go.on_text = [](std::string_view text, int32_t) { return tandem::cli::write_stdout(text); };
    }

    if (chat) {
      const tandem::ChatTemplate tmpl =
          tandem::ChatTemplate::for_model(*model, chat_override ? &*chat_override : nullptr);
      tandem::ChatSession chat_session(session, tmpl, system_prompt);
      if (chat_override) {
        std::fprintf(stderr, "tandem-cli: chat template %s (%s, from %s)\n", std::string(tmpl.name()).c_str(),
                     tmpl.is_jinja() ? "Jinja" : "built in", tmpl.origin().c_str());
      } else if (tmpl.is_jinja()) {
        std::fprintf(stderr, "tandem-cli: chat template %s (the model's own Jinja template)\n",
                     std::string(tmpl.name()).c_str());
      } else {
        std::fprintf(stderr, "tandem-cli: chat template %s, built in (%s)%s\n", std::string(tmpl.name()).c_str(),
                     tmpl.fallback_reason().c_str(),
                     tmpl.matched() ? "" : "; fallback: no known template in the model");
      }
      auto turn = [&](const std::string& message) {
        tandem::GenerateResult r;
        bool answered = false;
        try {
          r = chat_session.send(message, go);
          answered = true;
        } catch (const tandem::Error& e) {
          if (e.code() != tandem::ErrorCode::kContextOverflow) throw;
          std::fprintf(stderr,
                       "tandem-cli: this message does not fit the context (%s); the chat keeps its history "
                       "(/clear starts over, -c sets the context size)\n",
                       e.what());
        }
        if (const auto& shift = chat_session.last_shift()) {
          std::fprintf(stderr,
                       "\ntandem-cli: context shift: %s; kept %d tokens (the system prompt), evaluated %d again\n",
                       shift->restored_history_dropped
                           ? "the restored conversation did not leave room and was dropped"
                           : fmt::format("dropped the {} oldest messages", shift->messages_dropped).c_str(),
                       shift->tokens_kept, shift->tokens_evaluated);
        }
        if (answered && r.finish == tandem::FinishReason::kLength && int(r.tokens.size()) < n_predict &&
            session.tokens().size() + 1 >= size_t(session.n_ctx())) {
          std::fprintf(stderr,
                       "\ntandem-cli: the reply filled the context of %d tokens; the next message drops the oldest "
                       "messages (/clear starts over)\n",
                       session.n_ctx());
        }
        std::fprintf(stdout, "\n");
        std::fflush(stdout);
      };
      if (!prompt.empty()) turn(prompt);
      if (!single_turn) {
        std::string line;
        std::fprintf(stderr, "tandem-cli: chat mode, one message per line, /clear to start over, Ctrl-D to end\n> ");
        while (!tandem::cli::interrupted() && std::getline(std::cin, line)) {
          if (line == "/clear") {
            chat_session.clear();
            std::fprintf(stderr, "tandem-cli: conversation cleared\n");
          } else {
            turn(line);
          }
          std::fprintf(stderr, "> ");
        }
      }
      save_session();
      return tandem::cli::finish_stdout("tandem-cli", tandem::cli::interrupt_exit_code());
    }

    const bool fresh = session.tokens().empty() || prompt_cache;
    std::vector<int32_t> ids =
        prompt_ids.empty() ? model->tokenizer().tokenize(prompt, fresh, false) : parse_ids(prompt_ids);
    if (ids.empty() && fresh) throw tandem::Error(tandem::ErrorCode::kInvalidArgument, "the prompt has no tokens");
    const std::vector<int32_t> full_prompt = ids;  // what --json reports and stdout shows
    if (prompt_cache && !session.tokens().empty()) {
      const size_t saved = session.tokens().size();
      // --logits-out needs every prompt row: nothing is reused then.
      const bool same_start = ids.size() > 1 && session.tokens()[0] == ids[0];
      const size_t reused = logits_out.empty() ? session.reuse_prefix(ids) : 0;
      // A sliding-window model (Gemma 3) keeps its windowed KV only near the end: a prompt
      // that leaves the saved tokens further back than that reuses nothing.
      const bool behind_window = reused == 0 && logits_out.empty() && same_start && model->hparams().n_swa > 0;
      if (reused == 0) session.reset();
      std::fprintf(stderr,
                   "tandem-cli: prompt cache: reused %zu of %zu prompt tokens from %s (%zu saved tokens after "
                   "them dropped)%s\n",
                   reused, ids.size(), session_path.c_str(), saved - std::min(saved, reused),
                   !logits_out.empty() ? "; --logits-out evaluates the whole prompt"
                   : behind_window     ? "; the common prefix ends behind the sliding window's kept KV"
                                       : "");
      ids.erase(ids.begin(), ids.begin() + std::ptrdiff_t(reused));
    }
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
      tandem::write_file_atomic(logits_out, std::as_bytes(std::span<const float>(all)));
      r = session.generate(std::span<const int32_t>(), go);
      r.n_prompt = static_cast<int32_t>(ids.size());
      r.prompt_seconds = prompt_s;
    } else {
      if (!json_out) {
        const std::string shown = model->tokenizer().detokenize(full_prompt, true, false);
        std::fwrite(shown.data(), 1, shown.size(), stdout);
      }
      // Continuing a session saved with its context full: its last sampled token has no
      // position left (the library refuses with kContextOverflow); stop as a live run that
      // reaches n_ctx does, the session unchanged.
      auto generate = [&](std::span<const int32_t> p, const tandem::GenerateOptions& o) {
        try {
          return session.generate(p, o);
        } catch (const tandem::Error& e) {
          if (e.code() != tandem::ErrorCode::kContextOverflow || !ids.empty()) throw;
          tandem::GenerateResult full;
          full.finish = tandem::FinishReason::kLength;
          return full;
        }
      };
      // A long prompt (over 4 batches) is evaluated first, with progress on stderr.
      std::span<const int32_t> rest(ids);
      double long_prompt_s = 0.0;
      size_t long_prompt_done = 0;
      if (ids.size() > size_t(4) * size_t(n_batch)) {
        std::tie(long_prompt_done, long_prompt_s) = prefill_with_progress(session, ids, n_batch);
        rest = {};
      }
      if (migrate_after >= 0 && migrate_after < n_predict && !tandem::cli::interrupted()) {
        // Generate N tokens here, hand the session (KV pages under the contract) to a
        // second executor with its own thread pool, and continue there.
        second.emplace(model, tandem::CpuExecutorOptions{n_threads});
        tandem::GenerateOptions first = go;
        first.max_tokens = migrate_after;
        first.flush_text = false;
        r = generate(rest, first);
        if (r.finish == tandem::FinishReason::kLength && static_cast<int>(r.tokens.size()) == migrate_after) {
          const auto m = session.migrate(*second);
          std::fprintf(stderr, "\ntandem-cli: migrated after %d tokens: %d pages, %llu bytes, %.0f us\n", migrate_after,
                       m.pages, static_cast<unsigned long long>(m.bytes), m.seconds * 1e6);
          go.max_tokens = n_predict - migrate_after;
          auto after = session.generate(std::span<const int32_t>(), go);
          r.tokens.insert(r.tokens.end(), after.tokens.begin(), after.tokens.end());
          r.text += after.text;
          r.finish = after.finish;
          r.generate_seconds += after.generate_seconds;
        }
      } else if (!tandem::cli::interrupted()) {
        r = generate(rest, go);
      }
      if (rest.empty()) {
        r.n_prompt = static_cast<int32_t>(long_prompt_done);
        r.prompt_seconds = long_prompt_s;
        if (long_prompt_done < ids.size()) r.finish = tandem::FinishReason::kCancelled;
      }
    }
    if (r.finish == tandem::FinishReason::kLength && int(r.tokens.size()) < n_predict &&
        session.tokens().size() + 1 >= size_t(session.n_ctx())) {
      std::fprintf(stderr, "\ntandem-cli: the context of %d tokens is full; generation stopped (-c sets its size)\n",
                   session.n_ctx());
    }
    save_session();
    const double pp_tps = r.prompt_seconds > 0 ? r.n_prompt / r.prompt_seconds : 0.0;
    const double tg_tps = r.generate_seconds > 0 ? double(r.tokens.size()) / r.generate_seconds : 0.0;
    if (json_out) {
      nlohmann::json j;
      j["model"] = model->name();
      j["prompt_ids"] = full_prompt;
      j["ids"] = r.tokens;
      j["text"] = r.text;
      j["finish_reason"] = std::string(tandem::finish_reason_name(r.finish));
      j["timings"] = {{"load_s", load_s},
                      {"prompt_s", r.prompt_seconds},
                      {"prompt_tokens_per_s", pp_tps},
                      {"generate_s", r.generate_seconds},
                      {"generate_tokens_per_s", tg_tps},
                      {"threads", cpu_exec != nullptr ? cpu_exec->n_threads() : 0},
                      {"executor", cpu_exec != nullptr ? "cpu" : "gpu"}};
      std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    } else {
      std::fprintf(stdout, "\n");
    }
    if (tandem::cli::interrupted()) {
      std::fprintf(stderr, "tandem-cli: interrupted%s\n",
                   r.n_prompt < static_cast<int32_t>(ids.size()) && r.tokens.empty()
                       ? " during the prompt (the session keeps the part evaluated; the same -p resumes it)"
                       : "");
    }
    std::fprintf(stderr,
                 "\ntandem-cli: load %.1f ms | prompt %d tokens, %.1f tokens/s | generate %zu tokens, %.1f tokens/s "
                 "| %s | finish: %s\n",
                 load_s * 1e3, r.n_prompt, pp_tps, r.tokens.size(), tg_tps,
                 cpu_exec != nullptr ? fmt::format("{} threads", cpu_exec->n_threads()).c_str() : "GPU executor",
                 std::string(tandem::finish_reason_name(r.finish)).c_str());
    return tandem::cli::finish_stdout("tandem-cli", tandem::cli::interrupt_exit_code());
  } catch (const UsageError& e) {
    std::fprintf(stderr, "tandem-cli: error: %s\nRun with --help for more information.\n", e.what());
    return 2;
  } catch (const InterruptedRead&) {
    std::fprintf(stderr, "tandem-cli: interrupted while reading the input: nothing done\n");
    return tandem::cli::interrupt_exit_code();
  } catch (const tandem::Error& e) {
    std::fprintf(stderr, "tandem-cli: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem-cli: error: %s\n", e.what());
    return 1;
  }
}
