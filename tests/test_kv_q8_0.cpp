// Q8_0 KV cache (llama.cpp's --cache-type-k/-v q8_0): the row format against hand-computed
// blocks, layouts (bytes per token, refused shapes), attention over Q8_0 pages against a
// float64 reference, the CPU executor's batch invariance on a q8_0 store, greedy output
// against f16, and byte-exact round trips (tier moves, export/import, save/restore,
// migration) plus the explicit f16/f32 <-> q8_0 conversions of the KV contract.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>

#include "cpu/cpu_kernels.hpp"
#include "cpu_test_support.hpp"
#include "kv_test_support.hpp"

using namespace tandem;
using namespace tandem::kernels;

using test::code_of;
using test::isas;
using test::IsaScope;
using test::load_model;
using test::rand_f32;

TEST_CASE("q8_0 KV rows: quantise and dequantise against hand-computed blocks", "[kv][q8_0]") {
  // Block 0: max |x| = 127, so d = 1 (fp16 0x3C00) and q = round-half-even(x).
  // Block 1: max |x| = 254, d = 2 (0x4000), q = round-half-even(x / 2).
  // Block 2: all zero: d = 0, q = 0.
  // Block 3: max |x| = 1, d = 1/127 = 0.0078740..., as fp16 2^-7 * (1 + 8/1024) (0x2008);
  //          q = round(x * 127 / max|x|).
  float x[128] = {};
  const float b0[8] = {127.f, -127.f, 0.5f, 1.5f, 2.5f, -0.5f, -2.5f, 3.4f};
  const int8_t q0[8] = {127, -127, 0, 2, 2, 0, -2, 3};
  const float b1[6] = {254.f, 3.f, 5.f, -1.f, -7.f, 100.f};
  const int8_t q1[6] = {127, 2, 2, 0, -4, 50};
  const float b3[4] = {1.f, -0.5f, 0.25f, 0.0f};
  const int8_t q3[4] = {127, -64, 32, 0};  // -63.5 -> -64 and 31.75 -> 32 (nearest)
  std::memcpy(x, b0, sizeof b0);
  std::memcpy(x + 32, b1, sizeof b1);
  std::memcpy(x + 96, b3, sizeof b3);
  for (const auto& isa : isas()) {
    IsaScope scope(isa);
    INFO("isa " << isa);
    BlockQ8_0 y[4];
    quantize_row_q8_0(x, y, 128);
    CHECK(y[0].d == 0x3C00);
    CHECK(y[1].d == 0x4000);
    CHECK(y[2].d == 0x0000);
    CHECK(y[3].d == 0x2008);
    for (int j = 0; j < 32; ++j) {
      CHECK(y[0].qs[j] == (j < 8 ? q0[j] : 0));
      CHECK(y[1].qs[j] == (j < 6 ? q1[j] : 0));
      CHECK(y[2].qs[j] == 0);
      CHECK(y[3].qs[j] == (j < 4 ? q3[j] : 0));
    }
    float back[128];
    dequantize_row_q8_0(y, back, 128);
    for (int j = 0; j < 8; ++j) CHECK(back[j] == float(q0[j]));
    for (int j = 0; j < 6; ++j) CHECK(back[32 + j] == 2.0f * float(q1[j]));
    for (int j = 0; j < 32; ++j) CHECK(back[64 + j] == 0.0f);
    CHECK(back[96] == 0.99993896484375f);     // 127 * 0.00787353515625
    CHECK(back[97] == -0.50390625f);          // -64 * 0.00787353515625
    CHECK(back[98] == 0.251953125f);          // 32 * 0.00787353515625
    CHECK(sizeof(y) == 4 * kKvQ8BlockBytes);  // 34 bytes per 32 elements
  }
}

