// tandem-bench: prompt processing (pp) and token generation (tg) speed, with llama-bench's
// flags, test definitions and output records (bench_speed.hpp / bench_speed.cpp).
//
//   tandem-bench -m MODEL.gguf [-p 512] [-n 128] [-d 0] [-t 0] [-r 5] [-o md|json|jsonl]
//                [-ctk f16|f32|q8_0[,...] -ctv f16|f32|q8_0[,...]]
//   tandem-bench kv -m MODEL.gguf [-c 4096] [-t 2] [--kv-dir DIR] [--json] [-ctk T -ctv T]
//   tandem-bench serve ...   (bench_serve.hpp)
//
// kv: KV tier moves. A session of c prompt tokens is moved Host -> File -> Host (GB/s),
// beside a plain sequential write and read of a file of the same size in the same
// directory; then time-to-resume from the File tier and from a saved session file
// (bring back + one decode step) against recomputing the prefill.
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include "bench_serve.hpp"
#include "bench_speed.hpp"
#include "cli_stdout.hpp"
#include "gpu_layers.hpp"
#include "kv_cache_type.hpp"

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

#include "tandem/core/thread_pool.hpp"
#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/kv/kv_store.hpp"
#include "tandem/model/model.hpp"
#include "tandem/node/node.hpp"
#include "tandem/session/session.hpp"

