// tandem-bench serve: replay a workload against the Scheduler in-process.
//
// Workload: a JSONL trace (one request per line: "t" arrival seconds, "prompt_tokens" or
// "prompt" text, "output_tokens", "sla", optional "prefix_id" + "prefix_tokens") or a
// generated one (Poisson arrivals at --rate, prompt/output lengths from P50/P95/P99,
// class mix). Reports TTFT / TPOT / end-to-end percentiles per SLA class, throughput,
// SLA attainment and goodput (requests/s meeting their SLA), KV moves; as a table or
// JSON. --sweep finds the highest rate whose attainment meets --target.
#include "bench_serve.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/exec/paced_executor.hpp"
#include "tandem/exec/perf_model.hpp"
#include "tandem/node/node.hpp"
#include "tandem/sched/scheduler.hpp"

namespace tandem::bench {

namespace {

struct Item {
  double t = 0;
  int32_t prompt_tokens = 0;
  std::string prompt;  // text (overrides prompt_tokens)
  int32_t output_tokens = 16;
  SlaClass sla = SlaClass::kStandard;
  std::string prefix_id;
  int32_t prefix_tokens = 0;
};

struct Slo {
  double ttft_s, tpot_s;
};

// Per-class SLOs (defaults; --slo-scale multiplies them).
Slo slo_of(SlaClass c, double scale) {
  switch (c) {
    case SlaClass::kInteractive:
      return {0.5 * scale, 0.05 * scale};
    case SlaClass::kStandard:
      return {2.0 * scale, 0.10 * scale};
    case SlaClass::kBatch:
      return {30.0 * scale, 1.0 * scale};
  }
  return {1, 1};
}

// SLOs of a simulated node serving a 27B-class model (docs/simulation.md): interactive
// close to one GPU stream's unloaded speed (the article: 40 tok/s), standard what the
// article's CPU sessions get (~2 tok/s each), batch only bounded.
Slo sim_slo_of(SlaClass c, double scale) {
  switch (c) {
    case SlaClass::kInteractive:
      return {1.0 * scale, 0.05 * scale};
    case SlaClass::kStandard:
      return {5.0 * scale, 0.5 * scale};
    case SlaClass::kBatch:
      return {60.0 * scale, 1.0 * scale};
  }
  return {1, 1};
}

Slo slo_for(const ServeOptions& o, SlaClass c) {
  return o.simulate.empty() ? slo_of(c, o.slo_scale) : sim_slo_of(c, o.slo_scale);
}

/// Quantile function through (0.5, p50), (0.95, p95), (0.99, p99), log-linear pieces.
int32_t draw_len(std::mt19937_64& rng, double p50, double p95, double p99) {
  const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
  const double lo = std::max(1.0, p50 / 4);
  struct P {
    double q, v;
  } pts[] = {{0.0, lo}, {0.5, p50}, {0.95, p95}, {0.99, p99}, {1.0, p99 * 1.1}};
  for (int i = 1; i < 5; ++i) {
    if (u <= pts[i].q) {
      const double f = (u - pts[i - 1].q) / (pts[i].q - pts[i - 1].q);
      return std::max(1, int32_t(std::lround(std::exp(std::log(pts[i - 1].v) * (1 - f) + std::log(pts[i].v) * f))));
    }
  }
  return int32_t(p99);
}

// An integer field of a trace line in [lo, hi]; `fallback` when absent.
int32_t int_field(const nlohmann::json& j, const char* key, int32_t fallback, int32_t lo, int32_t hi) {
  if (!j.contains(key)) return fallback;
  const auto& v = j[key];
  if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi) {
    throw std::runtime_error(fmt::format("\"{}\" must be an integer in {}..{}, not {}", key, lo, hi, v.dump()));
  }
  return static_cast<int32_t>(v.get<int64_t>());
}

std::vector<Item> load_trace(const std::string& path) {
  if (std::filesystem::is_directory(path)) throw std::runtime_error(fmt::format("trace '{}' is a directory", path));
  std::ifstream f(path);
  if (!f) throw std::runtime_error(fmt::format("cannot open trace '{}': {}", path, std::strerror(errno)));
  std::vector<Item> v;
  std::string line;
  int n = 0;
  while (std::getline(f, line)) {
    ++n;
    if (line.empty() || line[0] == '#') continue;
    Item it;
    try {
      const auto j = nlohmann::json::parse(line);
      if (!j.is_object()) throw std::runtime_error("a line must be a JSON object");
      const double t = j.value("t", 0.0);
      if (!std::isfinite(t) || t < 0) throw std::runtime_error(fmt::format("\"t\" must be >= 0 seconds, not {}", t));
      it.t = t;
      it.prompt_tokens = int_field(j, "prompt_tokens", 0, 0, INT32_MAX);
      it.prompt = j.value("prompt", std::string());
      it.output_tokens = int_field(j, "output_tokens", 16, 1, INT32_MAX);
      const auto sla = parse_sla_class(j.value("sla", std::string("standard")));
      if (!sla) throw std::runtime_error("unknown sla (interactive, standard or batch)");
      it.sla = *sla;
      it.prefix_id = j.value("prefix_id", std::string());
      it.prefix_tokens = int_field(j, "prefix_tokens", 0, 0, INT32_MAX);
      if (it.prompt.empty() && it.prompt_tokens < 1) throw std::runtime_error("no prompt");
    } catch (const std::exception& e) {  // nlohmann parse/type errors too
      throw std::runtime_error(fmt::format("{}:{}: {}", path, n, e.what()));
    }
    v.push_back(std::move(it));
  }
  if (f.bad()) throw std::runtime_error(fmt::format("cannot read trace '{}'", path));
  if (v.empty()) throw std::runtime_error(fmt::format("trace '{}' holds no requests", path));
  std::sort(v.begin(), v.end(), [](const Item& a, const Item& b) { return a.t < b.t; });
  return v;
}

std::vector<Item> generate(const ServeOptions& o, double rate) {
  std::mt19937_64 rng(o.seed);
  std::exponential_distribution<double> gap(rate);
  std::vector<Item> v;
  double t = 0;
  const double wi = o.mix[0], ws = o.mix[1], wb = o.mix[2];
  std::discrete_distribution<int> cls({wi, ws, wb});
  for (int i = 0; i < o.n_requests; ++i) {
    Item it;
    it.t = t;
    t += gap(rng);
    it.prompt_tokens = draw_len(rng, o.prompt_p[0], o.prompt_p[1], o.prompt_p[2]);
    it.output_tokens = draw_len(rng, o.output_p[0], o.output_p[1], o.output_p[2]);
    it.sla = SlaClass(cls(rng));
    if (o.shared_prefix_tokens > 0 && o.n_prefixes > 0) {
      it.prefix_id = fmt::format("p{}", rng() % uint64_t(o.n_prefixes));
      it.prefix_tokens = o.shared_prefix_tokens;
    }
    v.push_back(it);
  }
  return v;
}

std::vector<int32_t> ids_for(const Item& it, const Model& m, uint64_t salt) {
  const int32_t nv = m.hparams().n_vocab;
  std::vector<int32_t> ids;
  if (!it.prompt.empty()) return m.tokenizer().tokenize(it.prompt, true, false);
  const int32_t bos = m.tokenizer().bos();
  ids.push_back(bos >= 0 ? bos : 1);
  std::mt19937_64 prng(std::hash<std::string>{}(it.prefix_id));
  for (int32_t i = 0; i < it.prefix_tokens && int32_t(ids.size()) < it.prompt_tokens; ++i) {
    ids.push_back(3 + int32_t(prng() % uint64_t(nv - 3)));
  }
  std::mt19937_64 rng(salt);
  while (int32_t(ids.size()) < it.prompt_tokens) ids.push_back(3 + int32_t(rng() % uint64_t(nv - 3)));
  return ids;
}

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double idx = p / 100.0 * double(v.size() - 1);
  const size_t lo = size_t(idx);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (idx - double(lo));
}