TEST_CASE("q8_0 KV layout: bytes per token are 34/64 of f16's; rows that are not whole blocks are refused",
          "[kv][q8_0]") {
  for (const char* name : {"aidreams260K-q4_0", "stories260K-q4_0", "synth-qwen3-hd64-small-q4_0"}) {
    const HParams& hp = load_model(name)->hparams();
    INFO(name);
    const KvLayout f16 = KvLayout::for_model(hp, 16, KvDtype::kF16);
    const KvLayout q8 = KvLayout::for_model(hp, 16, KvDtype::kQ8_0);
    const uint64_t elems = uint64_t(hp.n_head_kv) * uint64_t(hp.head_dim);
    CHECK(f16.row_bytes() == elems * 2);
    CHECK(q8.row_bytes() == elems / 32 * 34);
    // Bytes per token (all layers, K and V): 2 per element for f16, 34/32 for q8_0.
    CHECK(q8.page_bytes() * 64 == f16.page_bytes() * 34);
    CHECK(q8.row_offset(1, 1, 3) == ((1 * 2 + 1) * 16 + 3) * q8.row_bytes());
  }
  HParams odd;
  odd.n_layer = 2;
  odd.n_head_kv = 3;
  odd.head_dim = 8;  // a row of 24 elements
  CHECK(code_of([&] { (void)KvLayout::for_model(odd, 16, KvDtype::kQ8_0); }) == ErrorCode::kInvalidArgument);
  CHECK(code_of([&] { (void)KvLayout::for_model(odd, 16, KvDtype::kF16); }) == ErrorCode::kOk);
  KvStoreOptions o;
  o.layout = KvLayout::for_model(odd, 16, KvDtype::kF16);
  o.layout.dtype = KvDtype::kQ8_0;  // built by hand past for_model's check: the store refuses it
  o.host_pages = 2;
  CHECK(code_of([&] { KvStore s(std::move(o)); }) == ErrorCode::kInvalidArgument);
  KvDtype d = KvDtype::kF16;
  CHECK((kv_dtype_from_name("q8_0", d) && d == KvDtype::kQ8_0 && kv_dtype_name(d) == "q8_0"));
  CHECK(!kv_dtype_from_name("q4_0", d));
  CHECK(d == KvDtype::kQ8_0);
}

namespace {

// K and V pages of one sequence: n_kv KV heads x hd per row, page_size rows per page, in
// q8_0 and (the same dequantised values) f32, plus the original f32 values.
struct Q8Kv {
  int64_t hd, nkv, page_size, n_ctx;
  std::vector<float> k_orig, v_orig;                // [n_ctx][nkv * hd]
  std::vector<std::vector<BlockQ8_0>> kq, vq;       // per page
  std::vector<std::vector<float>> kd, vd;           // per page, dequantised
  std::vector<const void*> kq_p, vq_p, kd_p, vd_p;  // page pointers
  int64_t stride() const { return nkv * hd; }
  Q8Kv(std::mt19937& g, int64_t hd_, int64_t nkv_, int64_t ps, int64_t n_ctx_)
      : hd(hd_), nkv(nkv_), page_size(ps), n_ctx(n_ctx_) {
    k_orig = rand_f32(g, size_t(n_ctx * stride()), -2.f, 2.f);
    v_orig = rand_f32(g, k_orig.size(), -2.f, 2.f);
    const int64_t n_pages = (n_ctx + ps - 1) / ps;
    const size_t page_elems = size_t(ps * stride());
    for (int64_t pg = 0; pg < n_pages; ++pg) {
      kq.emplace_back(page_elems / 32);
      vq.emplace_back(page_elems / 32);
      kd.emplace_back(page_elems, 0.f);
      vd.emplace_back(page_elems, 0.f);
      for (int64_t s = 0; s < ps && pg * ps + s < n_ctx; ++s) {
        const size_t src = size_t((pg * ps + s) * stride()), dst = size_t(s * stride());
        quantize_row_q8_0(k_orig.data() + src, kq.back().data() + dst / 32, stride());
        quantize_row_q8_0(v_orig.data() + src, vq.back().data() + dst / 32, stride());
      }
      dequantize_row_q8_0(kq.back().data(), kd.back().data(), int64_t(page_elems));
      dequantize_row_q8_0(vq.back().data(), vd.back().data(), int64_t(page_elems));
    }
    for (int64_t pg = 0; pg < n_pages; ++pg) {
      kq_p.push_back(kq[size_t(pg)].data());
      vq_p.push_back(vq[size_t(pg)].data());
      kd_p.push_back(kd[size_t(pg)].data());
      vd_p.push_back(vd[size_t(pg)].data());
    }
  }
  float kdq(int64_t p, int64_t h, int64_t d) const {
    return kd[size_t(p / page_size)][size_t((p % page_size) * stride() + h * hd + d)];
  }
  float vdq(int64_t p, int64_t h, int64_t d) const {
    return vd[size_t(p / page_size)][size_t((p % page_size) * stride() + h * hd + d)];
  }
  float ko(int64_t p, int64_t h, int64_t d) const { return k_orig[size_t(p * stride() + h * hd + d)]; }
  float vo(int64_t p, int64_t h, int64_t d) const { return v_orig[size_t(p * stride() + h * hd + d)]; }
};

void run_tiled(const Q8Kv& kv, bool q8, int64_t h, int32_t group, const float* q, float* out, int64_t q_stride,
               int32_t pos0, int32_t n_pos) {
  FlashAttnArgs a = test::attn_args(q8 ? kv.kq_p.data() : kv.kd_p.data(), q8 ? kv.vq_p.data() : kv.vd_p.data(),
                                    kv.page_size, kv.stride(), kv.hd, h, group, q, out, q_stride, pos0, n_pos);
  a.kv_f16 = false;
  a.kv_q8_0 = q8;
  std::vector<float> scratch(attn_tiled_scratch_floats(kv.hd, int64_t{n_pos} * group, int64_t{pos0} + n_pos),
                             std::nanf(""));
  attn_tiled(a, scratch.data());
}

}  // namespace

