// tandem-bench (no subcommand): pp / tg speed with llama-bench's flags, tests and records.
// See bench_speed.hpp for the interface.
//
// Test definitions (the same as llama-bench's, so figures compare one to one):
//   pp P @ dD: D random tokens are put in the KV first (not timed); then one executor step
//              of P random tokens at positions D..D+P-1 is timed. tokens/s = P / seconds.
//   tg N @ dD: the same D-token KV; then N single-token steps at positions D..D+N-1 are
//              timed. tokens/s = N / seconds.
// Each test runs once as a warm-up, then -r times; the KV is cut back to the D depth tokens
// (KvSequence::truncate) before every run, so the depth is filled once per thread count and
// depth, as llama-bench reuses its depth state. avg_ts / stddev_ts are the mean and the
// sample standard deviation (n - 1) of the per-run tokens/s, as llama-bench computes them.
#include "bench_speed.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_kernels.hpp"
#include "gpu_layers.hpp"
#include "kv_cache_type.hpp"
#include "tandem/core/thread_pool.hpp"
#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/kv/kv_store.hpp"
#include "tandem/model/model.hpp"
#include "tandem/node/node.hpp"

#ifndef TANDEM_BUILD_COMMIT
#define TANDEM_BUILD_COMMIT "unknown"
#endif

namespace tandem::bench {
namespace {

using Clock = std::chrono::steady_clock;
using OrderedJson = nlohmann::ordered_json;

constexpr int kMaxTokens = 1 << 20;      // per -p / -n / -d value
constexpr size_t kMaxListValues = 4096;  // values one list may expand to
constexpr int32_t kDepthChunk = 512;     // tokens per step while filling the depth (untimed)

// Threads summing a 1 GiB buffer: bytes per second (median of 3 after a warm-up pass).
double measure_read_bandwidth(int n_threads) {
  const size_t n = (size_t(1) << 30) / sizeof(uint64_t);
  std::vector<uint64_t> buf(n, 1);
  ThreadPool pool(n_threads);
  std::vector<uint64_t> sums(size_t(pool.size()), 0);
  std::vector<double> times;
  for (int rep = 0; rep < 4; ++rep) {
    const auto t0 = Clock::now();
    pool.parallel_for(static_cast<int64_t>(n), 4096, [&](int64_t b, int64_t e, int t) {
      uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      int64_t i = b;
      for (; i + 4 <= e; i += 4) {
        s0 += buf[size_t(i)];
        s1 += buf[size_t(i + 1)];
        s2 += buf[size_t(i + 2)];
        s3 += buf[size_t(i + 3)];
      }
      for (; i < e; ++i) s0 += buf[size_t(i)];
      sums[size_t(t)] += s0 + s1 + s2 + s3;
    });
    times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  uint64_t total = 0;
  for (auto s : sums) total += s;
  if (total == 0) std::cerr << "";  // keep the reads observable
  times.erase(times.begin());       // warm-up
  std::sort(times.begin(), times.end());
  return double(n * sizeof(uint64_t)) / times[times.size() / 2];
}

std::string cpu_model_name() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) {
        auto v = line.substr(colon + 1);
        v.erase(0, v.find_first_not_of(" \t"));
        return v;
      }
    }
  }
  return "unknown";
}

std::string build_commit() {
  const char* env = std::getenv("TANDEM_COMMIT");
  return env && *env ? env : TANDEM_BUILD_COMMIT;
}

std::array<double, 3> load_average() {
  std::array<double, 3> l{-1.0, -1.0, -1.0};
  if (::getloadavg(l.data(), 3) != 3) l = {-1.0, -1.0, -1.0};
  return l;
}

std::string utc_now_rfc3339() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%FT%TZ", &tm);
  return buf;
}

