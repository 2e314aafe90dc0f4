#include "tandem/exec/perf_model.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "tandem/core/error.hpp"

namespace tandem {

namespace {

constexpr double kGB = 1e9;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kTera = 1e12;

/// Q4_0: 32 weights in 18 bytes (an f16 scale + 16 bytes of nibbles).
constexpr uint64_t q4_0_bytes(int64_t weights) {
  return uint64_t(weights) / 32 * 18 + (weights % 32 ? 18 : 0);
}

// GPU fractions (see the header): llama.cpp CUDA decode at one token per step reads
// weights at ~0.75 of peak bandwidth; its int8 tensor-core MMQ prefill reaches ~0.25 of
// the dense int8 peak.
constexpr double kGpuBwEfficiency = 0.75;
constexpr double kGpuComputeEfficiency = 0.25;
constexpr double kGpuStepOverhead = 1.0e-3;
constexpr double kCpuStepOverhead = 0.2e-3;
/// Peak int8 operations per cycle per core assumed for the CPUs: 64 multiply-adds (one
/// 512-bit VNNI vpdpbusd per cycle on Zen 4, two 256-bit vpmaddubsw on Zen 2/3).
constexpr double kCpuInt8OpsPerCycle = 128.0;
/// STREAM-like bandwidth a many-channel DDR server reaches over its theoretical peak.
constexpr double kServerStreamFraction = 0.78;

}  // namespace

// Tandem on the development VM (docs/simulation.md, "Calibration"). Compute: 2026-12-01,
// machine loaded by other jobs (load average 15-18 on 2 cores), so measured per CPU-second
// (user + sys time of tandem-bench, minus a -p 1 run's fixed cost): TinyLlama-1.1B shapes,
// two pp512 runs, 1.083 TFLOP each, in 42.0 CPU-seconds = 21.1 int8 ops/cycle/core; the
// quiet re-take of 2026-12-02 on the Zen 1 host (1.996 GHz) gave 21.2. Decode: the quiet
// tg128 runs of 2026-12-02 (benchmarks/results/2026-12-02-epyc-zen1/tandem-*-2.jsonl),
// step time = bytes read per token / (stream_bw x 0.94) + step_overhead_s fitted on the
// TinyLlama-1.1B (582.2 MB, 26.51 t/s) and SmolLM2-135M (89.9 MB, 123.8 t/s) shapes:
// 16.61 GB/s effective (stream_bw 17.67 GB/s; the runs measured 15.1-22.5, mean 18.0) and
// 2.66 ms per step; it predicts the held-out Qwen2.5-0.5B shapes (278.1 MB) at 51.5 t/s
// against 51.0 measured (+1.0%). The server profiles share the decode fraction, not the
// bandwidth, clock, overhead or compute (kServerInt8OpsPerCycle).
const CpuCalibration kVm2Calibration{
    .stream_bw = 17.67e9,
    .decode_bw_fraction = 0.94,
    .int8_ops_per_cycle = 2.0 * 1.08292e12 / 42.02 / 2.445e9,
    .clock_hz = 1.996e9,
    .cores = 2,
    .step_overhead_s = 2.66e-3,
};

namespace {

// The server CPU profiles' compute (e_c = this / kCpuInt8OpsPerCycle): Tandem's kernels as
// an AVX2 server runs them (TANDEM_CPU_ISA=avx2, Q4_0 repacked: the instructions of the
// article's Zen 3 EPYC 7R13; the Zen 4 EPYC 9354 runs the AVX-512 VNNI path, 1.7x faster
// on the same host, so the figure is conservative there). Measured 2026-12-06 on the
// development VM's Intel Xeon host, quiet, 2 threads (docs/simulation.md, "Calibration
// 2026-12-06"): TinyLlama-1.1B shapes pp512 at 106.3 t/s, 1.0829e12 int8 ops in 4.820 s on
// 2 cores at 2.95 GHz (the clock a dependent imul chain runs at on both cores) = 38.1
// ops/cycle/core; it predicts the held-out Qwen2.5-0.5B shapes at 222 t/s against 256.1
// measured (-13%). The decode fraction stays vm2's: on that host 260 MiB of L3 holds much
// of a model's weights, so decode outruns the bandwidth the same run measures.
constexpr double kServerInt8OpsPerCycle = 1.08292e12 / (4.820 * 2 * 2.95e9);

std::array<ProcessorProfile, 6> make_profiles() {
  std::array<ProcessorProfile, 6> p{};
  p[0] = {"h200",
          "NVIDIA H200 SXM: 141 GB HBM3e at 4.8 TB/s, 1,979 dense INT8 TOPS",
          true,
          4.8e12,
          kGpuBwEfficiency,
          1979 * kTera,
          kGpuComputeEfficiency,
          kGpuStepOverhead,
          uint64_t(141 * kGB),
          128,
          4096,
          1024};
  p[1] = {"l40s",
          "NVIDIA L40S: 48 GB GDDR6 at 864 GB/s, 733 dense INT8 TOPS",
          true,
          864 * kGB,
          kGpuBwEfficiency,
          733 * kTera,
          kGpuComputeEfficiency,
          kGpuStepOverhead,
          uint64_t(48 * kGB),
          64,
          2048,
          512};
  p[2] = {"a10",
          "NVIDIA A10: 24 GB GDDR6 at 600 GB/s, 250 dense INT8 TOPS",
          true,
          600 * kGB,
          kGpuBwEfficiency,
          250 * kTera,
          kGpuComputeEfficiency,
          kGpuStepOverhead,
          uint64_t(24 * kGB),
          32,
          2048,
          512};
  const double e_c = kServerInt8OpsPerCycle / kCpuInt8OpsPerCycle;
  const double e_b = kVm2Calibration.decode_bw_fraction * kServerStreamFraction;
  p[3] = {"epyc32",
          "AMD EPYC 9354 (Genoa): 32 cores at 3.25 GHz, 12 channels DDR5-4800 (460.8 GB/s), 384 GB",
          false,
          460.8 * kGB,
          e_b,
          32 * 3.25e9 * kCpuInt8OpsPerCycle,
          e_c,
          kCpuStepOverhead,
          uint64_t(384 * kGB),
          16,
          256,
          64};
  p[4] = {"epyc7r13",
          "AMD EPYC 7R13 (Milan) as AWS g6e.16xlarge: 32 cores at 2.65 GHz, 8 channels DDR4-3200 (204.8 GB/s), 512 GB",
          false,
          204.8 * kGB,
          e_b,
          32 * 2.65e9 * kCpuInt8OpsPerCycle,
          e_c,
          kCpuStepOverhead,
          uint64_t(512 * kGB),
          16,
          256,
          64};
  p[5] = {"vm2",
          "this project's development VM: 2 cores (AMD EPYC Zen 1, AVX2) at 1.996 GHz, 24 GiB",
          false,
          kVm2Calibration.stream_bw,
          kVm2Calibration.decode_bw_fraction,
          double(kVm2Calibration.cores) * kVm2Calibration.clock_hz * kCpuInt8OpsPerCycle,
          kVm2Calibration.int8_ops_per_cycle / kCpuInt8OpsPerCycle,  // its own host's kernels
          kVm2Calibration.step_overhead_s,
          uint64_t(24 * kGiB),
          8,
          256,
          128};
  return p;
}

const std::array<ProcessorProfile, 6>& profiles() {
  static const std::array<ProcessorProfile, 6> p = make_profiles();
  return p;
}

// Hyper-parameters from the models' published config.json files (Qwen/Qwen2.5-*-Instruct,
// meta-llama/Meta-Llama-3-*). The 27B class is an assumption: the article's model
// (Qwen 3.5 27B) publishes no shapes we could check, so it takes Qwen2.5-32B's attention
// (64 layers, 40 query / 8 KV heads of 128) with n_ff 21504: 26.7B parameters.
constexpr std::array<ModelShape, 6> kShapes{{
    {"qwen2.5-7b", 152064, 3584, 28, 28, 4, 128, 18944},
    {"qwen2.5-14b", 152064, 5120, 48, 40, 8, 128, 13824},
    {"qwen2.5-32b", 152064, 5120, 64, 40, 8, 128, 27648},
    {"qwen-27b-class", 152064, 5120, 64, 40, 8, 128, 21504},
    {"llama3-8b", 128256, 4096, 32, 32, 8, 128, 14336},
    {"llama3-70b", 128256, 8192, 80, 64, 8, 128, 28672},
}};

template <class T, size_t N>
std::string names_of(const std::array<T, N>& a) {
  std::string s;
  for (const auto& x : a) {
    if (!s.empty()) s += ", ";
    s += x.name;
  }
  return s;
}

}  // namespace

ModelProfile ModelProfile::from_shape(const ModelShape& s) {
  if (s.n_vocab <= 0 || s.n_embd <= 0 || s.n_layer <= 0 || s.n_head <= 0 || s.n_head_kv <= 0 || s.head_dim <= 0 ||
      s.n_ff <= 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("model profile '{}': every dimension must be positive (vocab {}, embd {}, layers {}, "
                            "heads {}/{}, head_dim {}, ff {})",
                            s.name, s.n_vocab, s.n_embd, s.n_layer, s.n_head, s.n_head_kv, s.head_dim, s.n_ff));
  }
  ModelProfile m;
  m.name = std::string(s.name);
  m.shape = s;
  const int64_t e = s.n_embd, q = int64_t(s.n_head) * s.head_dim, kv = int64_t(s.n_head_kv) * s.head_dim;
  const int64_t per_layer = e * q + 2 * e * kv + q * e + 3 * e * int64_t(s.n_ff);
  const int64_t output = e * int64_t(s.n_vocab);
  m.matmul_params = per_layer * s.n_layer + output;
  m.total_params = m.matmul_params + output;  // token embeddings: an n_vocab x n_embd table
  m.weight_bytes_read = q4_0_bytes(m.matmul_params);
  m.weight_bytes_total = q4_0_bytes(m.total_params);
  m.kv_bytes_per_token = uint64_t(2) * uint64_t(s.n_layer) * uint64_t(kv) * 2;
  m.attn_flops_per_pair = 4.0 * double(s.n_layer) * double(q);
  return m;
}