TEST_CASE(
    "attention over q8_0 KV pages: the f32 path on the dequantised values, and within the Q8_0 rounding of "
    "a float64 reference",
    "[kv][q8_0][attention]") {
  std::mt19937 g(8080);
  struct Shape {
    int64_t hd, nkv;
    int32_t group;
    int64_t page_size, n_ctx;
    int32_t pos0, n_pos;  // one call over these positions
  };
  // head_dim 16 x 2 heads: a head starts mid-block (aidreams' shape); 64 and 128: whole blocks.
  const std::vector<Shape> shapes = {
      {16, 2, 2, 16, 40, 0, 40},
      {64, 2, 4, 16, 70, 60, 10},
      {128, 2, 7, 5, 130, 127, 3},
      {64, 1, 8, 32, 300, 299, 1},
  };
  double worst_dq = 0.0, worst_orig = 0.0, worst_ratio = 0.0;
  for (const auto& sh : shapes) {
    const Q8Kv kv(g, sh.hd, sh.nkv, sh.page_size, sh.n_ctx);
    const int64_t q_stride = sh.nkv * sh.group * sh.hd;
    const std::vector<float> q = rand_f32(g, size_t(sh.n_ctx * q_stride), -0.5f, 0.5f);
    const double scale = 1.0 / std::sqrt(double(static_cast<float>(sh.hd)));
    // The Q8_0 rounding bound per element (amax <= 2 here): ggml quantises with d = amax / 127
    // and stores fp16(d), so |dequant(x) - x| <= d * |q - x / d| (rounding q: 1/2, plus
    // 2^-16 for the f32 product x * 127 / amax) + 127 * |fp16(d) - d| (the stored scale,
    // relative error <= 2^-11) <= (1/2 + 2^-16 + 127 * 2^-11) * amax / 127.
    const double amax = 2.0;
    const double e_elem = (0.5 + std::ldexp(1.0, -16) + 127.0 * std::ldexp(1.0, -11)) * amax / 127.0;
    for (const auto& isa : isas()) {
      IsaScope s(isa);
      std::vector<float> out8(q.size(), std::nanf("")), out32(q.size(), std::nanf(""));
      for (int64_t h = 0; h < sh.nkv; ++h) {
        run_tiled(kv, true, h, sh.group, q.data(), out8.data(), q_stride, sh.pos0, sh.n_pos);
        run_tiled(kv, false, h, sh.group, q.data(), out32.data(), q_stride, sh.pos0, sh.n_pos);
      }
      for (int32_t qp = sh.pos0; qp < sh.pos0 + sh.n_pos; ++qp)
        for (int64_t h = 0; h < sh.nkv; ++h)
          for (int32_t gi = 0; gi < sh.group; ++gi) {
            const size_t row = size_t(qp * q_stride + (h * sh.group + gi) * sh.hd);
            const float* qr = q.data() + row;
            INFO(isa << " hd " << sh.hd << " group " << sh.group << " page " << sh.page_size << " pos " << qp
                     << " head " << h * sh.group + gi);
            // (1) Bit for bit the f32 kernel on the dequantised rows (dequantisation is exact).
            REQUIRE(std::memcmp(out8.data() + row, out32.data() + row, size_t(sh.hd) * sizeof(float)) == 0);
            // (2) Float64 softmax(q.k) v on the dequantised values (dq) and on the originals.
            auto reference = [&](bool dq, std::vector<double>& ref) {
              std::vector<double> sc(size_t(qp) + 1);
              double mx = -INFINITY;
              for (int32_t p = 0; p <= qp; ++p) {
                double dot = 0.0;
                for (int64_t d = 0; d < sh.hd; ++d) dot += double(qr[d]) * (dq ? kv.kdq(p, h, d) : kv.ko(p, h, d));
                sc[size_t(p)] = dot * scale;
                mx = std::max(mx, sc[size_t(p)]);
              }
              double sum = 0.0;
              for (auto& x : sc) sum += (x = std::exp(x - mx));
              ref.assign(size_t(sh.hd), 0.0);
              for (int64_t d = 0; d < sh.hd; ++d)
                for (int32_t p = 0; p <= qp; ++p)
                  ref[size_t(d)] += sc[size_t(p)] / sum * (dq ? kv.vdq(p, h, d) : kv.vo(p, h, d));
            };
            std::vector<double> ref_dq, ref_orig;
            reference(true, ref_dq);
            reference(false, ref_orig);
            // Bound against the originals: a K element off by <= e_elem moves each score by
            // <= delta = scale * ||q||_1 * e_elem, so each softmax weight by a factor within
            // e^(+-2 delta): sum |w' - w| <= e^(2 delta) - 1, times max|v'| <= amax + e_elem;
            // a V element off by <= e_elem moves the weighted mean by <= e_elem. Plus the f32
            // kernel's own error (2e-6 of max|v|, as the flash-attention test measures).
            double q_l1 = 0.0;
            for (int64_t d = 0; d < sh.hd; ++d) q_l1 += std::fabs(double(qr[d]));
            const double delta = scale * q_l1 * e_elem;
            const double bound = (amax + e_elem) * std::expm1(2.0 * delta) + e_elem + 2e-6 * amax;
            for (int64_t d = 0; d < sh.hd; ++d) {
              const double got = out8[row + size_t(d)];
              const double err_dq = std::fabs(got - ref_dq[size_t(d)]) / amax;
              const double err_orig = std::fabs(got - ref_orig[size_t(d)]);
              worst_dq = std::max(worst_dq, err_dq);
              worst_orig = std::max(worst_orig, err_orig);
              worst_ratio = std::max(worst_ratio, err_orig / bound);
              REQUIRE(err_dq <= 2e-6);
              REQUIRE(err_orig <= bound);
            }
          }
    }
  }
  WARN("q8_0 attention: worst |out - f64(dequantised)| / max|v| = " << worst_dq << "; worst |out - f64(original)| = "
                                                                    << worst_orig << " (" << worst_ratio
                                                                    << " of the Q8_0 rounding bound)");
}