struct RunResult {
  nlohmann::json json;
  double attainment = 0;
  double goodput = 0;
  int completed = 0;        // requests that finished with length or stop
  std::string first_error;  // the first failed request's message
};

// ---- --simulate: a node of paced executors (docs/simulation.md) ----

/// A parsed --simulate NODE: its processors (accelerators first), the modelled model.
struct SimNode {
  std::string name;
  std::vector<const ProcessorProfile*> processors;
  ModelProfile big;
  double time_scale = 1.0;
  int32_t token_scale = 1;  // simulated tokens per real token
  bool has_host() const {
    return std::any_of(processors.begin(), processors.end(), [](const auto* p) { return !p->accelerator; });
  }
};

SimNode parse_sim_node(const ServeOptions& o) {
  SimNode n;
  n.name = o.simulate;
  size_t b = 0;
  while (b <= o.simulate.size()) {
    const size_t e = std::min(o.simulate.find('+', b), o.simulate.size());
    n.processors.push_back(&processor_profile(std::string_view(o.simulate).substr(b, e - b)));
    b = e + 1;
  }
  std::stable_sort(n.processors.begin(), n.processors.end(),
                   [](const auto* x, const auto* y) { return x->accelerator && !y->accelerator; });
  n.big = ModelProfile::from_shape(model_shape(o.sim_model));
  if (!(o.time_scale > 0.0)) throw std::runtime_error("--time-scale must be > 0");
  n.time_scale = o.time_scale;
  if (o.sim_token_scale < 1) throw std::runtime_error("--sim-token-scale must be >= 1");
  n.token_scale = o.sim_token_scale;
  return n;
}

/// KV pages a simulated executor gets: the node's budget in pages of the big model's KV
/// (a page of `page_size` real tokens holds page_size x token_scale modelled ones), capped
/// at what its decode slots (plus the prefix cache) can hold at this (real) context.
int32_t sim_kv_pages(const PerfModel& pm, const KvLayout& layout, int32_t n_ctx, int32_t max_running,
                     int32_t prefix_cache, int32_t token_scale) {
  const int32_t page_size = layout.page_size;
  const int64_t cap = compute_tier_pages(layout, n_ctx, n_ctx, max_running, prefix_cache);
  return int32_t(std::min(pm.kv_budget_pages(page_size * token_scale), cap));
}

/// Real tokens standing for `n` simulated ones (at least 1).
int32_t real_tokens(int64_t n, int32_t token_scale) {
  return int32_t(std::max<int64_t>(1, (n + token_scale - 1) / token_scale));
}

