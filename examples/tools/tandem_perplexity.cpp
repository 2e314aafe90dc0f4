// tandem-perplexity: llama-perplexity's default mode on Tandem's CPU executor.
//
//   tandem-perplexity -m MODEL.gguf -f TEXT [-c 512] [-b 2048] [-t N] [--chunks N] [--convert q8_0|q4_0]
//
// The text file is read whole (one trailing newline dropped, as llama.cpp's -f does),
// tokenised with BOS when the vocabulary adds it, cut into chunks of -c tokens, and each
// chunk scored on its second half (include/tandem/session/perplexity.hpp has the exact rule).
// --convert: ModelOptions::convert_to, for weights the executors have no kernel for.
// stdout: the running `[i]x,` values, then `Final estimate: PPL = x +/- y`, as
// llama-perplexity prints them; progress and the model's load line go to stderr.
// Exit status: 0 done, 1 an error (named), 2 bad flags.
#include <fmt/format.h>

#include <CLI/CLI.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "tandem/core/error.hpp"
#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/session/perplexity.hpp"

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);  // a closed stdout pipe: a failed write (exit 1), not a kill
  CLI::App app{"tandem-perplexity: perplexity of a model on a text (llama-perplexity's method)", "tandem-perplexity"};
  std::string model_path, text_path;
  tandem::PerplexityOptions opt;
  int threads = 0;
  std::string convert = "q8_0";
  app.add_option("-m,--model", model_path, "model GGUF")->required();
  app.add_option("-f,--file", text_path, "text file")->required();
  app.add_option("-c,--ctx-size", opt.n_ctx, "tokens per chunk (default 512)")->check(CLI::Range(3, 1 << 20));
  app.add_option("-b,--batch-size", opt.n_batch, "tokens per step (default 2048)")->check(CLI::Range(1, 1 << 20));
  app.add_option("-t,--threads", threads, "threads (default: physical cores)")->check(CLI::Range(0, 1024));
  app.add_option("--chunks", opt.n_chunks, "chunks to evaluate (default -1: all)")->check(CLI::Range(-1, 1 << 30));
  app.add_option("--convert", convert,
                 "q8_0 (default): weights without a kernel (Q2_K, Q3_K) become Q8_0 at load, every other weight "
                 "runs as the file has it; q4_0: every quantised weight becomes Q4_0, as tandem-quantize writes it")
      ->check(CLI::IsMember({"q8_0", "q4_0", "Q8_0", "Q4_0"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  try {
    if (std::filesystem::is_directory(text_path)) {
      throw tandem::Error(tandem::ErrorCode::kInvalidArgument,
                          fmt::format("the text file {} is a directory", text_path));
    }
    std::ifstream f(text_path, std::ios::binary);
    if (!f) throw tandem::Error(tandem::ErrorCode::kIo, fmt::format("cannot open the text file {}", text_path));
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (f.bad()) throw tandem::Error(tandem::ErrorCode::kIo, fmt::format("cannot read the text file {}", text_path));
    if (!text.empty() && text.back() == '\n') text.pop_back();

    tandem::ModelOptions mo;
    mo.n_threads = threads;
    mo.convert_to = (convert == "q4_0" || convert == "Q4_0") ? tandem::GgmlType::kQ4_0 : tandem::GgmlType::kQ8_0;
    const auto model = tandem::Model::load(model_path, mo);
    tandem::CpuExecutorOptions eo;
    eo.n_threads = threads;
    tandem::CpuQ4Executor exec(model, eo);
    const auto tokens = model->tokenizer().tokenize(text, true, false);
    const int64_t n_chunk_max = int64_t(tokens.size()) / opt.n_ctx;
    const int64_t n_chunk = opt.n_chunks < 0 ? n_chunk_max : std::min<int64_t>(opt.n_chunks, n_chunk_max);
    if (opt.n_ctx > model->hparams().n_ctx_train && model->hparams().n_ctx_train > 0) {
      fmt::print(stderr, "perplexity: warning: the model was trained with only {} context tokens ({} specified)\n",
                 model->hparams().n_ctx_train, opt.n_ctx);
    }
    fmt::print(stderr,
               "perplexity: {} tokens; calculating perplexity over {} chunks, n_ctx={}, batch_size={}, {} threads\n",
               tokens.size(), n_chunk, opt.n_ctx, std::min(opt.n_batch, opt.n_ctx), exec.n_threads());
    const auto start = std::chrono::steady_clock::now();
    opt.on_chunk = [](int32_t i, double running) {
      fmt::print("[{}]{:.4f},", i, running);
      std::fflush(stdout);
    };
    const auto r = tandem::perplexity(exec, tokens, opt);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    fmt::print("\nFinal estimate: PPL = {:.4f} +/- {:.5f}\n", r.ppl, r.uncertainty);
    fmt::print(stderr, "perplexity: {} tokens scored in {:.2f} s\n", r.n_scored, s);
    if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
      throw tandem::Error(tandem::ErrorCode::kIo, "cannot write standard output");
    }
  } catch (const tandem::Error& e) {
    fmt::print(stderr, "\ntandem-perplexity: error [{}]: {}\n", tandem::error_code_name(e.code()), e.what());
    return 1;
  } catch (const std::exception& e) {  // the standard library's (a stream, an allocation)
    fmt::print(stderr, "\ntandem-perplexity: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