ModelProfile ModelProfile::from_hparams(std::string name, const HParams& hp) {
  ModelShape s{"", hp.n_vocab, hp.n_embd, hp.n_layer, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff};
  ModelProfile m = from_shape(s);
  m.name = std::move(name);
  m.shape.name = std::string_view();
  return m;
}

StepShape StepShape::single(int64_t pos0, int64_t n) noexcept {
  StepShape s;
  (n > 1 ? s.prefill_tokens : s.decode_tokens) = n;
  s.kv_positions = pos0 + n;
  // sum_{i = pos0}^{pos0 + n - 1} (i + 1)
  s.attn_pairs = n * pos0 + n * (n + 1) / 2;
  return s;
}

StepShape& StepShape::operator+=(const StepShape& o) noexcept {
  prefill_tokens += o.prefill_tokens;
  decode_tokens += o.decode_tokens;
  kv_positions += o.kv_positions;
  attn_pairs += o.attn_pairs;
  return *this;
}

StepShape StepShape::of(std::span<const SequenceStep> batch) noexcept {
  StepShape s;
  for (const auto& q : batch) s += single(q.pos0, int64_t(q.tokens.size()));
  return s;
}

PerfModel::PerfModel(const ProcessorProfile& processor, ModelProfile model) : p_(processor), m_(std::move(model)) {
  auto bad = [](double v) { return !(v > 0.0) || !std::isfinite(v); };
  if (bad(p_.mem_bw) || bad(p_.peak_ops) || bad(p_.bw_efficiency) || bad(p_.compute_efficiency) ||
      p_.bw_efficiency > 1.0 || p_.compute_efficiency > 1.0 || !(p_.step_overhead_s >= 0.0)) {
    throw Error(
        ErrorCode::kInvalidArgument,
        fmt::format("processor profile '{}': bandwidth {} B/s, peak {} ops/s and efficiencies {} / {} must be "
                    "positive (efficiencies <= 1), overhead {} s >= 0",
                    p_.name, p_.mem_bw, p_.peak_ops, p_.bw_efficiency, p_.compute_efficiency, p_.step_overhead_s));
  }
}