/// Executors of a simulated node: one paced CpuQ4Executor (1 thread) per processor, in the
/// node's order; only the accelerators when `with_host` is false (the GPU-only baseline).
void add_simulated_executors(const ServeOptions& o, const SimNode& node, bool with_host,
                             const std::shared_ptr<const Model>& model, int32_t page_size,
                             std::vector<std::unique_ptr<Executor>>& inner,
                             std::vector<std::unique_ptr<PacedExecutor>>& paced,
                             std::vector<std::shared_ptr<KvStore>>& stores, SchedulerOptions& so) {
  for (const ProcessorProfile* p : node.processors) {
    if (!p->accelerator && !with_host) continue;
    inner.push_back(std::make_unique<CpuQ4Executor>(model, CpuExecutorOptions{1}));
    paced.push_back(
        std::make_unique<PacedExecutor>(*inner.back(), PerfModel(*p, node.big), node.time_scale, node.token_scale));
    const PerfModel& pm = paced.back()->perf_model();
    const int32_t k = node.token_scale;
    const int32_t pages =
        sim_kv_pages(pm, KvLayout::for_model(model->hparams(), page_size), o.n_ctx, p->max_running, o.prefix_cache, k);
    if (pages < 1) {
      throw std::runtime_error(fmt::format("{}: the {} weights ({:.1f} GB) leave no memory for KV", p->name,
                                           node.big.name, double(node.big.weight_bytes_total) / 1e9));
    }
    stores.push_back(
        make_kv_store(*paced.back(), KvLayout::for_model(model->hparams(), page_size), KvPageCounts{0, pages, pages}));
    ExecutorConfig c;
    c.executor = paced.back().get();
    c.store = stores.back();
    c.max_running = p->max_running;
    c.step_token_budget = p->step_token_budget;
    c.prefill_chunk = p->prefill_chunk;
    c.looser_class_prefill_tokens = o.looser_class_prefill_tokens;
    c.accelerator = p->accelerator;
    // The router's priors: the modelled speeds, in real tokens per wall second.
    c.prior_prefill_tps = pm.prefill_tokens_per_s(p->prefill_chunk) * node.time_scale / k;
    c.prior_decode_tps = pm.decode_tokens_per_s(1, 512) * node.time_scale / k;
    // ... and the model itself for the TPOT of a request admitted now: one real token is
    // k decode steps, taken at the sequence's last (modelled) position.
    c.tpot_estimate_s = [pm, k, ts = node.time_scale](int32_t batch, int64_t ctx) {
      StepShape s;
      for (int32_t i = 0; i < batch; ++i) s += StepShape::single(std::max<int64_t>(0, ctx * k - 1), 1);
      return double(k) * pm.step_seconds(s) / ts;
    };
    c.name = std::string(p->name);
    so.executors.push_back(c);
  }
}

/// A simulated node's router knows the SLOs (in wall-clock seconds: simulated / time scale),
/// so it sends work to the CPU only where the CPU would meet them.
void set_slo_targets(const ServeOptions& o, const SimNode& node, DefaultRoutingOptions& ro) {
  for (int c = 0; c < kSlaClassCount; ++c) {
    const Slo s = slo_for(o, SlaClass(c));
    ro.ttft_target_s[c] = s.ttft_s / node.time_scale;
    ro.tpot_target_s[c] = s.tpot_s * node.token_scale / node.time_scale;  // per real token
  }
}

/// Per-executor pacing figures and the routing rules used, for a simulated run.
void add_simulation_report(nlohmann::json& j, const std::vector<RequestHandle>& hs,
                           const std::vector<std::unique_ptr<PacedExecutor>>& paced, double ts) {
  std::map<std::string, int> rules, on_host;
  for (const auto& h : hs) {
    const RequestResult& r = h.wait();
    const std::string rule = r.route.substr(0, r.route.find(':'));
    rules[rule] += 1;
    // Executors of a simulated node are named after their processor profiles.
    bool host = false;
    for (const std::string& e : {r.metrics.prefill_executor, r.metrics.decode_executor}) {
      for (const auto& p : processor_profiles()) host = host || (!e.empty() && p.name == e && !p.accelerator);
    }
    if (host) on_host[rule] += 1;
  }
  j["routes"] = rules;
  j["host_routes"] = on_host;  // requests that prefilled or decoded on a host processor, by rule
  j["time_scale"] = ts;
  for (const auto& p : paced) {
    j["paced"].push_back({{"name", p->name()},
                          {"steps", p->steps()},
                          {"overruns", p->overruns()},
                          {"modelled_s", p->modelled_seconds()},
                          {"compute_wall_s", p->compute_seconds()}});
  }
}

