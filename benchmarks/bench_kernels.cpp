// CPU kernel benchmarks (single-threaded): decode GEMV Q4_0 at TinyLlama shapes (weight
// bytes/s), prefill GEMM Q4_0 m=512 (FLOP/s), both also on the 8-row repacked layout
// (BM_GemvQ4_0x8 / BM_GemmQ4_0x8), quantize_row_q8_0, attn_tiled (BM_AttnTiled), and a
// streaming-read reference on a buffer much larger than the last-level cache, so GEMV GB/s
// can be read against what one core can stream at all.
//
// "cold" GEMV rotates through enough copies of the weight matrix to fill a 1 GiB pool,
// so weights come from DRAM as they do in a real decode step (a model >> LLC); "hot"
// reuses one matrix (cache-resident upper bound).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/cpu_kernels.hpp"

namespace tk = tandem::kernels;

namespace {

constexpr size_t kPoolBytes = size_t{1} << 30;  // 1 GiB >> LLC

/// 1 GiB of valid Q4_0 blocks (finite, normal scales), shared by every benchmark.
const std::vector<tk::BlockQ4_0>& pool() {
  static const std::vector<tk::BlockQ4_0> p = [] {
    std::vector<tk::BlockQ4_0> v(kPoolBytes / sizeof(tk::BlockQ4_0));
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (auto& b : v) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      b.d = tk::fp32_to_fp16(0.001f + static_cast<float>(s & 0xFFFF) * 1e-7f);
      std::memcpy(b.qs, &s, 8);
      const uint64_t t = s * 0x2545F4914F6CDD1Dull;
      std::memcpy(b.qs + 8, &t, 8);
    }
    return v;
  }();
  return p;
}

/// The same 1 GiB of weights repacked 8 rows at a time (rows of 2048 elements; a record
/// does not depend on the row length, so any shape reads valid records), for the
/// repacked kernel's benchmarks.
const std::vector<tk::BlockQ4_0x8>& pool_x8() {
  static const std::vector<tk::BlockQ4_0x8> p = [] {
    const auto& src = pool();
    const int64_t k = 2048, n = static_cast<int64_t>(src.size()) / (k / 32) / 8 * 8;
    std::vector<tk::BlockQ4_0x8> v(static_cast<size_t>(tk::q4_0x8_records(n, k)));
    tk::repack_q4_0x8(src.data(), n, k, v.data(), 0, n / 8);
    return v;
  }();
  return p;
}

std::vector<tk::BlockQ8_0> activations(int64_t m, int64_t k) {
  std::mt19937 g(42);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<float> x(static_cast<size_t>(m * k));
  for (auto& v : x) v = d(g);
  std::vector<tk::BlockQ8_0> q(static_cast<size_t>(m * k / 32));
  for (int64_t i = 0; i < m; ++i) tk::quantize_row_q8_0(&x[i * k], &q[i * k / 32], k);
  return q;
}

bool select_isa(benchmark::State& state, const std::string& isa) {
  if (!tk::cpu_set_isa(isa)) {
    state.SkipWithError(("ISA not supported here: " + isa).c_str());
    return false;
  }
  state.SetLabel(isa);
  return true;
}

// Streaming read: sum of 64-bit words over the whole pool (4 independent accumulators).
void BM_StreamRead(benchmark::State& state) {
  const auto& p = pool();
  const auto* w = reinterpret_cast<const uint64_t*>(p.data());
  const size_t n = p.size() * sizeof(tk::BlockQ4_0) / 8 / 8 * 8;
  for (auto _ : state) {
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i < n; i += 8) {
      s0 += w[i] + w[i + 4];
      s1 += w[i + 1] + w[i + 5];
      s2 += w[i + 2] + w[i + 6];
      s3 += w[i + 3] + w[i + 7];
    }
    benchmark::DoNotOptimize(s0 + s1 + s2 + s3);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(n * 8));
}
BENCHMARK(BM_StreamRead)->Unit(benchmark::kMillisecond)->MinTime(1.0);

