// Flash-decoding attention (kernels/cuda attention_split) against a float64 reference and
// against the one-block-per-head kernel (attention), over head_dim 8/64/128, GQA groups 1/2/4/8,
// f16 and f32 KV, and lengths around partition (64) and page (16) boundaries; and every
// kernel against the CPU's attn_tiled bit for bit (docs/arithmetic.md, "Attention").
// Needs a CUDA device, real or emulated (cuemu); skipped without one.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cpu_test_support.hpp"
#include "gpu_test_support.hpp"
#include "hooks/gpu_hooks.hpp"
#include "quant_blocks.hpp"
#include "test_support.hpp"

using namespace tandem;

#if TANDEM_HAVE_CUDA
namespace {

constexpr double kU = 0x1p-24;  // float32 unit roundoff
double gamma(double n) {
  return n * kU / (1.0 - n * kU);
}

struct Case {
  int32_t n_head, n_head_kv, head_dim;
  bool f16;
};

struct Data {
  std::vector<int32_t> lens;
  std::vector<float> q, k, v;
};

Data make_data(const Case& c, const std::vector<int32_t>& lens, uint32_t seed) {
  Data d;
  d.lens = lens;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  int64_t rows = 0;
  for (int32_t l : lens) rows += l;
  const int64_t row = int64_t{c.n_head_kv} * c.head_dim;
  d.q.resize(lens.size() * size_t(c.n_head) * size_t(c.head_dim));
  d.k.resize(size_t(rows * row));
  d.v.resize(size_t(rows * row));
  for (float& x : d.q) x = 2.0f * u(rng);  // scores of a few units: a peaked softmax
  for (float& x : d.k) x = u(rng);
  for (float& x : d.v) x = u(rng);
  return d;
}

float stored(float x, bool f16) {
  return f16 ? kernels::fp16_bits_to_fp32(kernels::fp32_to_fp16_bits(x)) : x;
}

// Float64 attention of each sequence's last position over the values as stored (f16 KV:
// q, K and V rounded to f16 as the kernels define it), and for each output row the bound
// of a float32 evaluation of the same formula: scores are hd-term dots (error <=
// gamma(hd + 1) * scale * sum|q k|), each exp(s - max) then carries twice that plus a few
// ulp of expf, and the sums of n_pos terms gamma(n_pos); the normalised output moves by at
// most twice the relative error of its terms times max|V| (Higham, Accuracy and Stability
// of Numerical Algorithms, 2nd ed., section 3.1).
// Float64 attention of one query head `q` over the K/V rows [r0, r0 + n) of KV head `hk`:
// adds the head_dim outputs into `o` (zeroed by the caller) and returns their bound (above).
double reference_head(const Case& c, const float* q, const std::vector<float>& k, const std::vector<float>& v,
                      int64_t r0, int32_t n, int32_t hk, double* o) {
  const int32_t hd = c.head_dim, row = c.n_head_kv * hd;
  const double scale = 1.0 / std::sqrt(double(float(hd)));
  std::vector<double> sc(static_cast<size_t>(n));
  double mx = -1e300, abs_dot = 0.0, max_v = 0.0;
  for (int32_t p = 0; p < n; ++p) {
    const float* kr = &k[size_t((r0 + p) * row + hk * hd)];
    double dot = 0.0, ad = 0.0;
    for (int32_t e = 0; e < hd; ++e) {
      const double qe = stored(q[e], c.f16), ke = stored(kr[e], c.f16);
      dot += qe * ke;
      ad += std::fabs(qe * ke);
    }
    sc[size_t(p)] = dot * double(float(scale));
    mx = std::max(mx, sc[size_t(p)]);
    abs_dot = std::max(abs_dot, ad);
  }
  double sum = 0.0;
  for (auto& x : sc) sum += (x = std::exp(x - mx));
  for (int32_t p = 0; p < n; ++p) {
    const float* vr = &v[size_t((r0 + p) * row + hk * hd)];
    for (int32_t e = 0; e < hd; ++e) {
      const double ve = stored(vr[e], c.f16);
      o[e] += sc[size_t(p)] / sum * ve;
      max_v = std::max(max_v, std::fabs(ve));
    }
  }
  const double score_err = gamma(hd + 1) * scale * abs_dot;
  const double term_err = 2.0 * score_err + 8.0 * kU + gamma(n + 2);
  return 2.0 * term_err * max_v;
}

void reference(const Case& c, const Data& d, std::vector<double>& out, std::vector<double>& bound) {
  const int32_t hd = c.head_dim, group = c.n_head / c.n_head_kv;
  out.assign(d.q.size(), 0.0);
  bound.assign(d.lens.size() * size_t(c.n_head), 0.0);
  int64_t r0 = 0;
  for (size_t s = 0; s < d.lens.size(); ++s) {
    const int32_t n = d.lens[s];
    for (int32_t h = 0; h < c.n_head; ++h) {
      const size_t qi = s * size_t(c.n_head) + size_t(h);
      bound[qi] = reference_head(c, &d.q[qi * size_t(hd)], d.k, d.v, r0, n, h / group, &out[qi * size_t(hd)]);
    }
    r0 += n;
  }
}

// Largest |got - ref| / bound over the rows (<= 1 passes); extra_rel * max|V| widens the bound.
double worst_over_bound(const Case& c, const std::vector<float>& got, const std::vector<double>& ref,
                        const std::vector<double>& bound, double extra) {
  double worst = 0.0;
  for (size_t r = 0; r < bound.size(); ++r) {
    for (int32_t e = 0; e < c.head_dim; ++e) {
      const size_t i = r * size_t(c.head_dim) + size_t(e);
      const double diff = std::fabs(double(got[i]) - ref[i]);
      worst = std::max(worst, std::isnan(diff) ? 1e30 : diff / (bound[r] + extra));
    }
  }
  return worst;
}

}  // namespace