RunResult run_once(const ServeOptions& o, std::shared_ptr<const Model> model, const std::vector<Item>& items,
                   double rate_label, const SimNode* sim = nullptr, bool sim_with_host = true) {
  // Executors.
  std::vector<std::unique_ptr<Executor>> exs;
  std::vector<std::unique_ptr<PacedExecutor>> paced;
  std::vector<std::shared_ptr<KvStore>> stores;
  SchedulerOptions so;
  so.max_queued = o.max_queued;
  so.max_context = o.n_ctx;
  so.prefix_cache_entries = o.prefix_cache;
  std::mutex log_mu;
  std::ofstream logf;
  if (!o.log_path.empty()) {
    logf.open(o.log_path);
    so.log = [&](std::string_view s) {
      std::lock_guard<std::mutex> lk(log_mu);
      logf << s << '\n';
    };
  }
  DefaultRoutingOptions ro;
  if (o.long_prompt_tokens > 0) ro.long_prompt_tokens = o.long_prompt_tokens;
  if (o.batch_host_tpot_fraction >= 0) ro.batch_host_tpot_fraction = o.batch_host_tpot_fraction;
  if (sim) set_slo_targets(o, *sim, ro);
  so.policy = std::make_shared<DefaultRoutingPolicy>(ro);
  const int32_t ps = 16;
  std::vector<NodeExecutor> node;
  if (sim) {
    add_simulated_executors(o, *sim, sim_with_host, model, ps, exs, paced, stores, so);
  } else {
    NodeSpec ns;
    ns.n_ctx = o.n_ctx;
    ns.page_size = ps;
    ns.prefix_cache_entries = o.prefix_cache;
    ns.executors = executor_set(o.executors, o.threads > 0 ? o.threads : physical_core_count(), o.max_running);
    for (ExecutorSpec& e : ns.executors) e.file_pages = kFilePagesAsCompute;
    node = build_node(model, ns);
    for (const NodeExecutor& n : node) {
      // A GPU executor takes 4x the CPU's step budget and prefill chunk, as it takes 4x its slots.
      const int32_t scale = n.spec.kind == ExecutorKind::kGpu ? 4 : 1;
      ExecutorConfig c;
      c.executor = n.executor.get();
      c.store = n.store;
      c.max_running = n.spec.max_running;
      c.step_token_budget = std::max(o.step_budget * scale, c.max_running);
      c.prefill_chunk = o.prefill_chunk * scale;
      c.looser_class_prefill_tokens = o.looser_class_prefill_tokens;
      c.accelerator = n.spec.accelerator;
      c.name = n.spec.name;
      so.executors.push_back(c);
    }
  }

  // A simulation runs time_scale times faster than simulated time: arrivals are
  // compressed here and every measured time is multiplied back (ts) below.
  const double ts = sim ? sim->time_scale : 1.0;
  const double tok_k = sim ? double(sim->token_scale) : 1.0;  // TPOT per simulated token = per real token / k
  Scheduler sched(std::move(so));
  std::vector<RequestHandle> hs(items.size());
  const auto t0 = Clock::now();
  auto last_progress = t0;
  for (size_t i = 0; i < items.size(); ++i) {
    const auto at = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(items[i].t / ts));
    std::this_thread::sleep_until(at);
    Request r;
    r.prompt_ids = ids_for(items[i], *model, o.seed * 1000003 + i);
    r.max_tokens = items[i].output_tokens;
    r.ignore_eos = true;
    r.sla = items[i].sla;
    r.sampling = SamplingParams::greedy();
    hs[i] = sched.submit(std::move(r));
    if (o.progress && Clock::now() - last_progress > std::chrono::seconds(1)) {
      last_progress = Clock::now();
      const auto m = sched.metrics();
      fmt::print(stderr, "\r[serve {:.2f} req/s] submitted {}/{} finished {} queued {}   ", rate_label, i + 1,
                 items.size(), m.finished, m.queued);
    }
  }
  while (true) {
    bool all = true;
    for (auto& h : hs) all = all && h.done();
    if (all) break;
    if (o.progress && Clock::now() - last_progress > std::chrono::seconds(1)) {
      last_progress = Clock::now();
      const auto m = sched.metrics();
      fmt::print(stderr, "\r[serve {:.2f} req/s] submitted {}/{} finished {} queued {}   ", rate_label, items.size(),
                 items.size(), m.finished, m.queued);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count() * ts;
  if (o.progress) fmt::print(stderr, "\r{:80}\r", "");
  const auto m = sched.metrics();

  // Aggregate.
  struct Acc {
    std::vector<double> ttft, tpot, e2e, queue;
    int n = 0, ok = 0, met = 0;
    uint64_t tokens = 0;
  } acc[kSlaClassCount + 1];
  std::string rr_first_error;
  for (size_t i = 0; i < items.size(); ++i) {
    const auto& r = hs[i].wait();
    if (r.finish != RequestFinish::kLength && r.finish != RequestFinish::kStop && rr_first_error.empty()) {
      rr_first_error = fmt::format("request {}: {} {}", i, request_finish_name(r.finish), r.message);
    }
    for (int k : {int(items[i].sla), kSlaClassCount}) {
      Acc& a = acc[k];
      ++a.n;
      if (r.finish != RequestFinish::kLength && r.finish != RequestFinish::kStop) continue;
      ++a.ok;
      a.tokens += r.tokens.size();
      a.ttft.push_back(r.metrics.ttft_s * ts);
      if (r.metrics.generated_tokens > 1) a.tpot.push_back(r.metrics.tpot_s * ts / tok_k);
      a.e2e.push_back(r.metrics.e2e_s * ts);
      a.queue.push_back(r.metrics.queue_s * ts);
      const Slo s = slo_for(o, items[i].sla);
      if (r.metrics.ttft_s * ts <= s.ttft_s && r.metrics.tpot_s * ts / tok_k <= s.tpot_s) ++a.met;
    }
  }
  RunResult rr;
  rr.completed = acc[kSlaClassCount].ok;
  rr.first_error = rr_first_error;
  nlohmann::json j;
  j["executors"] = o.executors;
  j["rate"] = rate_label;
  j["requests"] = items.size();
  j["wall_s"] = wall;
  const Acc& all = acc[kSlaClassCount];
  j["throughput_tokens_per_s"] = double(all.tokens) / wall;
  j["throughput_requests_per_s"] = double(all.ok) / wall;
  rr.attainment = all.n ? double(all.met) / double(all.n) : 0.0;
  rr.goodput = double(all.met) / wall;
  j["sla_attainment"] = rr.attainment;
  j["goodput_requests_per_s"] = rr.goodput;
  j["kv_moves"] = {{"count", m.migrations}, {"bytes", m.migration_bytes}, {"seconds", m.migration_s}};
  j["prefix_hit_rate"] = m.prefix_hit_rate;
  j["preemptions"] = m.preemptions;
  for (int k = 0; k <= kSlaClassCount; ++k) {
    const Acc& a = acc[k];
    if (a.n == 0) continue;
    const std::string name = k == kSlaClassCount ? "all" : std::string(sla_class_name(SlaClass(k)));
    auto trio = [&](const std::vector<double>& v) {
      return nlohmann::json{{"p50", pct(v, 50)}, {"p95", pct(v, 95)}, {"p99", pct(v, 99)}};
    };
    j["classes"][name] = {{"requests", a.n},
                          {"completed", a.ok},
                          {"ttft_s", trio(a.ttft)},
                          {"tpot_s", trio(a.tpot)},
                          {"e2e_s", trio(a.e2e)},
                          {"queue_s", trio(a.queue)},
                          {"attainment", double(a.met) / double(a.n)}};
    if (k < kSlaClassCount) {
      const Slo s = slo_for(o, SlaClass(k));
      j["classes"][name]["slo"] = {{"ttft_s", s.ttft_s}, {"tpot_s", s.tpot_s}};
    }
  }
  j["scheduler"] = nlohmann::json::parse(m.to_json());
  if (sim) add_simulation_report(j, hs, paced, ts);
  // Every page back: finished requests, prefix caches and parked sessions release theirs.
  sched.clear_prefix_cache();
  sched.shutdown();
  int64_t kv_left = 0;
  for (const auto& st : stores) {
    for (KvTier tier : {KvTier::kDevice, KvTier::kHost, KvTier::kFile}) {
      if (st->has_tier(tier)) kv_left += st->usage(tier).used + st->usage(tier).reserved;
    }
  }
  j["kv_pages_left"] = kv_left;
  if (kv_left != 0) throw std::runtime_error(fmt::format("{} KV pages still held after the run", kv_left));
  rr.json = j;
  return rr;
}

void print_table(const nlohmann::json& j) {
  fmt::print(
      "\nexecutors {} | rate {:.2f} req/s | {} requests in {:.2f} s | {:.1f} tok/s | {:.2f} req/s | "
      "attainment {:.1f}% | goodput {:.2f} req/s | KV moves {} ({} bytes) | prefix hit {:.1f}%\n",
      j["executors"].get<std::string>(), j["rate"].get<double>(), j["requests"].get<size_t>(),
      j["wall_s"].get<double>(), j["throughput_tokens_per_s"].get<double>(),
      j["throughput_requests_per_s"].get<double>(), 100 * j["sla_attainment"].get<double>(),
      j["goodput_requests_per_s"].get<double>(), j["kv_moves"]["count"].get<uint64_t>(),
      j["kv_moves"]["bytes"].get<uint64_t>(), 100 * j["prefix_hit_rate"].get<double>());
  fmt::print("| class | n | TTFT p50/p95/p99 ms | TPOT p50/p95/p99 ms | e2e p50/p95/p99 ms | attainment |\n");
  fmt::print("|---|---:|---:|---:|---:|---:|\n");
  for (const char* c : {"interactive", "standard", "batch", "all"}) {
    if (!j["classes"].contains(c)) continue;
    const auto& k = j["classes"][c];
    auto ms = [&](const char* f) {
      return fmt::format("{:.1f} / {:.1f} / {:.1f}", 1e3 * k[f]["p50"].get<double>(), 1e3 * k[f]["p95"].get<double>(),
                         1e3 * k[f]["p99"].get<double>());
    };
    fmt::print("| {} | {} | {} | {} | {} | {:.1f}% |\n", c, k["requests"].get<int>(), ms("ttft_s"), ms("tpot_s"),
               ms("e2e_s"), 100 * k["attainment"].get<double>());
  }
  for (const auto& e : j["scheduler"]["executors"]) {
    fmt::print("  {}: {:.1f} tok/s, utilisation {:.1f}%, batch occupancy {:.1f}%, steps {}\n",
               e["name"].get<std::string>(), e["tokens_per_s"].get<double>(), 100 * e["utilisation"].get<double>(),
               100 * e["batch_occupancy"].get<double>(), e["steps"].get<uint64_t>());
  }
}

/// One load level of a simulation: the trace with arrivals `load` times as dense.
std::vector<Item> at_load(const std::vector<Item>& items, double load) {
  std::vector<Item> v = items;
  for (auto& it : v) it.t /= load;
  return v;
}

double executor_utilisation(const nlohmann::json& run, std::string_view name) {
  for (const auto& e : run["scheduler"]["executors"]) {
    if (e["name"].get<std::string>() == name) return e["utilisation"].get<double>();
  }
  return 0.0;
}

/// "attainment% / goodput (i I% s S% b B%)": overall and per SLA class.
std::string attainment_cell(const RunResult& r) {
  std::string per;
  for (const char* c : {"interactive", "standard", "batch"}) {
    if (!r.json["classes"].contains(c)) continue;
    per += fmt::format("{}{} {:.0f}%", per.empty() ? "" : " ", c[0],
                       100 * r.json["classes"][c]["attainment"].get<double>());
  }
  return fmt::format("{:.1f}% / {:.2f} ({})", 100 * r.attainment, r.goodput, per);
}

/// Requests whose prefill or decode ran on a host (non-accelerator) processor.
int host_requests(const nlohmann::json& run) {
  int n = 0;
  if (!run.contains("host_routes")) return 0;
  for (const auto& [rule, count] : run["host_routes"].items()) n += count.get<int>();
  return n;
}

/// tandem-bench serve --simulate NODE: the trace at each load level, GPU-only and CPU+GPU.
int run_simulation(const ServeOptions& so, const std::shared_ptr<const Model>& model) {
  const SimNode node = parse_sim_node(so);
  const int32_t k = node.token_scale;
  std::vector<Item> base = so.trace.empty() ? generate(so, so.rate) : load_trace(so.trace);
  // --sim-token-scale k: lengths (trace, -c, --long-prompt) are simulated tokens; the run
  // uses one real token for every k.
  ServeOptions o = so;
  if (k > 1) {
    o.n_ctx = real_tokens(so.n_ctx, k);
    o.long_prompt_tokens = real_tokens(so.long_prompt_tokens > 0 ? so.long_prompt_tokens : 256, k);
    for (auto& it : base) {
      if (!it.prompt.empty()) throw std::runtime_error("--sim-token-scale needs prompt_tokens, not prompt text");
      it.prompt_tokens = real_tokens(it.prompt_tokens, k);
      it.output_tokens = real_tokens(it.output_tokens, k);
      it.prefix_tokens = it.prefix_tokens / k;
    }
  }
  if (base.empty()) throw std::runtime_error("the workload has no requests");
  const auto too_long =
      std::count_if(base.begin(), base.end(), [&](const Item& it) { return it.prompt_tokens >= o.n_ctx; });
  if (too_long > 0) {
    fmt::print(stderr,
               "tandem-bench serve: warning: {} of {} requests have prompts of >= -c {} tokens; they will be refused "
               "and count as missed (raise -c)\n",
               too_long, base.size(), so.n_ctx);
  }
  const double span = base.back().t > 0 ? base.back().t : 1.0;
  const double base_rate = double(base.size()) / span;
  const bool compare = node.has_host() && node.processors.front()->accelerator;
  const ProcessorProfile* host = nullptr;
  for (const auto* p : node.processors) {
    if (!p->accelerator) host = p;
  }
  nlohmann::json out;
  out["node"] = node.name;
  out["model"] = node.big.name;
  out["time_scale"] = node.time_scale;
  out["token_scale"] = k;
  out["workload"] = o.trace.empty() ? std::string("generated") : o.trace;
  const int32_t ps = 16;
  for (const auto* p : node.processors) {
    const PerfModel pm(*p, node.big);
    out["processors"].push_back({{"name", p->name},
                                 {"description", p->description},
                                 {"decode_tps_batch1_ctx512", pm.decode_tokens_per_s(1, 512)},
                                 {"decode_tps_per_seq_full_batch_ctx512", pm.decode_tokens_per_s(p->max_running, 512)},
                                 {"max_running", p->max_running},
                                 {"prefill_tps_chunk", pm.prefill_tokens_per_s(p->prefill_chunk)},
                                 {"kv_budget_tokens", pm.kv_budget_pages(ps) * ps},
                                 {"kv_pages", sim_kv_pages(pm, KvLayout::for_model(model->hparams(), ps), o.n_ctx,
                                                           p->max_running, o.prefix_cache, k)}});
  }
  if (!o.json) {
    fmt::print(
        "simulated node {} serving {} ({:.1f}B parameters, {:.1f} GB Q4_0, {} KB KV/token); time scale {}x; {} "
        "simulated token(s) per real token\n",
        node.name, node.big.name, double(node.big.total_params) / 1e9, double(node.big.weight_bytes_total) / 1e9,
        node.big.kv_bytes_per_token / 1024, node.time_scale, k);
    for (const auto& p : out["processors"]) {
      fmt::print(
          "  {}: decode {:.1f} tok/s (1 seq), {:.1f} tok/s/seq x {} seqs; prefill {:.0f} tok/s; KV budget {} tokens, "
          "{} pages allocated\n    ({})\n",
          p["name"].get<std::string>(), p["decode_tps_batch1_ctx512"].get<double>(),
          p["decode_tps_per_seq_full_batch_ctx512"].get<double>(), p["max_running"].get<int>(),
          p["prefill_tps_chunk"].get<double>(), p["kv_budget_tokens"].get<int64_t>(), p["kv_pages"].get<int>(),
          p["description"].get<std::string>());
    }
    fmt::print(
        "\n| load | offered req/s | {} | {} | goodput ratio | host requests (R5 hand-off / R7 whole) | host util | "
        "overruns |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        compare ? "GPU-only attainment / goodput" : "attainment / goodput",
        compare ? "CPU+GPU attainment / goodput" : "-");
  }
  double cap_gpu = 0, cap_both = 0;
  for (double load : o.loads) {
    if (!(load > 0)) throw std::runtime_error("--loads must be > 0");
    const auto items = at_load(base, load);
    const double rate = base_rate * load;
    nlohmann::json row{{"load", load}, {"offered_rate", rate}};
    const RunResult g = run_once(o, model, items, rate, &node, !compare);
    row["gpu"] = g.json;
    if (g.attainment >= o.target) cap_gpu = std::max(cap_gpu, rate);
    uint64_t overruns = 0;
    for (const auto& p : g.json["paced"]) overruns += p["overruns"].get<uint64_t>();
    std::string both_cell = "-", ratio_cell = "-", host_cell = "-", util_cell = "-";
    if (compare) {
      const RunResult b = run_once(o, model, items, rate, &node, true);
      row["cpu_gpu"] = b.json;
      row["goodput_ratio"] = g.goodput > 0 ? b.goodput / g.goodput : 0.0;
      if (b.attainment >= o.target) cap_both = std::max(cap_both, rate);
      for (const auto& p : b.json["paced"]) overruns += p["overruns"].get<uint64_t>();
      const auto& r = b.json["host_routes"];
      both_cell = attainment_cell(b);
      ratio_cell = g.goodput > 0 ? fmt::format("{:.2f}x", b.goodput / g.goodput) : "-";
      host_cell = fmt::format("{} ({} / {})", host_requests(b.json), r.value("R5", 0), r.value("R7", 0));
      util_cell = fmt::format("{:.0f}%", 100 * executor_utilisation(b.json, host->name));
    }
    row["overruns"] = overruns;
    out["loads"].push_back(row);
    if (!o.json) {
      fmt::print("| {:.2f} | {:.2f} | {} | {} | {} | {} | {} | {} |\n", load, rate, attainment_cell(g), both_cell,
                 ratio_cell, host_cell, util_cell, overruns);
      std::fflush(stdout);
    }
  }
  out["target"] = o.target;
  out["capacity_gpu_only"] = cap_gpu;
  if (compare) {
    out["capacity_cpu_gpu"] = cap_both;
    out["capacity_ratio"] = cap_gpu > 0 ? cap_both / cap_gpu : 0.0;
  }
  if (o.json) {
    std::cout << out.dump(2) << "\n";
  } else {
    fmt::print("\ncapacity at {:.0f}% attainment (highest offered rate that met it): {} {:.4g} req/s", 100 * o.target,
               compare ? "GPU-only" : node.name, cap_gpu);
    if (compare) {
      fmt::print(", CPU+GPU {:.4g} req/s ({})", cap_both,
                 cap_gpu > 0    ? fmt::format("{:.2f}x", cap_both / cap_gpu)
                 : cap_both > 0 ? std::string("GPU-only met it at no load")
                                : std::string("neither met it at any load"));
    }
    fmt::print(
        "\n(times in simulated seconds; overruns = steps the host computed slower than the model: > 0 means "
        "the run is slower than the simulated node)\n");
  }
  return 0;
}

}  // namespace