TEST_CASE("q8_0 KV: chunked prefill and multi-sequence batches give bit-identical logits", "[kv][q8_0][parity]") {
  const auto model_name =
      GENERATE(as<std::string>{}, "aidreams260K-q4_0", "synth-qwen2-small-q4_0", "synth-qwen3-hd64-small-q4_0");
  auto model = load_model(model_name);
  CpuQ4Executor exec(model, CpuExecutorOptions{2});
  const auto ids = test::prompt_ids(40, model->hparams().n_vocab);
  INFO(model_name);

  SessionOptions one;
  one.kv_dtype = KvDtype::kQ8_0;
  CHECK(Session(model, exec, one).kv_store()->layout().dtype == KvDtype::kQ8_0);
  auto pool = test::make_store(model->hparams(), 16, 0, 16, KvDtype::kQ8_0);
  KvSequence a(*pool, 64), b(*pool, 64);
  test::check_batch_invariance(model, exec, ids, one, a, b);

  // The executor wrote Q8_0 rows: each K row of the store equals quantize_row_q8_0 of
  // some f32 row, so dequantising and quantising it again gives the same bytes.
  const KvLayout& l = pool->layout();
  std::vector<float> f(l.row_elems());
  std::vector<BlockQ8_0> again(l.row_elems() / 32);
  const std::byte* row = pool->page_data(a.page(0, int32_t(0))) + l.row_offset(1, 0, 3);
  dequantize_row_q8_0(reinterpret_cast<const BlockQ8_0*>(row), f.data(), int64_t(f.size()));
  quantize_row_q8_0(f.data(), again.data(), int64_t(f.size()));
  CHECK(std::memcmp(again.data(), row, l.row_bytes()) == 0);
}