TEST_CASE("flash-decoding attention matches float64 and the per-head kernel", "[gpu][kernels][attention]") {
  // Partitions of 64 positions, pages of 16: the lengths end just before, on and after both.
  const std::vector<int32_t> lens = {1, 16, 17, 63, 64, 65, 128, 130};
  const int32_t page = 16, part = 64;
  for (const Case c : {Case{8, 4, 8, true}, Case{4, 4, 16, true}, Case{4, 4, 64, true}, Case{8, 2, 64, true},
                       Case{8, 1, 64, false}, Case{4, 4, 128, false}, Case{8, 2, 128, true}, Case{8, 1, 128, true}}) {
    INFO("n_head " << c.n_head << " n_head_kv " << c.n_head_kv << " head_dim " << c.head_dim << " f16 " << c.f16);
    const Data d = make_data(c, lens, uint32_t(c.n_head * 1000 + c.n_head_kv * 10 + c.head_dim + c.f16));
    std::vector<double> ref, bound;
    reference(c, d, ref, bound);
    std::vector<float> split(d.q.size()), per_head(d.q.size());
    gpu_testing::attention_decode(c.n_head, c.n_head_kv, c.head_dim, page, c.f16, d.lens, d.q.data(), d.k.data(),
                                  d.v.data(), split.data(), part);
    gpu_testing::attention_decode(c.n_head, c.n_head_kv, c.head_dim, page, c.f16, d.lens, d.q.data(), d.k.data(),
                                  d.v.data(), per_head.data(), 0);
    double max_v = 0.0;
    for (float x : d.v) max_v = std::max(max_v, std::fabs(double(stored(x, c.f16))));
    // Both kernels round each probability to f16 as the CPU does (f16 KV): up to 2^-11 of
    // it, so 2^-11 * max|V| more.
    const double prob_rounding = c.f16 ? 0x1p-11 * max_v : 0.0;
    const double split_worst = worst_over_bound(c, split, ref, bound, prob_rounding);
    const double per_head_worst = worst_over_bound(c, per_head, ref, bound, prob_rounding);
    INFO("split: worst |err| / bound " << split_worst << ", per-head: " << per_head_worst);
    CHECK(split_worst <= 1.0);
    CHECK(per_head_worst <= 1.0);
  }
}