// Flag values CLI11's per-option checks cannot judge alone.
void check_serve_options(const ServeOptions& o) {
  auto finite_positive = [](const char* flag, double v) {
    if (!std::isfinite(v) || v <= 0) throw CLI::ValidationError(flag, fmt::format("{} must be a positive number", v));
  };
  finite_positive("--rate", o.rate);
  finite_positive("--slo-scale", o.slo_scale);
  if (!(o.target > 0 && o.target <= 1)) {
    throw CLI::ValidationError("--target", fmt::format("{} must be in (0, 1] (a fraction: 0.9 = 90%)", o.target));
  }
  double sum = 0;
  for (double w : o.mix) {
    if (!std::isfinite(w) || w < 0) throw CLI::ValidationError("--mix", fmt::format("weight {} must be >= 0", w));
    sum += w;
  }
  if (sum <= 0) throw CLI::ValidationError("--mix", "at least one weight must be above 0");
  if (o.cmd != nullptr && o.cmd->count("--simulate") > 0) {  // a bad node is a bad flag (exit 2), before any run
    try {
      (void)parse_sim_node(o);
    } catch (const std::exception& e) {
      throw CLI::ValidationError("--simulate", e.what());
    }
    for (double l : o.loads) finite_positive("--loads", l);
  }
  for (const auto* p : {&o.prompt_p, &o.output_p}) {
    for (double v : *p) {
      if (!std::isfinite(v) || v < 1 || v > 1 << 24) {
        throw CLI::ValidationError(p == &o.prompt_p ? "--prompt-p" : "--output-p",
                                   fmt::format("length {} must be in 1..{}", v, 1 << 24));
      }
    }
  }
}