TEST_CASE("q8_0 KV vs f16 KV: greedy tokens of the tiny real models (agreement reported)", "[kv][q8_0]") {
  for (const char* name : {"aidreams260K-q4_0", "stories260K-q4_0"}) {
    auto model = load_model(name);
    CpuQ4Executor exec(model, CpuExecutorOptions{2});
    const auto ids = test::prompt_ids(12, model->hparams().n_vocab);
    std::vector<int32_t> out[2];
    for (int i = 0; i < 2; ++i) {
      SessionOptions so;
      so.n_ctx = 128;
      so.kv_dtype = i == 0 ? KvDtype::kF16 : KvDtype::kQ8_0;
      Session s(model, exec, so);
      s.eval(ids);
      out[i] = test::greedy(s, 64);
    }
    size_t same_prefix = 0;
    while (same_prefix < out[0].size() && out[0][same_prefix] == out[1][same_prefix]) ++same_prefix;
    size_t same = 0;
    for (size_t i = 0; i < out[0].size(); ++i) same += out[0][i] == out[1][i] ? 1 : 0;
    WARN(name << ": q8_0 KV vs f16 KV, 64 greedy tokens after a 12-token prompt: first " << same_prefix
              << " identical, " << same << " of 64 equal position by position");
    CHECK(out[1].size() == 64);
  }
}

