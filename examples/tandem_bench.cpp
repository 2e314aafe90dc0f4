// tandem-bench: prompt processing (pp) and token generation (tg) speed, like llama-bench.
//
//   tandem-bench -m MODEL.gguf [-p 512] [-n 128] [-t 2] [-r 3] [--json]
//   tandem-bench kv -m MODEL.gguf [-c 4096] [-t 2] [--kv-dir DIR] [--json]
//
// kv: KV tier moves. A session of c prompt tokens is moved Host -> File -> Host (GB/s),
// beside a plain sequential write and read of a file of the same size in the same
// directory; then time-to-resume from the File tier and from a saved session file
// (bring back + one decode step) against recomputing the prefill.
//
// pp: one executor step over p random prompt tokens in an empty sequence (tokens/s).
// tg: n single-token decode steps starting from an empty sequence (tokens/s).
// Each figure is the median of r runs after one warm-up. The same run measures the
// machine's read bandwidth (t threads summing a 1 GiB buffer) and reports decode speed
// as a fraction of the bandwidth limit: bytes of weights read per token x tokens/s /
// bandwidth.
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include "bench_serve.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "tandem/cpu_q4_executor.hpp"
#include "tandem/kv_store.hpp"
#include "tandem/model.hpp"
#include "tandem/session.hpp"
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