void add_serve_options(CLI::App& app, ServeOptions& o) {
  auto* c = app.add_subcommand("serve", "replay a workload against the Scheduler (TTFT/TPOT/e2e, goodput)");
  o.cmd = c;
  c->add_option("-m,--model", o.model, "GGUF model")->required();
  c->add_option("--executors", o.executors, "cpu, gpu, cpu+gpu or cpu+cpu (split thread pools)")
      ->check(CLI::IsMember(std::vector<std::string>(executor_set_names().begin(), executor_set_names().end())));
  c->add_option("-t,--threads", o.threads, "CPU threads in all (cpu+cpu splits them; 0 = physical cores)")
      ->check(CLI::Range(0, 512));
  c->add_option("--trace", o.trace,
                "JSONL trace (t, prompt_tokens|prompt, output_tokens, sla, prefix_id, prefix_tokens)");
  c->add_option("--rate", o.rate, "generated: Poisson arrivals per second");
  c->add_option("-n,--requests", o.n_requests, "generated: number of requests")->check(CLI::Range(1, 1 << 24));
  c->add_option("--prompt-p", o.prompt_p, "generated: prompt length P50 P95 P99")->expected(3);
  c->add_option("--output-p", o.output_p, "generated: output length P50 P95 P99")->expected(3);
  c->add_option("--mix", o.mix, "generated: interactive standard batch weights")->expected(3);
  c->add_option("--shared-prefix", o.shared_prefix_tokens, "generated: tokens of a shared prefix (0 = none)")
      ->check(CLI::Range(0, 1 << 24));
  c->add_option("--prefixes", o.n_prefixes, "generated: number of distinct shared prefixes")
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--seed", o.seed, "random seed");
  c->add_option("-c,--ctx", o.n_ctx, "context per sequence")->check(CLI::Range(1, 1 << 20));
  c->add_option("--max-running", o.max_running, "decode slots per CPU executor")->check(CLI::Range(1, 4096));
  c->add_option("--max-queued", o.max_queued, "bounded queue")->check(CLI::Range(1, 1 << 24));
  c->add_option("--step-budget", o.step_budget, "tokens per step")->check(CLI::Range(1, 1 << 20));
  c->add_option("--prefill-chunk", o.prefill_chunk, "prompt tokens per sequence per step")
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--prefix-cache", o.prefix_cache, "finished prompts kept per executor")->check(CLI::Range(0, 1 << 16));
  c->add_option("--long-prompt", o.long_prompt_tokens, "routing: long-prompt threshold (0 = policy default)")
      ->check(CLI::Range(0, 1 << 24));
  c->add_option("--slo-scale", o.slo_scale, "multiply the per-class TTFT/TPOT SLOs");
  c->add_option("--batch-host-tpot-fraction", o.batch_host_tpot_fraction,
                "routing: a batch decode leaves an accelerator with room only for a host TPOT <= this x target "
                "and fewer sequences on the host (1 = any such host meeting it; default 0.5)")
      ->check(CLI::Range(0.0, 1.0))
      ->check(CLI::Validator(
          [](std::string& v) { return std::isnan(std::strtod(v.c_str(), nullptr)) ? "not a number: " + v : ""; },
          "NUMBER", "not NaN"));
  c->add_option("--looser-prefill", o.looser_class_prefill_tokens,
                "prompt tokens per step left to looser SLA classes while a tighter one prefills (-1 = prefill chunk / "
                "4; the step budget = class order only)")
      ->check(CLI::Range(-1, 1 << 20));
  c->add_flag("--sweep", o.sweep, "find the highest rate meeting --target attainment");
  c->add_option("--target", o.target, "sweep: attainment target (0..1)");
  c->add_option("--log", o.log_path, "write the scheduler's routing log here");
  c->add_flag("--json", o.json, "print JSON");
  c->add_flag("!--no-progress", o.progress, "no progress line on stderr");
  c->add_option("--simulate", o.simulate,
                "simulate a node with paced executors: l40s+epyc32, h200+epyc32, h200, l40s, ... (docs/simulation.md)");
  c->add_option("--sim-model", o.sim_model,
                "simulate: the modelled model (qwen-27b-class, qwen2.5-7b, llama3-70b, ...)");
  c->add_option("--time-scale", o.time_scale, "simulate: simulated seconds per wall second");
  c->add_option("--sim-token-scale", o.sim_token_scale,
                "simulate: simulated tokens per real token (trace lengths and -c are simulated tokens)")
      ->check(CLI::Range(1, 1 << 16));
  c->add_option("--loads", o.loads, "simulate: load levels, multiples of the workload's arrival rate");
  c->callback([&o] { check_serve_options(o); });
}

