// tandem-gpu-bench: prompt processing (pp) and token generation (tg) speed of the GPU
// executor, as llama-bench measures them: pp = one step of P prompt tokens from an empty
// context; tg = N single-token steps after D tokens of context (llama-bench's -d: the D
// tokens are prefilled, untimed, in steps of 512). KV pages in VRAM.
//
//   tandem-gpu-bench -m MODEL.gguf [-p 512] [-n 128] [-d 0] [-r 3] [--device 0] [--json]
//
// --help prints the flags and exits 0; a malformed or out-of-range value exits 2 with the
// flag and the value named. The flags are read before the model and the device are touched.
// Prints the environment (device, driver, weights in VRAM) beside the figures.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tandem/exec/gpu/gpu_q4_executor.hpp"
#include "tandem/node/node.hpp"

using namespace tandem;

namespace {

struct Stats {
  double mean = 0, sd = 0;
};
Stats stats(const std::vector<double>& v) {
  Stats s;
  for (double x : v) s.mean += x;
  s.mean /= double(v.size());
  for (double x : v) s.sd += (x - s.mean) * (x - s.mean);
  s.sd = v.size() > 1 ? std::sqrt(s.sd / double(v.size() - 1)) : 0.0;
  return s;
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr const char* kUsage =
    "usage: tandem-gpu-bench -m MODEL.gguf [-p 512] [-n 128] [-d 0] [-r 3] [--device 0] [--json]\n"
    "  -m MODEL.gguf  the model (required)\n"
    "  -p N           prompt tokens of the pp test, 0..1048576 (0 = no pp test)\n"
    "  -n N           generated tokens of the tg test, 0..1048576 (0 = no tg test)\n"
    "  -d N           tokens of context before the tg test, 0..1048576\n"
    "  -r N           timed runs per test after one warm-up, 1..10000\n"
    "  --device N     CUDA device index, 0..1023\n"
    "  --json         print one JSON object\n"
    "  -h, --help     print this and exit\n";

// A refused command line: the reason, then the usage, on stderr; exit status 2.
int usage_error(const std::string& reason) {
  std::fprintf(stderr, "tandem-gpu-bench: error: %s\n%s", reason.c_str(), kUsage);
  return 2;
}

// The whole of `text` as a decimal integer in [lo, hi], else false.
bool parse_int(const char* text, int lo, int hi, int& out) {
  const char* end = text + std::strlen(text);
  long long v = 0;
  const auto [ptr, ec] = std::from_chars(text, end, v);
  if (ptr == text || ptr != end || ec != std::errc() || v < lo || v > hi) return false;
  out = int(v);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);  // a closed stdout pipe: a failed write (exit 1), not a kill
  std::string path;
  int p = 512, n = 128, depth = 0, reps = 3, device = 0;
  bool json = false;
  constexpr int kMaxTokens = 1 << 20;
  struct IntFlag {
    const char* name;
    int* value;
    int lo, hi;
  };
  const IntFlag int_flags[] = {{"-p", &p, 0, kMaxTokens},
                               {"-n", &n, 0, kMaxTokens},
                               {"-d", &depth, 0, kMaxTokens},
                               {"-r", &reps, 1, 10000},
                               {"--device", &device, 0, 1023}};
  // Every flag is read here, before the model is loaded and before any CUDA call.
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
  }
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") {
      json = true;
      continue;
    }
    const IntFlag* f = nullptr;
    for (const auto& x : int_flags) {
      if (a == x.name) f = &x;
    }
    if (a != "-m" && f == nullptr) return usage_error(fmt::format("unknown argument '{}'", a));
    if (i + 1 >= argc) return usage_error(fmt::format("{} needs a value", a));
    const char* v = argv[++i];
    if (a == "-m") {
      path = v;
    } else if (!parse_int(v, f->lo, f->hi, *f->value)) {
      return usage_error(fmt::format("{} '{}' is not an integer in {}..{}", a, v, f->lo, f->hi));
    }
  }
  if (path.empty()) return usage_error("-m MODEL.gguf is required");
  try {
    auto model = Model::load(path);
    const HParams& hp = model->hparams();
    const double t_up = now();
    GpuQ4Executor gpu(model, GpuExecutorOptions{device});
    const double upload_s = now() - t_up;
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, device);
    int driver = 0, runtime = 0;
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);

    const int32_t ctx = std::max(p, depth + n) + 1;
    const int32_t page_size = 16;
    const KvLayout layout = KvLayout::for_model(hp, page_size);
    auto store = make_kv_store(gpu, layout, KvPageCounts{compute_tier_pages(layout, ctx, ctx, 1, 0), 0, 0});
    std::vector<float> logits(size_t(hp.n_vocab));
    std::vector<int32_t> prompt(size_t(std::max({p, depth, 1})));
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t(3 + (i * 131) % size_t(hp.n_vocab - 3));

    auto run_pp = [&]() {
      KvSequence seq(*store, ctx, KvTier::kDevice);
      SequenceStep s{&seq, std::span<const int32_t>(prompt.data(), size_t(p)), 0, LogitsRows::kLast};
      const double t0 = now();
      gpu.step(std::span<const SequenceStep>(&s, 1), logits);
      return now() - t0;
    };
    auto run_tg = [&]() {
      KvSequence seq(*store, ctx, KvTier::kDevice);
      for (int d0 = 0; d0 < depth; d0 += 512) {  // the context, untimed
        const int dn = std::min(512, depth - d0);
        SequenceStep s{&seq, std::span<const int32_t>(prompt.data() + d0, size_t(dn)), d0, LogitsRows::kLast};
        gpu.step(std::span<const SequenceStep>(&s, 1), logits);
      }
      const double t0 = now();
      for (int i = 0; i < n; ++i) {
        const int32_t tok = prompt[size_t(i) % prompt.size()];
        SequenceStep s{&seq, std::span<const int32_t>(&tok, 1), depth + i, LogitsRows::kLast};
        gpu.step(std::span<const SequenceStep>(&s, 1), logits);
      }
      return now() - t0;
    };
    std::vector<double> pp_tps, tg_tps;
    if (p > 0) {
      run_pp();  // warm-up (buffers grow once)
      for (int r = 0; r < reps; ++r) pp_tps.push_back(double(p) / run_pp());
    }
    if (n > 0) {
      run_tg();
      for (int r = 0; r < reps; ++r) tg_tps.push_back(double(n) / run_tg());
    }
    const Stats pp = p > 0 ? stats(pp_tps) : Stats{}, tg = n > 0 ? stats(tg_tps) : Stats{};
    const double weights_mib = double(gpu.weight_bytes()) / (1024.0 * 1024.0);
    const double scratch_mib = double(gpu.scratch_bytes()) / (1024.0 * 1024.0);
    const char* commit = std::getenv("TANDEM_COMMIT");
    if (json) {
      fmt::print(
          "{{\"model\": \"{}\", \"device\": \"{}\", \"cc\": \"{}.{}\", \"driver\": {}, \"runtime\": {}, "
          "\"weights_vram_mib\": {:.1f}, \"scratch_vram_mib\": {:.1f}, \"upload_s\": {:.3f}, \"p\": {}, \"n\": {}, "
          "\"depth\": {}, "
          "\"reps\": {}, \"pp_tps\": {:.2f}, \"pp_sd\": {:.2f}, \"tg_tps\": {:.2f}, \"tg_sd\": {:.2f}, "
          "\"commit\": \"{}\"}}\n",
          model->name(), prop.name, prop.major, prop.minor, driver, runtime, weights_mib, scratch_mib, upload_s, p, n,
          depth, reps, pp.mean, pp.sd, tg.mean, tg.sd, commit ? commit : "");
    } else {
      fmt::print(
          "model {} | device {} (sm_{}{}) | driver {} runtime {} | weights in VRAM {:.1f} MiB, scratch "
          "{:.1f} MiB, upload {:.2f} s\n",
          model->name(), prop.name, prop.major, prop.minor, driver, runtime, weights_mib, scratch_mib, upload_s);
      if (p > 0) fmt::print("pp{}: {:.2f} +- {:.2f} tokens/s\n", p, pp.mean, pp.sd);
      if (n > 0) fmt::print("tg{}@d{}: {:.2f} +- {:.2f} tokens/s\n", n, depth, tg.mean, tg.sd);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem-gpu-bench: error: %s\n", e.what());
    return 1;
  }
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    std::fprintf(stderr, "tandem-gpu-bench: error: cannot write standard output\n");
    return 1;
  }
  return 0;
}