double seconds_of(const std::function<void()>& fn) {
  const auto t0 = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Sequential write then read of `bytes` through a file in `dir` (page cache, no fsync:
// the same path the File tier's memory-mapped pages take), bytes per second each way. The
// file is unlinked as soon as it exists, so no exit path leaves it behind.
std::pair<double, double> file_bandwidth(const std::filesystem::path& dir, size_t bytes) {
  std::string name = (dir / "tandem-bench-seq.XXXXXX").string();
  const int fd = ::mkostemp(name.data(), O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(fmt::format("cannot create '{}': {}", name, std::strerror(errno)));
  ::unlink(name.c_str());
  std::vector<char> buf(size_t(1) << 20, 'x');
  auto fail = [&](const char* what) {
    const int err = errno;
    ::close(fd);
    throw std::runtime_error(fmt::format("cannot {} '{}': {}", what, name, std::strerror(err)));
  };
  const double w = seconds_of([&] {
    for (size_t done = 0; done < bytes;) {
      const ssize_t n = ::write(fd, buf.data(), std::min(buf.size(), bytes - done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail("write");
      done += size_t(n);
    }
  });
  if (::lseek(fd, 0, SEEK_SET) != 0) fail("rewind");
  size_t got = 0;
  const double r = seconds_of([&] {
    for (;;) {
      const ssize_t n = ::read(fd, buf.data(), buf.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail("read");
      if (n == 0) break;
      got += size_t(n);
    }
  });
  ::close(fd);
  return {double(bytes) / w, double(got) / r};
}

// Reports a failed write to stdout (a full disk, /dev/full) as an error: exit status 1.
int finish_stdout(int rc) {
  std::cout.flush();
  if (std::fflush(stdout) != 0 || std::ferror(stdout) || !std::cout) {
    std::fprintf(stderr, "tandem-bench: error: cannot write standard output: %s\n", std::strerror(errno ? errno : EIO));
    return rc == 0 ? 1 : rc;
  }
  return rc;
}

// A path removed when this object goes out of scope, on any return or exception.
struct RemovedOnExit {
  std::filesystem::path path;
  ~RemovedOnExit() {
    std::error_code ec;
    std::filesystem::remove(path, ec);
  }
};

int run_kv(const std::string& model_path, int n_ctx, int n_threads, const std::string& kv_dir, bool json_out) {
  auto model = tandem::Model::load(model_path);
  const auto& hp = model->hparams();
  tandem::CpuQ4Executor exec(model, tandem::CpuExecutorOptions{n_threads});
  const char* tmpdir = std::getenv("TMPDIR");
  const std::filesystem::path dir = !kv_dir.empty() ? kv_dir : tmpdir && *tmpdir ? tmpdir : "/tmp";
  tandem::KvStoreOptions so;
  so.layout = tandem::KvLayout::for_model(hp);
  so.host_pages = n_ctx / 16 + 2;
  so.file_pages = n_ctx / 16 + 2;
  so.file_dir = dir;
  auto store = std::make_shared<tandem::KvStore>(std::move(so));
  tandem::SessionOptions sopt;
  sopt.kv_store = store;
  sopt.n_ctx = n_ctx + 2;
  tandem::Session s(model, exec, sopt);
  std::mt19937 rng(1);
  std::vector<int32_t> ids(static_cast<size_t>(n_ctx - 1));
  for (auto& id : ids) id = int32_t(rng() % uint32_t(hp.n_vocab));
  const double prefill_s = seconds_of([&] { s.eval(ids); });
  // The first move grows and maps the file; the figures are of a second, warm round trip.
  const tandem::KvMoveStats cold = s.kv().move_to(tandem::KvTier::kFile);
  s.kv().move_to(tandem::KvTier::kHost);
  const tandem::KvMoveStats down = s.kv().move_to(tandem::KvTier::kFile);
  const tandem::KvMoveStats up = s.kv().move_to(tandem::KvTier::kHost);
  const auto [seq_w, seq_r] = file_bandwidth(dir, down.bytes);
  const int32_t next = 5;
  s.kv().move_to(tandem::KvTier::kFile);
  const double resume_file_s = seconds_of([&] { s.eval(std::span<const int32_t>(&next, 1)); });
  const RemovedOnExit saved{dir / fmt::format("tandem-bench-{}.session", ::getpid())};
  const auto& path = saved.path;
  const double save_s = seconds_of([&] { s.save(path); });
  tandem::SessionOptions fresh_opts;
  fresh_opts.n_ctx = n_ctx + 2;
  tandem::Session fresh(model, exec, fresh_opts);
  const double resume_saved_s = seconds_of([&] {
    fresh.restore(path);
    fresh.eval(std::span<const int32_t>(&next, 1));
  });
  if (json_out) {
    nlohmann::json j;
    j["model"] = model->name();
    j["tokens"] = n_ctx - 1;
    j["kv_bytes"] = down.bytes;
    j["host_to_file_bytes_per_s"] = double(down.bytes) / down.seconds;
    j["host_to_file_first_bytes_per_s"] = double(cold.bytes) / cold.seconds;
    j["file_to_host_bytes_per_s"] = double(up.bytes) / up.seconds;
    j["sequential_write_bytes_per_s"] = seq_w;
    j["sequential_read_bytes_per_s"] = seq_r;
    j["prefill_s"] = prefill_s;
    j["resume_from_file_tier_s"] = resume_file_s;
    j["save_s"] = save_s;
    j["resume_from_saved_session_s"] = resume_saved_s;
    std::cout << j.dump(2) << "\n";
  } else {
    fmt::print("model {}, {} tokens of KV = {:.1f} MB, {} threads, directory {}\n", model->name(), n_ctx - 1,
               double(down.bytes) / 1e6, exec.n_threads(), dir.string());
    fmt::print("| move | GB/s | sequential file I/O, same size, same dir | GB/s | ratio |\n|---|---:|---|---:|---:|\n");
    const double down_bw = double(down.bytes) / down.seconds, up_bw = double(up.bytes) / up.seconds;
    fmt::print("| Host -> File | {:.2f} | write | {:.2f} | {:.2f} |\n", down_bw / 1e9, seq_w / 1e9, down_bw / seq_w);
    fmt::print("| File -> Host | {:.2f} | read | {:.2f} | {:.2f} |\n", up_bw / 1e9, seq_r / 1e9, up_bw / seq_r);
    fmt::print("(first Host -> File move, growing the file: {:.2f} GB/s)\n", double(cold.bytes) / cold.seconds / 1e9);
    fmt::print("\n| resume a {}-token session | seconds | vs recomputing the prefill |\n|---|---:|---:|\n", n_ctx - 1);
    fmt::print("| recompute prefill | {:.4f} | 1.00x |\n", prefill_s);
    fmt::print("| from the File tier (bring back + 1 decode step) | {:.4f} | {:.1f}x faster |\n", resume_file_s,
               prefill_s / resume_file_s);
    fmt::print("| from a saved session file (restore + 1 decode step) | {:.4f} | {:.1f}x faster |\n", resume_saved_s,
               prefill_s / resume_saved_s);
    fmt::print("(saving the session file took {:.4f} s)\n", save_s);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tandem-bench: prompt (pp) and generation (tg) tokens/s"};
  std::string model_path;
  int n_prompt = 512, n_gen = 128, n_threads = 0, reps = 3;
  bool json_out = false, no_bandwidth = false;
  app.add_option("-m,--model", model_path, "GGUF model")->required();
  app.add_option("-p,--n-prompt", n_prompt, "prompt tokens (0 = skip pp)")->check(CLI::Range(0, 1 << 20));
  app.add_option("-n,--n-gen", n_gen, "generated tokens (0 = skip tg)")->check(CLI::Range(0, 1 << 20));
  app.add_option("-t,--threads", n_threads, "threads, 1..512 (0 = physical cores)")->check(CLI::Range(0, 512));
  app.add_option("-r,--repetitions", reps, "runs per test (median reported)")->check(CLI::Range(1, 10000));
  app.add_flag("--json", json_out, "print JSON");
  app.add_flag("--no-bandwidth", no_bandwidth, "skip the memory bandwidth measurement");
  auto* kv_cmd = app.add_subcommand("kv", "KV tier moves and time-to-resume vs recompute");
  std::string kv_model, kv_dir;
  int kv_ctx = 4096, kv_threads = 0;
  bool kv_json = false;
  kv_cmd->add_option("-m,--model", kv_model, "GGUF model")->required();
  kv_cmd->add_option("-c,--ctx", kv_ctx, "session length in tokens")->check(CLI::Range(17, 1 << 20));
  kv_cmd->add_option("-t,--threads", kv_threads, "threads, 1..512 (0 = physical cores)")->check(CLI::Range(0, 512));
  kv_cmd->add_option("--kv-dir", kv_dir, "directory of the File tier");
  kv_cmd->add_flag("--json", kv_json, "print JSON");
  tandem::bench::ServeOptions serve_opt;
  tandem::bench::add_serve_options(app, serve_opt);
  app.get_option("--model")->required(false);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // --help: 0; a refused flag: usage, 2
    return rc == 0 ? 0 : 2;
  }
  std::signal(SIGXFSZ, SIG_IGN);  // a file size limit is an EFBIG error, reported
  if (serve_opt.cmd->parsed()) return finish_stdout(tandem::bench::run_serve(serve_opt));
  if (kv_cmd->parsed()) {
    try {
      return finish_stdout(run_kv(kv_model, kv_ctx, kv_threads, kv_dir, kv_json));
    } catch (const std::exception& e) {
      std::cerr << "tandem-bench: error: " << e.what() << "\n";
      return 1;
    }
  }
  if (model_path.empty()) {
    std::cerr << "tandem-bench: error: --model is required\n";
    return 2;
  }

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
      if (!pp.empty())
        fmt::print("| {} | {} | {} | pp{} | {:.2f} |\n", model->name(), size, exec.n_threads(), n_prompt, pp_med);
      if (!tg.empty())
        fmt::print("| {} | {} | {} | tg{} | {:.2f} |\n", model->name(), size, exec.n_threads(), n_gen, tg_med);
      if (bw > 0) {
        fmt::print(
            "\nread bandwidth {:.2f} GB/s ({} threads); decode reads {:.2f} MB/token -> limit {:.2f} tokens/s; "
            "tg reaches {:.0f}% of it\n",
            bw / 1e9, exec.n_threads(), bytes_per_token / 1e6, bw / bytes_per_token, 100.0 * bw_fraction);
      }
    }
    return finish_stdout(0);
  } catch (const std::exception& e) {
    std::cerr << "tandem-bench: error: " << e.what() << "\n";
    return 1;
  }
}