// Every request of a run failed: the figures mean nothing, say so (exit status 1).
bool all_failed(const RunResult& r) {
  if (r.completed > 0) return false;
  std::cerr << "tandem-bench serve: error: every request failed (" << r.first_error << ")\n";
  return true;
}

int run_serve(const ServeOptions& o) {
  try {
    auto model = Model::load(o.model);
    if (!o.simulate.empty()) return run_simulation(o, model);
    if (!o.trace.empty()) {
      const auto items = load_trace(o.trace);
      const double span = items.empty() ? 0.0 : items.back().t;
      const auto r = run_once(o, model, items, span > 0 ? double(items.size()) / span : 0.0);
      if (o.json) {
        std::cout << r.json.dump(2) << "\n";
      } else {
        print_table(r.json);
      }
      return all_failed(r) ? 1 : 0;
    }
    if (!o.sweep) {
      const auto r = run_once(o, model, generate(o, o.rate), o.rate);
      if (o.json) {
        std::cout << r.json.dump(2) << "\n";
      } else {
        print_table(r.json);
      }
      return all_failed(r) ? 1 : 0;
    }
    // Sweep: double the rate until attainment drops below the target, then bisect.
    nlohmann::json runs = nlohmann::json::array();
    double lo = 0, hi = 0, rate = o.rate;
    nlohmann::json best;
    for (int i = 0; i < 12 && hi == 0; ++i, rate *= 2) {
      const auto r = run_once(o, model, generate(o, rate), rate);
      runs.push_back(r.json);
      if (!o.json) fmt::print("sweep rate {:.2f}: attainment {:.1f}%\n", rate, 100 * r.attainment);
      if (r.attainment >= o.target) {
        lo = rate;
        best = r.json;
      } else {
        hi = rate;
      }
    }
    for (int i = 0; i < 4 && hi > 0 && lo > 0; ++i) {
      const double mid = (lo + hi) / 2;
      const auto r = run_once(o, model, generate(o, mid), mid);
      runs.push_back(r.json);
      if (!o.json) fmt::print("sweep rate {:.2f}: attainment {:.1f}%\n", mid, 100 * r.attainment);
      if (r.attainment >= o.target) {
        lo = mid;
        best = r.json;
      } else {
        hi = mid;
      }
    }
    if (o.json) {
      std::cout << nlohmann::json{{"target", o.target}, {"max_rate", lo}, {"best", best}, {"runs", runs}}.dump(2)
                << "\n";
    } else {
      fmt::print("\nhighest rate meeting {:.0f}% attainment: {:.2f} req/s{}\n", 100 * o.target, lo,
                 lo == 0 ? " (none met it: lower --rate)" : "");
      if (!best.is_null()) print_table(best);
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "tandem-bench serve: error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace tandem::bench