// GGUF general.file_type (llama.cpp's llama_ftype numbering) as a type name.
std::string file_type_name(const GgufFile& g) {
  static const std::map<uint64_t, const char*> names = {
      {0, "F32"},   {1, "F16"},   {2, "Q4_0"},  {3, "Q4_1"},  {7, "Q8_0"},  {8, "Q5_0"},  {9, "Q5_1"},
      {10, "Q2_K"}, {14, "Q4_K"}, {15, "Q4_K"}, {16, "Q5_K"}, {17, "Q5_K"}, {18, "Q6_K"}, {32, "BF16"}};
  const auto ft = g.get_uint("general.file_type");
  if (!ft) return "unknown type";
  const auto it = names.find(*ft);
  return it != names.end() ? it->second : fmt::format("file type {}", *ft);
}

std::string params_label(uint64_t n) {
  if (n >= 1000000000ull) return fmt::format("{:.1f}B", double(n) / 1e9);
  return n >= 1000000ull ? fmt::format("{:.0f}M", double(n) / 1e6) : fmt::format("{:.0f}K", double(n) / 1e3);
}

template <class T>
double mean(const std::vector<T>& v) {
  if (v.empty()) return 0.0;
  double s = 0.0;
  for (auto x : v) s += double(x);
  return s / double(v.size());
}

template <class T>
double sample_stddev(const std::vector<T>& v) {
  if (v.size() <= 1) return 0.0;
  const double m = mean(v);
  double s = 0.0;
  for (auto x : v) s += (double(x) - m) * (double(x) - m);
  return std::sqrt(s / double(v.size() - 1));
}

struct ModelInfo {
  std::string filename, type;
  uint64_t size = 0, n_params = 0, decode_bytes = 0;
};

struct TestRun {
  int n_prompt = 0, n_gen = 0, n_depth = 0, n_threads = 0;
  std::string kv_type;  // the store's KV type, for K and V (f16, f32, q8_0)
  std::string test_time;
  std::vector<uint64_t> samples_ns;
  std::array<double, 3> load_before{}, load_after{};
  double read_bandwidth = 0.0;  // bytes/s, tg tests only (0 = not measured)
};

std::string test_name(const TestRun& t) {
  std::string s = t.n_prompt > 0 ? fmt::format("pp{}", t.n_prompt) : fmt::format("tg{}", t.n_gen);
  if (t.n_depth > 0) s += fmt::format(" @ d{}", t.n_depth);
  return s;
}

std::vector<double> samples_ts(const TestRun& t) {
  std::vector<double> ts;
  const double tokens = double(t.n_prompt + t.n_gen);
  for (auto ns : t.samples_ns) ts.push_back(1e9 * tokens / double(ns));
  return ts;
}

struct Env {
  std::string cpu, isa, commit;
};

OrderedJson record(const TestRun& t, const ModelInfo& m, const Env& env) {
  const auto ts = samples_ts(t);
  OrderedJson j;
  // llama-bench's record fields (those that have a meaning here), in its order.
  j["build_commit"] = env.commit;
  j["build_number"] = 0;
  j["cpu_info"] = env.cpu;
  j["gpu_info"] = "";
  j["backends"] = "CPU";
  j["model_filename"] = m.filename;
  j["model_type"] = m.type;
  j["model_size"] = m.size;
  j["model_n_params"] = m.n_params;
  j["n_threads"] = t.n_threads;
  j["type_k"] = t.kv_type;
  j["type_v"] = t.kv_type;
  j["n_prompt"] = t.n_prompt;
  j["n_gen"] = t.n_gen;
  j["n_depth"] = t.n_depth;
  j["test_time"] = t.test_time;
  j["avg_ns"] = uint64_t(std::llround(mean(t.samples_ns)));
  j["stddev_ns"] = uint64_t(std::llround(sample_stddev(t.samples_ns)));
  j["avg_ts"] = mean(ts);
  j["stddev_ts"] = sample_stddev(ts);
  j["samples_ns"] = t.samples_ns;
  j["samples_ts"] = ts;
  // Tandem's additions: the environment of this test.
  j["cpu_isa"] = env.isa;
  j["load_avg_before"] = t.load_before;
  j["load_avg_after"] = t.load_after;
  if (t.n_gen > 0 && t.read_bandwidth > 0) {
    const double limit = t.read_bandwidth / double(m.decode_bytes);
    j["decode_bytes_per_token"] = m.decode_bytes;
    j["read_bandwidth_bytes_per_s"] = t.read_bandwidth;
    j["bandwidth_limit_ts"] = limit;
    j["tg_fraction_of_bandwidth_limit"] = mean(ts) / limit;
  }
  return j;
}