TEST_CASE("flash-decoding attention of a sequence does not depend on the batch around it",
          "[gpu][kernels][attention]") {
  const Case c{8, 2, 64, true};
  const Data all = make_data(c, {70, 25, 3}, 7);
  std::vector<float> batch(all.q.size());
  gpu_testing::attention_decode(c.n_head, c.n_head_kv, c.head_dim, 16, c.f16, all.lens, all.q.data(), all.k.data(),
                                all.v.data(), batch.data(), 64);
  // The second sequence alone: its q row and its 25 K/V rows.
  const size_t q_row = size_t(c.n_head) * size_t(c.head_dim), kv_row = size_t(c.n_head_kv) * size_t(c.head_dim);
  const std::vector<float> q(all.q.begin() + long(q_row), all.q.begin() + long(2 * q_row));
  const std::vector<float> k(all.k.begin() + long(70 * kv_row), all.k.begin() + long(95 * kv_row));
  const std::vector<float> v(all.v.begin() + long(70 * kv_row), all.v.begin() + long(95 * kv_row));
  std::vector<float> solo(q_row);
  gpu_testing::attention_decode(c.n_head, c.n_head_kv, c.head_dim, 16, c.f16, {25}, q.data(), k.data(), v.data(),
                                solo.data(), 64);
  CHECK(std::equal(solo.begin(), solo.end(), batch.begin() + long(q_row)));
}
#endif

#if TANDEM_HAVE_CUDA
namespace {

// Prefill: sequence s holds positions [0, lens[s]) and queries with its last chunks[s] (a
// later chunk of a prompt when shorter than lens[s]); q rows sequence by sequence.
struct Prefill {
  std::vector<int32_t> lens, chunks;
  std::vector<float> q, k, v;
};

Prefill make_prefill(const Case& c, const std::vector<int32_t>& lens, const std::vector<int32_t>& chunks,
                     uint32_t seed) {
  Prefill d;
  d.lens = lens;
  d.chunks = chunks;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  int64_t rows = 0, toks = 0;
  for (size_t s = 0; s < lens.size(); ++s) rows += lens[s], toks += chunks[s];
  const int64_t row = int64_t{c.n_head_kv} * c.head_dim;
  d.q.resize(size_t(toks) * size_t(c.n_head) * size_t(c.head_dim));
  d.k.resize(size_t(rows * row));
  d.v.resize(size_t(rows * row));
  for (float& x : d.q) x = 2.0f * u(rng);
  for (float& x : d.k) x = u(rng);
  for (float& x : d.v) x = u(rng);
  return d;
}

// Float64 causal attention of every query token over positions [0, pos] of its sequence, as
// reference() does for one token, with reference()'s bound for n = pos + 1 positions. It
// holds for both kernels: each forms the CPU's sum S = sum_p exp(s_p - max) in double (the
// written 8 lanes and their tree), weighs V with e * (1 / S) and adds the n products in f32
// (within each 64-position chunk, then the chunks: no worse than one chain).
void prefill_reference(const Case& c, const Prefill& d, std::vector<double>& out, std::vector<double>& bound) {
  const int32_t hd = c.head_dim, group = c.n_head / c.n_head_kv;
  out.assign(d.q.size(), 0.0);
  bound.clear();
  int64_t r0 = 0, tok = 0;
  for (size_t s = 0; s < d.lens.size(); ++s) {
    for (int32_t j = 0; j < d.chunks[s]; ++j, ++tok) {
      const int32_t n = d.lens[s] - d.chunks[s] + j + 1;  // positions [0, pos]
      for (int32_t h = 0; h < c.n_head; ++h) {
        const size_t qi = size_t(tok) * size_t(c.n_head) + size_t(h);
        bound.push_back(reference_head(c, &d.q[qi * size_t(hd)], d.k, d.v, r0, n, h / group, &out[qi * size_t(hd)]));
      }
    }
    r0 += d.lens[s];
  }
}

}  // namespace