// Decode GEMV: y[n] = W[n x k] . x, m = 1. args: k, n, cold (1) / hot (0).
void BM_GemvQ4_0(benchmark::State& state, std::string isa) {
  if (!select_isa(state, isa)) return;
  const int64_t k = state.range(0), n = state.range(1);
  const bool cold = state.range(2) != 0;
  const auto& p = pool();
  const size_t mat_blocks = static_cast<size_t>(n * k / 32);
  const size_t copies = cold ? p.size() / mat_blocks : 1;
  const auto x = activations(1, k);
  std::vector<float> y(static_cast<size_t>(n));
  size_t c = 0;
  for (auto _ : state) {
    tk::gemm_q4_0_q8_0(p.data() + c * mat_blocks, x.data(), y.data(), k, 1, n, 0, n);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
    if (++c == copies) c = 0;
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(mat_blocks * sizeof(tk::BlockQ4_0)));
  tk::cpu_force_scalar(false);
}

// Prefill GEMM: Y[m x n] = X[m x k] . W^T, m = 512. args: k, n.
void BM_GemmQ4_0(benchmark::State& state, std::string isa) {
  if (!select_isa(state, isa)) return;
  const int64_t k = state.range(0), n = state.range(1), m = state.range(2);
  const auto x = activations(m, k);
  const tk::BlockQ4_0* w = pool().data();  // build the pool outside the timed loop
  std::vector<float> y(static_cast<size_t>(m * n));
  for (auto _ : state) {
    tk::gemm_q4_0_q8_0(w, x.data(), y.data(), k, m, n, 0, n);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  state.counters["FLOP/s"] = benchmark::Counter(
      2.0 * static_cast<double>(m * n * k) * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  tk::cpu_force_scalar(false);
}

// The same two benchmarks on the repacked weights (gemm_q4_0x8_q8_0): compare with
// BM_GemvQ4_0 / BM_GemmQ4_0 of the same ISA and shape in the same run.
void BM_GemvQ4_0x8(benchmark::State& state, std::string isa) {
  if (!select_isa(state, isa)) return;
  const int64_t k = state.range(0), n = state.range(1);
  const bool cold = state.range(2) != 0;
  const auto& p = pool_x8();
  const size_t mat_records = static_cast<size_t>(tk::q4_0x8_records(n, k));
  const size_t copies = cold ? p.size() / mat_records : 1;
  const auto x = activations(1, k);
  std::vector<float> y(static_cast<size_t>(n));
  size_t c = 0;
  for (auto _ : state) {
    tk::gemm_q4_0x8_q8_0(p.data() + c * mat_records, x.data(), y.data(), k, 1, n, 0, n);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
    if (++c == copies) c = 0;
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(mat_records * sizeof(tk::BlockQ4_0x8)));
  tk::cpu_force_scalar(false);
}

void BM_GemmQ4_0x8(benchmark::State& state, std::string isa) {
  if (!select_isa(state, isa)) return;
  const int64_t k = state.range(0), n = state.range(1), m = state.range(2);
  const auto x = activations(m, k);
  const tk::BlockQ4_0x8* w = pool_x8().data();
  std::vector<float> y(static_cast<size_t>(m * n));
  for (auto _ : state) {
    tk::gemm_q4_0x8_q8_0(w, x.data(), y.data(), k, m, n, 0, n);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  state.counters["FLOP/s"] = benchmark::Counter(
      2.0 * static_cast<double>(m * n * k) * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  tk::cpu_force_scalar(false);
}

void BM_QuantizeQ8_0(benchmark::State& state, std::string isa) {
  if (!select_isa(state, isa)) return;
  const int64_t k = state.range(0);
  std::mt19937 g(1);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<float> x(static_cast<size_t>(k));
  for (auto& v : x) v = d(g);
  std::vector<tk::BlockQ8_0> q(static_cast<size_t>(k / 32));
  for (auto _ : state) {
    tk::quantize_row_q8_0(x.data(), q.data(), k);
    benchmark::DoNotOptimize(q.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * k * 4);
  tk::cpu_force_scalar(false);
}

// attn_tiled at SmolLM2's attention shape (head_dim 64, 3 query heads per KV head, f16 KV)
// for the last n_pos positions of a context of n_ctx: n_pos 1 is a decode step's call, 64
// a prefill tile's. Counter: (query row, KV position) pairs per second.
void BM_AttnTiled(benchmark::State& state, std::string isa) {
  if (!select_isa(state, isa)) return;
  const int64_t hd = 64, n_ctx = state.range(0);
  const int32_t group = 3, n_pos = static_cast<int32_t>(state.range(1));
  std::mt19937 g(7);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<uint16_t> k(static_cast<size_t>(n_ctx * hd)), v(k.size());
  for (auto& x : k) x = tk::fp32_to_fp16(d(g));
  for (auto& x : v) x = tk::fp32_to_fp16(d(g));
  std::vector<float> q(static_cast<size_t>(n_ctx * group * hd)), out(q.size());
  for (auto& x : q) x = d(g);
  const void* kp = k.data();
  const void* vp = v.data();
  tk::FlashAttnArgs a;
  a.k_pages = &kp;
  a.v_pages = &vp;
  a.page_size = n_ctx;
  a.row_stride = hd;
  a.head_dim = hd;
  a.pos0 = static_cast<int32_t>(n_ctx) - n_pos;
  a.q = q.data() + a.pos0 * group * hd;
  a.out = out.data() + a.pos0 * group * hd;
  a.q_stride = group * hd;
  a.n_pos = n_pos;
  a.group = group;
  a.scale = 0.125f;
  std::vector<float> scratch(tk::attn_tiled_scratch_floats(hd, int64_t{n_pos} * group, n_ctx));
  for (auto _ : state) {
    tk::attn_tiled(a, scratch.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  double pairs = 0.0;  // causal: row at position p sees p + 1 positions
  for (int64_t p = a.pos0; p < n_ctx; ++p) pairs += double(group) * double(p + 1);
  state.counters["pairs/s"] =
      benchmark::Counter(pairs * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  tk::cpu_force_scalar(false);
}

void gemv_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"k", "n", "cold"});
  for (int cold : {1, 0}) {
    b->Args({2048, 2048, cold});
    b->Args({2048, 5632, cold});
    b->Args({5632, 2048, cold});
  }
}

}  // namespace

BENCHMARK_CAPTURE(BM_GemvQ4_0, avx512vnni, std::string("avx512vnni"))->Apply(gemv_shapes);
BENCHMARK_CAPTURE(BM_GemvQ4_0, avx512, std::string("avx512"))->Apply(gemv_shapes);
BENCHMARK_CAPTURE(BM_GemvQ4_0, avx2, std::string("avx2"))->Apply(gemv_shapes);
BENCHMARK_CAPTURE(BM_GemvQ4_0, scalar, std::string("scalar"))->Args({2048, 2048, 1})->ArgNames({"k", "n", "cold"});
BENCHMARK_CAPTURE(BM_GemmQ4_0, avx512vnni, std::string("avx512vnni"))
    ->Args({2048, 2048, 512})
    ->ArgNames({"k", "n", "m"})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_GemmQ4_0, avx512, std::string("avx512"))
    ->Args({2048, 2048, 512})
    ->ArgNames({"k", "n", "m"})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_GemmQ4_0, avx2, std::string("avx2"))
    ->Args({2048, 2048, 512})
    ->ArgNames({"k", "n", "m"})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_GemmQ4_0, scalar, std::string("scalar"))
    ->Args({2048, 2048, 512})
    ->ArgNames({"k", "n", "m"})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);