// Bad flag values: exit 2 with the flag named.
struct FlagError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::vector<int> parse_flag(const std::vector<std::string>& lists, const char* flag, int lo, int hi) {
  std::vector<int> out;
  for (const auto& l : lists) {
    std::vector<int> v;
    try {
      v = parse_int_list(l, lo, hi);
    } catch (const std::invalid_argument& e) {
      throw FlagError(fmt::format("{}: {}", flag, e.what()));
    }
    out.insert(out.end(), v.begin(), v.end());
    if (out.size() > kMaxListValues) throw FlagError(fmt::format("{}: more than {} values", flag, kMaxListValues));
  }
  return out;
}

// The items of a flag's comma-separated lists (the flag may repeat), in order; an empty item
// is a FlagError naming `flag`.
std::vector<std::string> split_items(const std::vector<std::string>& lists, const char* flag) {
  std::vector<std::string> out;
  for (const auto& l : lists) {
    size_t start = 0;
    for (;;) {
      const size_t comma = l.find(',', start);
      out.push_back(l.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
      if (out.back().empty()) throw FlagError(fmt::format("{}: '{}': empty item", flag, l));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
  return out;
}

// Items (or lists) joined with commas, as they would be typed: -ngl 0 -ngl 99 as "0,99".
std::string join_items(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ",") + x;
  return s;
}

// The KV types of -ctk and -ctv lists (comma-separated items; the flags may repeat), paired
// item by item: a Tandem store holds one type for K and V, so the i-th K type must equal the
// i-th V type (cli::resolve_cache_types), and the lists must be as long.
std::vector<KvDtype> parse_cache_types(const std::vector<std::string>& k_lists,
                                       const std::vector<std::string>& v_lists) {
  const std::vector<std::string> ks = split_items(k_lists, "--cache-type-k"),
                                 vs = split_items(v_lists, "--cache-type-v");
  if (ks.size() > kMaxListValues || vs.size() > kMaxListValues) {
    throw FlagError(fmt::format("--cache-type-k/-v: more than {} values", kMaxListValues));
  }
  std::vector<KvDtype> out;
  for (size_t i = 0; i < std::max(ks.size(), vs.size()); ++i) {
    KvDtype d{};
    const std::string bad = i < ks.size() && i < vs.size() ? cli::resolve_cache_types(ks[i], vs[i], d) : "";
    if (!bad.empty()) throw FlagError(bad);
    if (i >= ks.size() || i >= vs.size()) {
      throw FlagError(
          fmt::format("--cache-type-k {} and --cache-type-v {} differ: Tandem's KV store holds one type for K and V "
                      "(give both the same list)",
                      join_items(ks), join_items(vs)));
    }
    out.push_back(d);
  }
  return out;
}

// `v` given `times` times over: -ngl 0,0 runs every test twice, as -t 1,1 does.
std::vector<KvDtype> repeat_list(const std::vector<KvDtype>& v, size_t times) {
  std::vector<KvDtype> out;
  for (size_t i = 0; i < times; ++i) out.insert(out.end(), v.begin(), v.end());
  return out;
}

}  // namespace

std::vector<int> parse_int_list(const std::string& text, int lo, int hi) {
  std::vector<int> out;
  if (text.empty()) throw std::invalid_argument("empty list");
  size_t pos = 0;
  auto number = [&]() -> int64_t {
    const size_t start = pos;
    int64_t v = 0;
    while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) {
      v = v * 10 + (text[pos] - '0');
      if (v > (int64_t(1) << 40)) throw std::invalid_argument(fmt::format("'{}': number too large", text));
      ++pos;
    }
    if (pos == start) {
      throw std::invalid_argument(fmt::format("'{}': expected a number at character {}", text, start + 1));
    }
    return v;
  };
  for (;;) {
    const int64_t first = number();
    int64_t last = first, step = 1;
    char op = '+';
    if (pos < text.size() && text[pos] == '-') {
      ++pos;
      last = number();
      if (pos < text.size() && (text[pos] == '+' || text[pos] == '*')) {
        op = text[pos++];
        step = number();
      }
      if (last < first) throw std::invalid_argument(fmt::format("'{}': range ends below its start", text));
      if ((op == '+' && step < 1) || (op == '*' && (step < 2 || first < 1))) {
        throw std::invalid_argument(fmt::format("'{}': range step does not advance", text));
      }
    }
    for (int64_t v = first; v <= last; v = op == '+' ? v + step : v * step) {
      if (v < lo || v > hi) throw std::invalid_argument(fmt::format("'{}': {} is outside {}..{}", text, v, lo, hi));
      if (out.size() >= kMaxListValues) {
        throw std::invalid_argument(fmt::format("'{}': more than {} values", text, kMaxListValues));
      }
      out.push_back(int(v));
    }
    if (pos == text.size()) break;
    if (text[pos] != ',') {
      throw std::invalid_argument(fmt::format("'{}': unexpected '{}' at character {}", text, text[pos], pos + 1));
    }
    ++pos;
    if (pos == text.size()) throw std::invalid_argument(fmt::format("'{}': ends with a comma", text));
  }
  return out;
}