TEST_CASE("tiled flash-attention prefill matches float64 and the per-head kernel", "[gpu][kernels][attention]") {
  // One launch per case: chunks of 1, 15, 16, 17 and 70 tokens from position 0 and as later
  // chunks of a prompt (starting at 5, 16, 3, 30, 9), pages of 16 in reverse order.
  const std::vector<int32_t> lens = {1, 15, 16, 17, 70, 6, 31, 19, 47, 79};
  const std::vector<int32_t> chunks = {1, 15, 16, 17, 70, 1, 15, 16, 17, 70};
  int64_t n_tok = 0, n_pos_max = 0;
  for (size_t s = 0; s < lens.size(); ++s) n_tok += chunks[s], n_pos_max = std::max<int64_t>(n_pos_max, lens[s]);
  for (const Case c : {Case{4, 4, 64, true}, Case{8, 2, 64, false}, Case{7, 1, 64, true}, Case{4, 4, 128, false},
                       Case{8, 2, 128, true}, Case{14, 2, 128, false}, Case{7, 1, 128, true}, Case{4, 2, 16, true},
                       Case{8, 4, 8, true}}) {
    INFO("n_head " << c.n_head << " n_head_kv " << c.n_head_kv << " head_dim " << c.head_dim << " f16 " << c.f16);
    const Prefill d = make_prefill(c, lens, chunks, uint32_t(c.n_head * 1000 + c.n_head_kv * 10 + c.head_dim));
    std::vector<double> ref, bound;
    prefill_reference(c, d, ref, bound);
    std::vector<float> tiled(d.q.size()), per_head(d.q.size());
    gpu_testing::attention_prefill(c.n_head, c.n_head_kv, c.head_dim, 16, c.f16, d.lens, d.chunks, d.q.data(),
                                   d.k.data(), d.v.data(), tiled.data(), true);
    gpu_testing::attention_prefill(c.n_head, c.n_head_kv, c.head_dim, 16, c.f16, d.lens, d.chunks, d.q.data(),
                                   d.k.data(), d.v.data(), per_head.data(), false);
    double max_v = 0.0;
    for (float x : d.v) max_v = std::max(max_v, std::fabs(double(stored(x, c.f16))));
    // f16 KV: both kernels round each probability to f16 as the CPU does (2^-11 of it); one
    // below f16's normal range (2^-14) is off by up to 2^-25 absolute: (2^-11 + n 2^-25) max|V|.
    const double prob_rounding = c.f16 ? (0x1p-11 + double(n_pos_max) * 0x1p-25) * max_v : 0.0;
    const double tiled_worst = worst_over_bound(c, tiled, ref, bound, prob_rounding);
    const double per_head_worst = worst_over_bound(c, per_head, ref, bound, prob_rounding);
    // The two kernels against each other: within the sum of their bounds.
    std::vector<double> head_as_ref(per_head.begin(), per_head.end()), both(bound.size());
    for (size_t r = 0; r < both.size(); ++r) both[r] = 2.0 * bound[r];
    const double cross_worst = worst_over_bound(c, tiled, head_as_ref, both, 2.0 * prob_rounding);
    INFO("tiled: worst |err| / bound " << tiled_worst << ", per-head: " << per_head_worst << ", tiled vs per-head "
                                       << cross_worst);
    CHECK(tiled_worst <= 1.0);
    CHECK(per_head_worst <= 1.0);
    CHECK(cross_worst <= 1.0);
    CHECK(int64_t(tiled.size()) == n_tok * c.n_head * c.head_dim);
  }
}
#endif