BENCHMARK_CAPTURE(BM_GemvQ4_0x8, avx512vnni, std::string("avx512vnni"))->Apply(gemv_shapes);
BENCHMARK_CAPTURE(BM_GemvQ4_0x8, avx2, std::string("avx2"))->Apply(gemv_shapes);
BENCHMARK_CAPTURE(BM_GemmQ4_0x8, avx512vnni, std::string("avx512vnni"))
    ->Args({2048, 2048, 512})
    ->ArgNames({"k", "n", "m"})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_GemmQ4_0x8, avx2, std::string("avx2"))
    ->Args({2048, 2048, 512})
    ->ArgNames({"k", "n", "m"})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_QuantizeQ8_0, avx512, std::string("avx512"))->Arg(2048)->Arg(5632);
BENCHMARK_CAPTURE(BM_QuantizeQ8_0, avx2, std::string("avx2"))->Arg(2048)->Arg(5632);
BENCHMARK_CAPTURE(BM_QuantizeQ8_0, scalar, std::string("scalar"))->Arg(2048);

BENCHMARK_CAPTURE(BM_AttnTiled, avx512vnni, std::string("avx512vnni"))
    ->ArgNames({"n_ctx", "n_pos"})
    ->Args({8192, 1})
    ->Args({2048, 1})
    ->Args({2048, 64})
    ->Args({512, 64});
BENCHMARK_CAPTURE(BM_AttnTiled, avx2, std::string("avx2"))
    ->ArgNames({"n_ctx", "n_pos"})
    ->Args({8192, 1})
    ->Args({2048, 1})
    ->Args({2048, 64})
    ->Args({512, 64});

BENCHMARK_MAIN();