namespace {

using Clock = std::chrono::steady_clock;

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

// A path removed when this object goes out of scope, on any return or exception.
struct RemovedOnExit {
  std::filesystem::path path;
  ~RemovedOnExit() {
    std::error_code ec;
    std::filesystem::remove(path, ec);
  }
};

int run_kv(const std::string& model_path, int n_ctx, int n_threads, const std::string& kv_dir, bool json_out,
           tandem::KvDtype kv_dtype) {
  auto model = tandem::Model::load(model_path);
  const auto& hp = model->hparams();
  tandem::CpuQ4Executor exec(model, tandem::CpuExecutorOptions{n_threads});
  const char* tmpdir = std::getenv("TMPDIR");
  const std::filesystem::path dir = !kv_dir.empty() ? kv_dir : tmpdir && *tmpdir ? tmpdir : "/tmp";
  tandem::SessionOptions sopt;
  sopt.n_ctx = n_ctx + 2;
  // One sequence's pages (the node's rule) in Host and File each, so it can move between them.
  const tandem::KvLayout layout = tandem::KvLayout::for_model(hp, 16, kv_dtype);
  const int32_t pages = tandem::compute_tier_pages(layout, sopt.n_ctx, sopt.n_batch, 1, 0);
  sopt.kv_store = tandem::make_kv_store(exec, layout, tandem::KvPageCounts{0, pages, pages}, dir);
  tandem::Session s(model, exec, sopt);
  std::mt19937 rng(1);
  std::vector<int32_t> ids(static_cast<size_t>(n_ctx - 1));
  for (auto& id : ids) id = int32_t(rng() % uint32_t(hp.n_vocab));
  const double prefill_s = seconds_of([&] { s.eval(ids); });
  // The first move grows and maps the file; the figures are of a second, warm round trip.
  // Moves go through the placement policy, as the library's own do (one sequence in the
  // store: nothing else is evicted, so these are plain whole-sequence moves).
  tandem::KvPlacement place(*s.kv_store());
  const tandem::KvMoveStats cold = place.make_resident(s.kv(), tandem::KvTier::kFile);
  place.make_resident(s.kv(), tandem::KvTier::kHost);
  const tandem::KvMoveStats down = place.make_resident(s.kv(), tandem::KvTier::kFile);
  const tandem::KvMoveStats up = place.make_resident(s.kv(), tandem::KvTier::kHost);
  const auto [seq_w, seq_r] = file_bandwidth(dir, down.bytes);
  const int32_t next = 5;
  place.make_resident(s.kv(), tandem::KvTier::kFile);
  const double resume_file_s = seconds_of([&] { s.eval(std::span<const int32_t>(&next, 1)); });
  const RemovedOnExit saved{dir / fmt::format("tandem-bench-{}.session", ::getpid())};
  const auto& path = saved.path;
  const double save_s = seconds_of([&] { s.save(path); });
  tandem::SessionOptions fresh_opts;
  fresh_opts.n_ctx = n_ctx + 2;
  fresh_opts.kv_dtype = kv_dtype;
  tandem::Session fresh(model, exec, fresh_opts);
  const double resume_saved_s = seconds_of([&] {
    fresh.restore(path);
    fresh.eval(std::span<const int32_t>(&next, 1));
  });
  if (json_out) {
    nlohmann::json j;
    j["model"] = model->name();
    j["tokens"] = n_ctx - 1;
    j["type_k"] = tandem::kv_dtype_name(kv_dtype);
    j["type_v"] = tandem::kv_dtype_name(kv_dtype);
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
    fmt::print("model {}, {} tokens of {} KV = {:.1f} MB, {} threads, directory {}\n", model->name(), n_ctx - 1,
               tandem::kv_dtype_name(kv_dtype), double(down.bytes) / 1e6, exec.n_threads(), dir.string());
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
  std::signal(SIGPIPE, SIG_IGN);  // a closed stdout pipe: a failed write (exit 1), not a kill
  CLI::App app{"tandem-bench: prompt (pp) and generation (tg) tokens/s", "tandem-bench"};
  tandem::bench::SpeedOptions speed;
  app.add_option("-m,--model", speed.model, "GGUF model")->required();
  const auto list = CLI::MultiOptionPolicy::TakeAll;
  app.add_option("-p,--n-prompt", speed.prompt, "prompt tokens, list (0 = no pp test)")->multi_option_policy(list);
  app.add_option("-n,--n-gen", speed.gen, "generated tokens, list (0 = no tg test)")->multi_option_policy(list);
  app.add_option("-d,--n-depth", speed.depth, "tokens in the KV before the timed part, list")
      ->multi_option_policy(list);
  app.add_option("-t,--threads", speed.threads, "threads, list, 1..512 (0 = physical cores)")
      ->multi_option_policy(list);
  app.add_option("-r,--repetitions", speed.reps, "timed runs per test, after one warm-up")->check(CLI::Range(1, 10000));
  app.add_option("-o,--output", speed.output, "md (default), json or jsonl: llama-bench's records");
  app.add_flag("--json", speed.json, "same as -o json");
  app.add_flag("--no-bandwidth", speed.no_bandwidth, "skip the memory bandwidth measurement");
  app.add_option("--cache-type-k", speed.cache_type_k,
                 "KV cache types of K, list: f16, f32 or q8_0 (also -ctk; item by item the same as V)")
      ->multi_option_policy(list);
  app.add_option("--cache-type-v", speed.cache_type_v,
                 "KV cache types of V, list: f16, f32 or q8_0 (also -ctv; item by item the same as K)")
      ->multi_option_policy(list);
  app.add_option("--n-gpu-layers,--gpu-layers", speed.gpu_layers,
                 "llama-bench's -ngl, list: only 0, as this mode runs the whole model on the CPU (the GPU "
                 "executor: tandem-gpu-bench, serve --executors gpu)")
      ->multi_option_policy(list);
  auto* kv_cmd = app.add_subcommand("kv", "KV tier moves and time-to-resume vs recompute");
  std::string kv_model, kv_dir;
  int kv_ctx = 4096, kv_threads = 0;
  bool kv_json = false;
  kv_cmd->add_option("-m,--model", kv_model, "GGUF model")->required();
  kv_cmd->add_option("-c,--ctx", kv_ctx, "session length in tokens")->check(CLI::Range(17, 1 << 20));
  kv_cmd->add_option("-t,--threads", kv_threads, "threads, 1..512 (0 = physical cores)")->check(CLI::Range(0, 512));
  kv_cmd->add_option("--kv-dir", kv_dir, "directory of the File tier");
  kv_cmd->add_flag("--json", kv_json, "print JSON");
  std::string kv_ctk = "f16", kv_ctv = "f16";
  kv_cmd->add_option("--cache-type-k", kv_ctk, "KV cache type of K: f16, f32 or q8_0 (also -ctk; same as V)");
  kv_cmd->add_option("--cache-type-v", kv_ctv, "KV cache type of V: f16, f32 or q8_0 (also -ctv; same as K)");
  tandem::bench::ServeOptions serve_opt;
  tandem::bench::add_serve_options(app, serve_opt);
  // Set after the subcommands exist (CLI11 copies a parent's footer into each subcommand made
  // later): the lists it describes are the speed mode's, kv and serve take none of them.
  app.footer(
      "Lists (-p -n -d -t) are llama-bench's: comma-separated items first[-last[(+|*)step]], e.g. -p 128,512 "
      "-d 0-4096*2; a flag may repeat. -ctk/-ctv take comma lists of types, e.g. -ctk f16,q8_0 -ctv f16,q8_0; "
      "-ngl takes lists of 0 (each item runs the tests once, on the CPU). "
      "One pp test per prompt size and one tg test per generation size, for every KV type, thread count and "
      "depth.");
  app.get_option("--model")->required(false);
  try {
    std::vector<std::string> args;  // CLI11 parses a reversed vector; -ctk / -ctv / -ngl become long options
    for (int i = argc - 1; i >= 1; --i) {
      args.push_back(tandem::cli::expand_gpu_layers_flag(tandem::cli::expand_cache_type_flag(argv[i])));
    }
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // --help: 0; a refused flag: usage, 2
    return rc == 0 ? 0 : 2;
  }
  std::signal(SIGXFSZ, SIG_IGN);  // a file size limit is an EFBIG error, reported
  if (serve_opt.cmd->parsed()) return tandem::cli::finish_stdout("tandem-bench", tandem::bench::run_serve(serve_opt));
  if (kv_cmd->parsed()) {
    tandem::KvDtype kv_dtype = tandem::KvDtype::kF16;
    if (const std::string bad = tandem::cli::resolve_cache_types(kv_ctk, kv_ctv, kv_dtype); !bad.empty()) {
      std::cerr << "tandem-bench: error: " << bad << "\n";
      return 2;
    }
    try {
      return tandem::cli::finish_stdout("tandem-bench",
                                        run_kv(kv_model, kv_ctx, kv_threads, kv_dir, kv_json, kv_dtype));
    } catch (const std::exception& e) {
      std::cerr << "tandem-bench: error: " << e.what() << "\n";
      return 1;
    }
  }
  if (speed.model.empty()) {
    std::cerr << "tandem-bench: error: --model is required\n";
    return 2;
  }
  return tandem::cli::finish_stdout("tandem-bench", tandem::bench::run_speed(speed));
}