double PerfModel::steps_seconds(const StepShape& s, int64_t steps) const noexcept {
  const double bw = p_.mem_bw * p_.bw_efficiency;
  const double ops = p_.peak_ops * p_.compute_efficiency;
  const double tokens = double(s.prefill_tokens + s.decode_tokens);
  const double weights_s = double(steps) * double(m_.weight_bytes_read) / bw;
  const double compute_s =
      (2.0 * double(m_.matmul_params) * tokens + m_.attn_flops_per_pair * double(s.attn_pairs)) / ops;
  const double kv_s = double(s.kv_positions) * double(m_.kv_bytes_per_token) / bw;
  return std::max(weights_s, compute_s) + kv_s + double(steps) * p_.step_overhead_s;
}

double PerfModel::step_seconds(const StepShape& s) const noexcept {
  return steps_seconds(s, 1);
}

double PerfModel::decode_tokens_per_s(int32_t batch, int64_t ctx) const noexcept {
  StepShape s;
  for (int32_t i = 0; i < batch; ++i) s += StepShape::single(std::max<int64_t>(0, ctx - 1), 1);
  return 1.0 / step_seconds(s);
}

double PerfModel::scaled_step_seconds(std::span<const SequenceStep> batch, int32_t token_scale) const noexcept {
  const int64_t k = std::max<int32_t>(token_scale, 1);
  if (k == 1) return step_seconds(StepShape::of(batch));
  StepShape all;  // the k modelled steps together
  for (const auto& q : batch) {
    const int64_t n = int64_t(q.tokens.size()), p0 = k * int64_t(q.pos0);
    (n > 1 ? all.prefill_tokens : all.decode_tokens) += k * n;
    // Modelled step j (0-based) reads p0 + (j + 1) n positions.
    all.kv_positions += k * p0 + n * k * (k + 1) / 2;
    // Its k n tokens attend to sum_{i = p0}^{p0 + k n - 1} (i + 1) pairs.
    all.attn_pairs += StepShape::single(p0, k * n).attn_pairs;
  }
  return steps_seconds(all, k);
}