#if TANDEM_HAVE_CUDA
// The tiled prefill stages a head's K and V rows 16 bytes at a time where the row is
// 16-byte aligned and holds whole 16-byte chunks, one value at a time otherwise (the same
// floats). Pages shifted off 16-byte alignment (by 2 and 8 bytes with f16, 4 and 8 with f32)
// take the element-wise path everywhere; every kernel's output must be bit-identical to the
// aligned run's. Head dims 8-128, and 12 (f16: no whole chunks, element-wise both times) as
// a control.
TEST_CASE("16-byte KV loads give the bits of element-wise loads", "[gpu][kernels][attention]") {
  const std::vector<int32_t> lens = {1, 17, 49, 70};
  const std::vector<int32_t> chunks = {1, 9, 17, 70};
  for (const Case c : {Case{8, 4, 8, true}, Case{8, 2, 64, true}, Case{4, 4, 64, false}, Case{8, 1, 128, true},
                       Case{4, 2, 128, false}, Case{4, 2, 12, true}}) {
    INFO("n_head " << c.n_head << " n_head_kv " << c.n_head_kv << " head_dim " << c.head_dim << " f16 " << c.f16);
    const Data d = make_data(c, lens, uint32_t(c.head_dim * 7 + c.f16));
    const Prefill p = make_prefill(c, lens, chunks, uint32_t(c.head_dim * 11 + c.f16));
    auto run = [&](int32_t shift) {
      std::vector<std::vector<float>> outs;
      for (int32_t part : {64, 0}) {
        outs.emplace_back(d.q.size());
        gpu_testing::attention_decode(c.n_head, c.n_head_kv, c.head_dim, 16, c.f16, d.lens, d.q.data(), d.k.data(),
                                      d.v.data(), outs.back().data(), part, shift);
      }
      for (bool tiled : {true, false}) {
        outs.emplace_back(p.q.size());
        gpu_testing::attention_prefill(c.n_head, c.n_head_kv, c.head_dim, 16, c.f16, p.lens, p.chunks, p.q.data(),
                                       p.k.data(), p.v.data(), outs.back().data(), tiled, shift);
      }
      return outs;
    };
    const auto aligned = run(0);
    for (int32_t shift : {c.f16 ? 2 : 4, 8}) {
      const auto shifted = run(shift);
      for (size_t i = 0; i < aligned.size(); ++i) {
        INFO("page shift " << shift << ", kernel "
                           << (i == 0   ? "split decode"
                               : i == 1 ? "per-head decode"
                               : i == 2 ? "tiled prefill"
                                        : "per-head prefill"));
        CHECK(test::same_bits(aligned[i], shifted[i]));
      }
    }
  }
}
#endif

#if TANDEM_HAVE_CUDA
namespace {

// The CPU's attn_tiled (the dispatched ISA) on the harness's rows: per sequence, its K/V
// rows in one page (f16 or f32 as the cache holds them), its queried rows at positions
// [lens[s] - chunks[s], lens[s]); out rows sequence by sequence as the harness writes them.
std::vector<float> cpu_attention(const Case& c, const Prefill& d, int32_t window) {
  const int32_t group = c.n_head / c.n_head_kv, hd = c.head_dim;
  const int64_t row = int64_t{c.n_head_kv} * hd, q_stride = int64_t{c.n_head} * hd;
  std::vector<float> out;
  int64_t r0 = 0, tok = 0;
  for (size_t s = 0; s < d.lens.size(); ++s) {
    const int32_t len = d.lens[s], chunk = d.chunks[s], pos0 = len - chunk;
    const auto k0 = d.k.begin() + long(r0 * row), v0 = d.v.begin() + long(r0 * row);
    const std::vector<float> kf(k0, k0 + long(len * row)), vf(v0, v0 + long(len * row));
    std::vector<uint16_t> kh(kf.size()), vh(vf.size());
    for (size_t i = 0; i < kf.size(); ++i) {
      kh[i] = kernels::fp32_to_fp16_bits(kf[i]);
      vh[i] = kernels::fp32_to_fp16_bits(vf[i]);
    }
    const void* kp[1] = {c.f16 ? static_cast<const void*>(kh.data()) : kf.data()};
    const void* vp[1] = {c.f16 ? static_cast<const void*>(vh.data()) : vf.data()};
    std::vector<float> q(size_t(len * q_stride)), o(q.size(), std::nanf(""));
    std::copy(d.q.begin() + long(tok * q_stride), d.q.begin() + long((tok + chunk) * q_stride),
              q.begin() + long(pos0 * q_stride));
    for (int32_t h = 0; h < c.n_head_kv; ++h) {
      kernels::FlashAttnArgs a =
          test::attn_args(kp, vp, len, row, hd, h, group, q.data(), o.data(), q_stride, pos0, chunk);
      a.kv_f16 = c.f16;
      a.window = window;
      std::vector<float> scratch(kernels::attn_tiled_scratch_floats(hd, int64_t{chunk} * group, len), std::nanf(""));
      kernels::attn_tiled(a, scratch.data());
    }
    out.insert(out.end(), o.begin() + long(pos0 * q_stride), o.end());
    r0 += len;
    tok += chunk;
  }
  return out;
}

}  // namespace

