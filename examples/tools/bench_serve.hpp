// tandem-bench serve: options and entry point (examples/tools/bench_serve.cpp).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace tandem::bench {

struct ServeOptions {
  CLI::App* cmd = nullptr;
  std::string model;
  std::string executors = "cpu";
  int threads = 0;
  std::string trace;
  double rate = 2.0;
  int n_requests = 100;
  std::vector<double> prompt_p{64, 256, 512};
  std::vector<double> output_p{32, 96, 128};
  std::vector<double> mix{0.3, 0.5, 0.2};
  int32_t shared_prefix_tokens = 0;
  int n_prefixes = 4;
  uint64_t seed = 1;
  int32_t n_ctx = 1024;
  int32_t max_running = 8;
  int32_t max_queued = 4096;
  int32_t step_budget = 256;
  int32_t prefill_chunk = 128;
  int32_t prefix_cache = 4;
  int32_t long_prompt_tokens = 0;
  double batch_host_tpot_fraction = -1;  ///< routing: DefaultRoutingOptions::batch_host_tpot_fraction (-1 = default)
  int32_t looser_class_prefill_tokens = -1;  ///< ExecutorConfig::looser_class_prefill_tokens (-1 = default)
  double slo_scale = 1.0;
  bool sweep = false;
  double target = 0.9;
  std::string log_path;
  bool json = false;
  bool progress = true;
  // --simulate NODE (docs/simulation.md): paced executors stand for the node's processors.
  std::string simulate;                          ///< "l40s+epyc32", "h200+epyc32", "h200", "l40s", ...
  std::string sim_model = "qwen-27b-class";      ///< the modelled (big) model's shape
  double time_scale = 1.0;                       ///< simulated seconds per wall second
  int32_t sim_token_scale = 1;                   ///< simulated tokens per real token (long contexts)
  std::vector<double> loads{0.5, 1, 1.5, 2, 3};  ///< sweep: multiples of the trace's arrival rate
};

void add_serve_options(CLI::App& app, ServeOptions& o);
int run_serve(const ServeOptions& o);

}  // namespace tandem::bench
