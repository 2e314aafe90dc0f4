// tandem-quantize: convert a GGUF model to the executors' formats once, so it loads by
// mmap with no conversion at load (llama-quantize's conventions and output).
//
//   tandem-quantize IN.gguf OUT.gguf [q4_0|q8_0] [--pure] [-t N]
//
// Every weight becomes Q4_0 (or Q8_0); the output projection (or the tied token
// embedding) becomes Q8_0 unless --pure; norms and other 1-D tensors are copied. The
// bytes equal llama.cpp's llama-quantize (--allow-requantize) output tensor for tensor
// (include/tandem/model/requantize.hpp has the rule). OUT is written through OUT.tmp and
// renamed, so a failure never leaves a half-written OUT. Progress goes to stderr.
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <string>

#include "tandem/core/error.hpp"
#include "tandem/gguf/gguf.hpp"
#include "tandem/model/requantize.hpp"

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);  // a closed stdout pipe: a failed write (exit 1), not a kill
  CLI::App app{"tandem-quantize: convert a GGUF model to Q4_0 or Q8_0 (llama-quantize's rule and bytes)",
               "tandem-quantize"};
  std::string in, out, type = "q4_0";
  tandem::QuantizeFileOptions opt;
  app.add_option("input", in, "input GGUF (F32, F16, BF16, Q4_0..Q8_0, Q2_K..Q6_K weights)")->required();
  app.add_option("output", out, "output GGUF")->required();
  app.add_option("type", type, "target type: q4_0 (default) or q8_0")
      ->check(CLI::IsMember({"q4_0", "q8_0", "Q4_0", "Q8_0"}));
  app.add_flag("--pure", opt.pure, "every weight to the target type (no Q8_0 output projection)");
  app.add_option("-t,--threads", opt.n_threads, "threads (default: physical cores)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // --help: 0; a refused flag: usage, 2 (as the other tools)
    return rc == 0 ? 0 : 2;
  }
  std::error_code ec;
  if (std::filesystem::exists(out, ec) && std::filesystem::equivalent(in, out, ec)) {
    fmt::print(stderr, "tandem-quantize: error: the output {} is the input file; write to another path\n", out);
    return 2;
  }
  opt.target = (type == "q8_0" || type == "Q8_0") ? tandem::GgmlType::kQ8_0 : tandem::GgmlType::kQ4_0;

  const auto start = std::chrono::steady_clock::now();
  // A terminal gets one line rewritten per tensor; a log gets a line per tenth of the tensors.
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  opt.on_tensor = [tty](size_t done, size_t total, const std::string& name, tandem::GgmlType t) {
    if (tty) {
      fmt::print(stderr, "\r[{:4}/{:4}] {:<40} {:<5}", done, total, name.substr(0, 40), tandem::ggml_type_name(t));
      if (done == total) fmt::print(stderr, "\n");
    } else if (done * 10 / total != (done - 1) * 10 / total) {
      fmt::print(stderr, "[{:4}/{:4}] {} -> {}\n", done, total, name, tandem::ggml_type_name(t));
    }
  };
  try {
    const auto r = tandem::quantize_file(in, out, opt);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    fmt::print(stderr, "tandem-quantize: {} tensors ({} converted), {:.1f} MiB -> {:.1f} MiB in {:.2f} s: {}\n",
               r.n_tensors, r.n_converted, double(r.bytes_in) / 1048576.0, double(r.bytes_out) / 1048576.0, s, out);
    // The cost of requantising (an input already quantised), from llama.cpp's
    // llama-perplexity (GPL-3 text, -c 512, 14 chunks; benchmarks/README.md).
    const auto& tensors = tandem::GgufFile::open(in)->tensors();
    const bool requantised =
        std::any_of(tensors.begin(), tensors.end(), [](const auto& t) { return tandem::ggml_is_quantized(t.type); });
    if (r.n_converted > 0 && requantised) {
      fmt::print(
          stderr, "tandem-quantize: {}\n",
          opt.target == tandem::GgmlType::kQ4_0
              ? "requantising an already quantised file to Q4_0 compounds its rounding: perplexity +25 % on SmolLM2's "
                "Q4_1 file, +50 % on Gemma 3's Q4_K_M (Q8_0: within 0.01 %, what Model::load converts "
                "types without a kernel to)"
              : "a Q8_0 conversion costs within 0.01 % perplexity (measured on SmolLM2's Q4_1 file and "
                "Gemma 3's Q4_K_M)");
    }
  } catch (const tandem::Error& e) {
    fmt::print(stderr, "\ntandem-quantize: error [{}]: {}\n", tandem::error_code_name(e.code()), e.what());
    return 1;
  }
  return 0;
}