TEST_CASE("q8_0 KV pages round-trip byte for byte: tiers, export/import, save/restore, migration",
          "[kv][q8_0][contract]") {
  auto model = load_model("aidreams260K-q4_0");
  const HParams& hp = model->hparams();
  CpuQ4Executor a(model, CpuExecutorOptions{2}), b(model, CpuExecutorOptions{1});
  const auto ids = test::prompt_ids(29, hp.n_vocab);
  auto src = test::make_store(hp, 8, 8, 16, KvDtype::kQ8_0);
  SessionOptions so;
  so.kv_store = src;
  so.n_ctx = 128;
  so.kv_dtype = KvDtype::kQ8_0;
  Session s(model, a, so);
  s.eval(ids);
  const auto sums = test::page_checksums(s.kv(), *model, s.tokens());

  // Baseline continuation without any move.
  SessionOptions own;
  own.n_ctx = 128;
  own.kv_dtype = KvDtype::kQ8_0;
  Session base(model, a, own);
  base.eval(ids);
  const auto expect = test::greedy(base, 12);

  SECTION("Host -> File -> Host") {
    std::vector<std::byte> before(src->layout().page_bytes());
    src->read_page(s.kv().page(0, int32_t(1)), before.data());
    s.kv().move_to(KvTier::kFile);
    CHECK(s.kv().pages_outside(KvTier::kFile) == 0);
    CHECK(test::page_checksums(s.kv(), *model, s.tokens()) == sums);
    s.kv().move_to(KvTier::kHost);
    std::vector<std::byte> after(before.size());
    src->read_page(s.kv().page(0, int32_t(1)), after.data());
    CHECK(before == after);
    CHECK(test::page_checksums(s.kv(), *model, s.tokens()) == sums);
    CHECK(test::greedy(s, 12) == expect);
  }
  SECTION("export / import into another q8_0 store") {
    auto dst = test::make_store(hp, 8, 0, 16, KvDtype::kQ8_0);
    KvHandoff h = kv_export(s.kv(), *model, s.tokens());
    CHECK(h.descriptor.dtype == KvDtype::kQ8_0);
    CHECK(h.descriptor.row_bytes == uint64_t(hp.n_head_kv) * uint64_t(hp.head_dim) / 32 * 34);
    auto seq = kv_import(std::span<const KvHandoff>(&h, 1), *model, *dst, KvTier::kHost, 128, s.tokens());
    CHECK(test::page_checksums(*seq, *model, s.tokens()) == sums);
    // Other page size: rows are copied whole, so re-exporting at 16 gives the same pages.
    auto dst5 = test::make_store(hp, 40, 0, 5, KvDtype::kQ8_0);
    KvHandoff h5 = kv_export(*seq, *model, s.tokens());
    auto seq5 = kv_import(std::span<const KvHandoff>(&h5, 1), *model, *dst5, KvTier::kHost, 128);
    auto dst16 = test::make_store(hp, 8, 0, 16, KvDtype::kQ8_0);
    KvHandoff h16 = kv_export(*seq5, *model, s.tokens());
    auto seq16 = kv_import(std::span<const KvHandoff>(&h16, 1), *model, *dst16, KvTier::kHost, 128);
    CHECK(test::page_checksums(*seq16, *model, s.tokens()) == sums);
  }
  SECTION("save / restore") {
    const auto dir = test::scratch_dir("q8kv-save");
    s.save(dir / "q8.session");
    Session r(model, b, own);
    const auto report = r.restore(dir / "q8.session");
    CHECK(report.saved_kv_dtype == KvDtype::kQ8_0);
    CHECK(report.kv_dtype == KvDtype::kQ8_0);
    CHECK_FALSE(report.kv_converted());
    CHECK(r.kv_store()->layout().dtype == KvDtype::kQ8_0);
    CHECK(r.tokens() == s.tokens());
    CHECK(test::page_checksums(r.kv(), *model, r.tokens()) == sums);
    CHECK(test::greedy(r, 12) == expect);
  }
  SECTION("restore into an f32 session converts, and the report says from what") {
    const auto dir = test::scratch_dir("q8kv-save-f32");
    s.save(dir / "q8.session");
    SessionOptions f32 = own;
    f32.kv_dtype = KvDtype::kF32;
    Session r(model, b, f32);
    const auto report = r.restore(dir / "q8.session");
    CHECK(report.saved_kv_dtype == KvDtype::kQ8_0);
    CHECK(report.kv_dtype == KvDtype::kF32);
    CHECK(report.kv_converted());
    CHECK(r.kv_store()->layout().dtype == KvDtype::kF32);
    CHECK(r.tokens() == s.tokens());
  }
  SECTION("migration to another executor keeps q8_0 and continues exactly") {
    const auto report = s.migrate(b);
    CHECK(report.bytes == uint64_t(report.pages) * src->layout().page_bytes());
    CHECK(s.kv_store()->layout().dtype == KvDtype::kQ8_0);
    CHECK(test::page_checksums(s.kv(), *model, s.tokens()) == sums);
    CHECK(src->used_pages() == 0);
    CHECK(test::greedy(s, 12) == expect);
  }
  SECTION("q8_0 -> f32 is exact dequantisation, and f32 -> q8_0 gives back the original pages") {
    auto f32 = test::make_store(hp, 8, 0, 16, KvDtype::kF32);
    KvHandoff h = kv_export(s.kv(), *model, s.tokens());
    auto wide = kv_import(std::span<const KvHandoff>(&h, 1), *model, *f32, KvTier::kHost, 128);
    const KvLayout& l8 = src->layout();
    const KvLayout& l32 = f32->layout();
    std::vector<float> dq(l8.row_elems());
    for (int32_t pos = 0; pos < 29; ++pos) {
      const auto* q8 = reinterpret_cast<const BlockQ8_0*>(src->page_data(s.kv().page(0, int32_t(size_t(pos / 16)))) +
                                                          l8.row_offset(3, 0, pos % 16));
      const auto* w = reinterpret_cast<const float*>(f32->page_data(wide->page(0, int32_t(size_t(pos / 16)))) +
                                                     l32.row_offset(3, 0, pos % 16));
      for (size_t i = 0; i < l8.row_elems(); ++i)
        REQUIRE(w[i] == fp16_to_fp32(q8[i / 32].d) * float(q8[i / 32].qs[i % 32]));
    }
    auto back_store = test::make_store(hp, 8, 0, 16, KvDtype::kQ8_0);
    KvHandoff h2 = kv_export(*wide, *model, s.tokens());
    auto back = kv_import(std::span<const KvHandoff>(&h2, 1), *model, *back_store, KvTier::kHost, 128);
    CHECK(test::page_checksums(*back, *model, s.tokens()) == sums);
  }
}

