// tandem-bench: prompt processing (pp) and token generation (tg) speed, like llama-bench.
//
//   tandem-bench -m MODEL.gguf [-p 512] [-n 128] [-t 2] [-r 3] [--json]
//
// pp: one executor step over p random prompt tokens in an empty sequence (tokens/s).
// tg: n single-token decode steps starting from an empty sequence (tokens/s).
// Each figure is the median of r runs after one warm-up. The same run measures the
// machine's read bandwidth (t threads summing a 1 GiB buffer) and reports decode speed
// as a fraction of the bandwidth limit: bytes of weights read per token x tokens/s /
// bandwidth.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "tandem/cpu_q4_executor.hpp"
#include "tandem/kv_store.hpp"
#include "tandem/model.hpp"
#include "tandem/thread_pool.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double measure_read_bandwidth(int n_threads) {
  const size_t n = (size_t(1) << 30) / sizeof(uint64_t);
  std::vector<uint64_t> buf(n, 1);
  tandem::ThreadPool pool(n_threads);
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
  return double(n * sizeof(uint64_t)) / median(times);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tandem-bench: prompt (pp) and generation (tg) tokens/s"};
  std::string model_path;
  int n_prompt = 512, n_gen = 128, n_threads = 0, reps = 3;
  bool json_out = false, no_bandwidth = false;
  app.add_option("-m,--model", model_path, "GGUF model")->required();
  app.add_option("-p,--n-prompt", n_prompt, "prompt tokens (0 = skip pp)")->check(CLI::NonNegativeNumber);
  app.add_option("-n,--n-gen", n_gen, "generated tokens (0 = skip tg)")->check(CLI::NonNegativeNumber);
  app.add_option("-t,--threads", n_threads, "threads (default: physical cores)");
  app.add_option("-r,--repetitions", reps, "runs per test (median reported)")->check(CLI::PositiveNumber);
  app.add_flag("--json", json_out, "print JSON");
  app.add_flag("--no-bandwidth", no_bandwidth, "skip the memory bandwidth measurement");
  CLI11_PARSE(app, argc, argv);

  try {
    auto model = tandem::Model::load(model_path);
    const auto& hp = model->hparams();
    tandem::CpuQ4Executor exec(model, tandem::CpuExecutorOptions{n_threads});
    const int32_t n_ctx = std::max(n_prompt, n_gen) + 1;
    tandem::KvStoreOptions so;
    so.layout = tandem::KvLayout::for_model(hp);
    so.host_pages = (n_ctx + 15) / 16;
    tandem::KvStore pool(std::move(so));
    std::mt19937 rng(42);
    std::uniform_int_distribution<int32_t> tok(0, hp.n_vocab - 1);
    std::vector<float> logits(static_cast<size_t>(hp.n_vocab));

    auto run_pp = [&] {
      std::vector<int32_t> ids(static_cast<size_t>(n_prompt));
      for (auto& id : ids) id = tok(rng);
      tandem::KvSequence kv(pool, n_ctx);
      tandem::SequenceStep st{&kv, ids, 0, tandem::LogitsRows::kLast};
      const auto t0 = Clock::now();
      exec.step(std::span<const tandem::SequenceStep>(&st, 1), logits);
      return n_prompt / std::chrono::duration<double>(Clock::now() - t0).count();
    };
    auto run_tg = [&] {
      tandem::KvSequence kv(pool, n_ctx);
      const auto t0 = Clock::now();
      for (int i = 0; i < n_gen; ++i) {
        const int32_t id = tok(rng);
        tandem::SequenceStep st{&kv, std::span<const int32_t>(&id, 1), i, tandem::LogitsRows::kLast};
        exec.step(std::span<const tandem::SequenceStep>(&st, 1), logits);
      }
      return n_gen / std::chrono::duration<double>(Clock::now() - t0).count();
    };
    auto bench = [&](auto&& fn) {
      fn();  // warm-up
      std::vector<double> v;
      for (int r = 0; r < reps; ++r) v.push_back(fn());
      return v;
    };
    std::vector<double> pp, tg;
    if (n_prompt > 0) pp = bench(run_pp);
    if (n_gen > 0) tg = bench(run_tg);
    const double bw = no_bandwidth ? 0.0 : measure_read_bandwidth(exec.n_threads());
    const double bytes_per_token = double(model->decode_bytes_per_token());
    const double tg_med = tg.empty() ? 0.0 : median(tg);
    const double pp_med = pp.empty() ? 0.0 : median(pp);
    const double bw_fraction = bw > 0 ? bytes_per_token * tg_med / bw : 0.0;

    if (json_out) {
      nlohmann::json j;
      j["model"] = model->name();
      j["model_bytes"] = model->weight_bytes();
      j["decode_bytes_per_token"] = model->decode_bytes_per_token();
      j["threads"] = exec.n_threads();
      j["repetitions"] = reps;
      if (!pp.empty()) j["pp"] = {{"n_prompt", n_prompt}, {"tokens_per_s", pp_med}, {"runs", pp}};
      if (!tg.empty()) j["tg"] = {{"n_gen", n_gen}, {"tokens_per_s", tg_med}, {"runs", tg}};
      if (bw > 0) {
        j["read_bandwidth_bytes_per_s"] = bw;
        j["tg_fraction_of_bandwidth_limit"] = bw_fraction;
      }
      std::cout << j.dump(2) << "\n";
    } else {
      fmt::print("| model | size | threads | test | tokens/s |\n|---|---:|---:|---|---:|\n");
      const std::string size = fmt::format("{:.2f} MiB", double(model->weight_bytes()) / (1 << 20));
      if (!pp.empty()) fmt::print("| {} | {} | {} | pp{} | {:.2f} |\n", model->name(), size, exec.n_threads(), n_prompt, pp_med);
      if (!tg.empty()) fmt::print("| {} | {} | {} | tg{} | {:.2f} |\n", model->name(), size, exec.n_threads(), n_gen, tg_med);
      if (bw > 0) {
        fmt::print("\nread bandwidth {:.2f} GB/s ({} threads); decode reads {:.2f} MB/token -> limit {:.2f} tokens/s; "
                   "tg reaches {:.0f}% of it\n",
                   bw / 1e9, exec.n_threads(), bytes_per_token / 1e6, bw / bytes_per_token, 100.0 * bw_fraction);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "tandem-bench: error: " << e.what() << "\n";
    return 1;
  }
}