int run_speed(const SpeedOptions& opt) {
  std::vector<int> prompts, gens, depths, threads, gpu_layers;
  std::vector<KvDtype> kv_dtypes;
  std::string format = opt.output.empty() ? (opt.json ? "json" : "md") : opt.output;
  try {
    if (format != "md" && format != "json" && format != "jsonl") {
      throw FlagError(fmt::format("--output: '{}' is not one of md, json, jsonl", format));
    }
    if (opt.json && format != "json") throw FlagError("--json: conflicts with --output " + format);
    prompts = parse_flag(opt.prompt, "--n-prompt", 0, kMaxTokens);
    gens = parse_flag(opt.gen, "--n-gen", 0, kMaxTokens);
    depths = parse_flag(opt.depth, "--n-depth", 0, kMaxTokens);
    threads = parse_flag(opt.threads, "--threads", 0, 512);
    {
      // A layer count other than 0 (negative, beyond int, auto, all: what llama.cpp takes)
      // gets the CPU-only message tandem-cli gives; malformed items parse_flag's.
      const auto items = split_items(opt.gpu_layers, "--n-gpu-layers");
      const std::string typed = join_items(opt.gpu_layers);
      if (std::any_of(items.begin(), items.end(),
                      [](const std::string& i) { return cli::is_nonzero_layer_count(i); })) {
        throw FlagError(cli::cpu_only_gpu_layers_error("tandem-bench's speed mode", typed));
      }
      gpu_layers = parse_flag(opt.gpu_layers, "--n-gpu-layers", 0, INT32_MAX);
      if (std::any_of(gpu_layers.begin(), gpu_layers.end(), [](int n) { return n != 0; })) {
        throw FlagError(cli::cpu_only_gpu_layers_error("tandem-bench's speed mode", typed));
      }
    }
    if (opt.reps < 1) throw FlagError("--repetitions: must be at least 1");
    kv_dtypes = parse_cache_types(opt.cache_type_k, opt.cache_type_v);
  } catch (const FlagError& e) {
    std::cerr << "tandem-bench: error: " << e.what() << "\n";
    return 2;
  }
  prompts.erase(std::remove(prompts.begin(), prompts.end(), 0), prompts.end());
  gens.erase(std::remove(gens.begin(), gens.end(), 0), gens.end());

  bool opened = false;  // json: "[" printed
  bool first_record = true;
  auto close_json = [&] {
    if (opened) std::cout << (first_record ? "]\n" : "\n]\n");
    opened = false;
  };
  try {
    auto model = Model::load(opt.model);
    const auto& hp = model->hparams();
    ModelInfo mi;
    mi.filename = opt.model;
    mi.size = model->weight_bytes();
    for (const auto& t : model->gguf().tensors()) mi.n_params += t.n_elements;
    mi.type = fmt::format("{} {} {}", arch_name(hp.arch), params_label(mi.n_params), file_type_name(model->gguf()));
    mi.decode_bytes = model->decode_bytes_per_token();
    const std::string cpu = cpu_model_name(), commit = build_commit();
    std::string isa(kernels::cpu_isa_name());  // + "+repack" once an executor says it repacks Q4_0

    const int max_depth = depths.empty() ? 0 : *std::max_element(depths.begin(), depths.end());
    int max_timed = 1;
    for (int p : prompts) max_timed = std::max(max_timed, p);
    for (int n : gens) max_timed = std::max(max_timed, n);
    const int32_t n_ctx = max_depth + max_timed + 1;
    // As llama-bench: type_k / type_v columns only when a KV type is not the default f16.
    const bool kv_f16 = std::all_of(kv_dtypes.begin(), kv_dtypes.end(), [](KvDtype d) { return d == KvDtype::kF16; });
    std::mt19937 rng(42);
    std::uniform_int_distribution<int32_t> tok(0, hp.n_vocab - 1);
    std::vector<float> logits(static_cast<size_t>(hp.n_vocab));

    Env env{cpu, isa, commit};
    std::vector<TestRun> done;
    if (format == "md") {
      fmt::print("| {:<30} | {:>10} | {:>10} | {:<7} | {:>7} | {:<7} |{} {:>15} | {:>20} | {:>17} |\n", "model", "size",
                 "params", "backend", "threads", "isa", kv_f16 ? "" : " type_k | type_v |", "test", "t/s",
                 "load before/after");
      fmt::print("| {:-<30} | {:->10} | {:->10} | {:-<7} | {:->7} | {:-<7} |{} {:->15} | {:->20} | {:->17} |\n", ":",
                 ":", ":", ":", ":", ":", kv_f16 ? "" : " -----: | -----: |", ":", ":", ":");
    } else if (format == "json") {
      std::cout << "[\n";
      opened = true;
    }
    std::cout.flush();

    auto emit = [&](const TestRun& t) {
      if (format == "md") {
        const double gib = double(mi.size) / double(1 << 30);
        const std::string size =
            gib < 1.0 ? fmt::format("{:.2f} MiB", double(mi.size) / double(1 << 20)) : fmt::format("{:.2f} GiB", gib);
        const std::string params = mi.n_params < 1000000000ull ? fmt::format("{:.2f} M", double(mi.n_params) / 1e6)
                                                               : fmt::format("{:.2f} B", double(mi.n_params) / 1e9);
        const auto ts = samples_ts(t);
        fmt::print("| {:<30} | {:>10} | {:>10} | {:<7} | {:>7} | {:<7} |{} {:>15} | {:>20} | {:>17} |\n", mi.type, size,
                   params, "CPU", t.n_threads, isa, kv_f16 ? "" : fmt::format(" {:>6} | {:>6} |", t.kv_type, t.kv_type),
                   test_name(t), fmt::format("{:.2f} ± {:.2f}", mean(ts), sample_stddev(ts)),
                   fmt::format("{:.2f}/{:.2f}", t.load_before[0], t.load_after[0]));
      } else if (format == "json") {
        const std::string body = record(t, mi, env).dump(2);
        std::string indented = "  ";
        for (char c : body) {
          indented += c;
          if (c == '\n') indented += "  ";
        }
        std::cout << (first_record ? "" : ",\n") << indented;
      } else {
        std::cout << record(t, mi, env).dump() << "\n";
      }
      first_record = false;
      std::cout.flush();
    };

    // llama-bench's order: GPU layers outside KV types outside threads. Every -ngl item is 0.
    for (const KvDtype kv_dtype : repeat_list(kv_dtypes, gpu_layers.size())) {
      KvStoreOptions so;
      so.layout = KvLayout::for_model(hp, 16, kv_dtype);
      so.host_pages = compute_tier_pages(so.layout, n_ctx, n_ctx, 1, 0);  // the node's rule, one sequence
      KvStore store(std::move(so));
      for (int nt : threads) {
        CpuQ4Executor exec(model, CpuExecutorOptions{nt});
        isa = std::string(kernels::cpu_isa_name()) + (exec.repacked_weights() ? "+repack" : "");
        env.isa = isa;
        const double bw = opt.no_bandwidth || gens.empty() ? 0.0 : measure_read_bandwidth(exec.n_threads());
        for (int d : depths) {
          if (prompts.empty() && gens.empty()) break;
          KvSequence seq(store, n_ctx);
          for (int32_t pos = 0; pos < d; pos += kDepthChunk) {  // the depth: untimed
            std::vector<int32_t> ids(static_cast<size_t>(std::min(kDepthChunk, d - pos)));
            for (auto& id : ids) id = tok(rng);
            SequenceStep st{&seq, ids, pos, LogitsRows::kLast};
            exec.step(std::span<const SequenceStep>(&st, 1), logits);
          }
          auto run_once = [&](int p, int n) -> uint64_t {
            seq.truncate(d);
            std::vector<int32_t> ids(static_cast<size_t>(p));
            for (auto& id : ids) id = tok(rng);
            const auto t0 = Clock::now();
            if (p > 0) {
              SequenceStep st{&seq, ids, d, LogitsRows::kLast};
              exec.step(std::span<const SequenceStep>(&st, 1), logits);
            }
            for (int i = 0; i < n; ++i) {
              const int32_t id = tok(rng);
              SequenceStep st{&seq, std::span<const int32_t>(&id, 1), d + i, LogitsRows::kLast};
              exec.step(std::span<const SequenceStep>(&st, 1), logits);
            }
            return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
          };
          auto run_test = [&](int p, int n) {
            TestRun t;
            t.n_prompt = p;
            t.n_gen = n;
            t.n_depth = d;
            t.n_threads = exec.n_threads();
            t.kv_type = std::string(kv_dtype_name(kv_dtype));
            t.test_time = utc_now_rfc3339();
            t.read_bandwidth = n > 0 ? bw : 0.0;
            t.load_before = load_average();
            run_once(p, n);  // warm-up
            for (int r = 0; r < opt.reps; ++r) t.samples_ns.push_back(std::max<uint64_t>(1, run_once(p, n)));
            t.load_after = load_average();
            emit(t);
            done.push_back(std::move(t));
          };
          for (int p : prompts) run_test(p, 0);
          for (int n : gens) run_test(0, n);
        }
      }
    }
    close_json();
    if (format == "md") {
      fmt::print("\nbuild: {} | cpu: {} | isa: {} | model: {}\n", commit, cpu, isa, mi.filename);
      // The KV type is named as in the table: whenever it has type_k / type_v columns.
      const bool name_kv = !kv_f16 || kv_dtypes.size() > 1;
      for (const auto& t : done) {
        if (t.n_gen == 0 || t.read_bandwidth <= 0) continue;
        const double limit = t.read_bandwidth / double(mi.decode_bytes), avg = mean(samples_ts(t));
        fmt::print(
            "{}, {} threads{}: read bandwidth {:.2f} GB/s; decode reads {:.2f} MB/token -> limit {:.2f} t/s; "
            "tg reaches {:.0f}% of it\n",
            test_name(t), t.n_threads, name_kv ? fmt::format(", type_k {}", t.kv_type) : std::string(),
            t.read_bandwidth / 1e9, double(mi.decode_bytes) / 1e6, limit, 100.0 * avg / limit);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    close_json();
    std::cout.flush();
    std::cerr << "tandem-bench: error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace tandem::bench
