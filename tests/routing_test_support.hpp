// Routing fixtures shared by the routing-policy and routing-signal tests.
#pragma once

#include <cstdint>
#include <vector>

#include "tandem/sched/routing_policy.hpp"

namespace tandem::test {

// A GPU-like accelerator (index 0) and a CPU (index 1), idle.
inline std::vector<ExecutorView> gpu_cpu() {
  ExecutorView g;
  g.index = 0;
  g.name = "gpu";
  g.accelerator = true;
  g.prefill_tps = 20000;
  g.decode_tps = 80;
  g.max_running = 8;
  g.kv_free_pages = 1000;
  ExecutorView c;
  c.index = 1;
  c.name = "cpu";
  c.accelerator = false;
  c.prefill_tps = 400;
  c.decode_tps = 40;
  c.max_running = 4;
  c.kv_free_pages = 1000;
  return {g, c};
}

/// A request of `sla` with `prompt` prompt tokens and up to `out` new ones.
inline RouteInput input(SlaClass sla, int32_t prompt, int32_t out) {
  RouteInput in;
  in.sla = sla;
  in.prompt_tokens = prompt;
  in.max_tokens = out;
  return in;
}

}  // namespace tandem::test