// docs/arithmetic.md, "Attention": the decode kernels (split over partitions of 64 and 128
// positions, and one block per head) and the prefill kernels (tiled, and one block per
// head) give the bytes of the CPU's attn_tiled on every ISA, for full attention and
// sliding windows (shorter and longer than the sequences, ending inside and on chunk
// boundaries), f16 and f32 KV, head_dim 64, 128, 44 (an 8-element and a 4-element tail), 20
// and 8 (no 32-lane part), GQA groups 1-7, sequences crossing the 64-position chunks.
TEST_CASE("GPU attention kernels give attn_tiled's bits, full and windowed", "[gpu][kernels][attention]") {
  const std::vector<int32_t> lens = {1, 9, 63, 64, 65, 130, 200};
  const std::vector<int32_t> chunks = {1, 9, 17, 64, 2, 70, 40};
  for (const Case c : {Case{8, 2, 64, true}, Case{4, 4, 64, false}, Case{7, 1, 128, true}, Case{4, 2, 44, true},
                       Case{6, 3, 44, false}, Case{4, 1, 20, true}, Case{8, 4, 8, false}}) {
    const Prefill dec = make_prefill(c, lens, std::vector<int32_t>(lens.size(), 1), uint32_t(c.head_dim * 13 + c.f16));
    const Prefill pre = make_prefill(c, lens, chunks, uint32_t(c.head_dim * 17 + c.n_head));
    for (const int32_t window : {0, 7, 64, 70, 150}) {
      INFO("n_head " << c.n_head << " n_head_kv " << c.n_head_kv << " head_dim " << c.head_dim << " f16 " << c.f16
                     << " window " << window);
      std::vector<std::vector<float>> gpu_dec, gpu_pre;
      for (const int32_t part : {64, 128, 0}) {
        gpu_dec.emplace_back(dec.q.size());
        gpu_testing::attention_decode(c.n_head, c.n_head_kv, c.head_dim, 16, c.f16, dec.lens, dec.q.data(),
                                      dec.k.data(), dec.v.data(), gpu_dec.back().data(), part, 0, nullptr, 0, window);
      }
      for (const bool tiled : {true, false}) {
        gpu_pre.emplace_back(pre.q.size());
        gpu_testing::attention_prefill(c.n_head, c.n_head_kv, c.head_dim, 16, c.f16, pre.lens, pre.chunks, pre.q.data(),
                                       pre.k.data(), pre.v.data(), gpu_pre.back().data(), tiled, 0, 0, window);
      }
      for (const auto& isa : test::isas()) {
        INFO("CPU ISA " << isa);
        test::IsaScope scope(isa);
        const std::vector<float> want_dec = cpu_attention(c, dec, window), want_pre = cpu_attention(c, pre, window);
        for (size_t i = 0; i < gpu_dec.size(); ++i) {
          INFO("decode kernel " << (i == 0 ? "split 64" : i == 1 ? "split 128" : "per head"));
          CHECK(test::same_bits(want_dec, gpu_dec[i]));
        }
        for (size_t i = 0; i < gpu_pre.size(); ++i) {
          INFO("prefill kernel " << (i == 0 ? "tiled" : "per head"));
          CHECK(test::same_bits(want_pre, gpu_pre[i]));
        }
      }
    }
  }
}
#endif