double PerfModel::prefill_tokens_per_s(int64_t n) const noexcept {
  return double(n) / step_seconds(StepShape::single(0, n));
}

uint64_t PerfModel::kv_budget_bytes() const noexcept {
  const double usable = double(p_.memory_bytes) * kKvMemoryFraction;
  const double left = usable - double(m_.weight_bytes_total);
  return left > 0 ? uint64_t(left) : 0;
}

int64_t PerfModel::kv_budget_pages(int32_t page_size) const noexcept {
  const uint64_t page = m_.kv_bytes_per_token * uint64_t(std::max(page_size, 1));
  return page ? int64_t(kv_budget_bytes() / page) : 0;
}

std::span<const ProcessorProfile> processor_profiles() noexcept {
  return profiles();
}
std::span<const ModelShape> model_shapes() noexcept {
  return kShapes;
}

const ProcessorProfile& processor_profile(std::string_view name) {
  for (const auto& p : profiles()) {
    if (p.name == name) return p;
  }
  throw Error(ErrorCode::kInvalidArgument,
              fmt::format("unknown processor profile '{}' (known: {})", name, names_of(profiles())));
}

const ModelShape& model_shape(std::string_view name) {
  for (const auto& s : kShapes) {
    if (s.name == name) return s;
  }
  throw Error(ErrorCode::kInvalidArgument,
              fmt::format("unknown model shape '{}' (known: {})", name, names_of(kShapes)));
}

}  // namespace tandem