TEST_CASE(
    "f16 -> q8_0 happens only when the receiving store asks for it, and a q8_0 descriptor is never read as "
    "f16",
    "[kv][q8_0][contract]") {
  auto model = load_model("aidreams260K-q4_0");
  const HParams& hp = model->hparams();
  CpuQ4Executor ex(model, CpuExecutorOptions{2});
  const auto ids = test::prompt_ids(21, hp.n_vocab);
  auto f16 = test::make_store(hp, 8);
  SessionOptions so;
  so.kv_store = f16;
  so.n_ctx = 64;
  Session s(model, ex, so);
  s.eval(ids);

  // f16 -> q8_0 into a q8_0 store: each row is quantize_row_q8_0 of the f16 values.
  auto q8 = test::make_store(hp, 8, 0, 16, KvDtype::kQ8_0);
  KvHandoff h = kv_export(s.kv(), *model, s.tokens());
  auto seq = kv_import(std::span<const KvHandoff>(&h, 1), *model, *q8, KvTier::kHost, 64, s.tokens());
  const KvLayout& l16 = f16->layout();
  const KvLayout& l8 = q8->layout();
  std::vector<float> wide(l16.row_elems());
  std::vector<BlockQ8_0> expect(l16.row_elems() / 32);
  for (int32_t pos = 0; pos < 21; ++pos) {
    for (int kind = 0; kind < 2; ++kind) {
      const auto* r16 = reinterpret_cast<const uint16_t*>(f16->page_data(s.kv().page(0, int32_t(size_t(pos / 16)))) +
                                                          l16.row_offset(2, kind, pos % 16));
      for (size_t i = 0; i < wide.size(); ++i) wide[i] = fp16_to_fp32(r16[i]);
      quantize_row_q8_0(wide.data(), expect.data(), int64_t(wide.size()));
      const std::byte* r8 = q8->page_data(seq->page(0, int32_t(size_t(pos / 16)))) + l8.row_offset(2, kind, pos % 16);
      REQUIRE(std::memcmp(expect.data(), r8, l8.row_bytes()) == 0);
    }
  }
  // The q8_0 sequence computes on (a step runs) and its pages leave with dtype q8_0.
  std::vector<float> logits(static_cast<size_t>(hp.n_vocab));
  const int32_t next = 5;
  SequenceStep st{seq.get(), std::span<const int32_t>(&next, 1), 21, LogitsRows::kLast};
  ex.step(std::span<const SequenceStep>(&st, 1), logits);
  CHECK(std::isfinite(logits[0]));

  // A descriptor whose dtype and row size disagree is refused, whichever way.
  std::vector<int32_t> toks = s.tokens();
  toks.push_back(next);
  KvHandoff h8 = kv_export(*seq, *model, toks);
  KvDescriptor d = h8.descriptor;
  CHECK(code_of([&] { kv_check_invariants(d, *model); }) == ErrorCode::kOk);
  d.dtype = KvDtype::kF16;  // q8_0 bytes labelled f16
  CHECK(code_of([&] { kv_check_invariants(d, *model); }) == ErrorCode::kKvMismatch);
  d = h8.descriptor;
  d.row_bytes = uint64_t(l16.row_bytes());  // f16's row size labelled q8_0
  CHECK(code_of([&] { kv_check_invariants(d, *model); }) == ErrorCode::kKvMismatch);
  d = h8.descriptor;
  d.dtype = static_cast<KvDtype>(7);  // unknown
  CHECK(code_of([&] { kv_check_invariants(d, *model); }) == ErrorCode::kKvMismatch);
  h8.lease->begin_read();
  h8.lease->confirm();
  CHECK(q8->used_pages() == 2);  // only seq's pages; the lease released its references
}
