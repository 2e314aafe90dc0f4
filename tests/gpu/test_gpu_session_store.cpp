// The KV store a Session makes for itself on the GPU executor: a Device tier (pages stay in
// VRAM between steps) instead of Host pages staged over PCIe every step. Needs a CUDA
// device, real or emulated (cuemu); skipped without one.
#include <catch2/catch.hpp>

#include <algorithm>
#include <vector>

#include "gpu_test_support.hpp"
#include "kv_test_support.hpp"
#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/session/session.hpp"

using namespace tandem;

#if TANDEM_HAVE_CUDA
TEST_CASE("a GPU session without a store keeps its KV on the Device tier and decodes as a staged Host one",
          "[gpu][kv][session]") {
  auto model = Model::load(test::model_path("stories260K-q4_0"));
  const auto& hp = model->hparams();
  GpuQ4Executor gpu(model);
  SessionOptions so;
  so.n_ctx = 64;
  SessionOptions staged = so;
  staged.kv_store = test::make_store(hp, 8);  // Host pages, staged into VRAM each step
  std::shared_ptr<KvStore> store;
  {
    Session d(model, gpu, so);
    Session h(model, gpu, staged);
    store = d.kv_store();
    REQUIRE(store->has_tier(KvTier::kDevice));
    CHECK_FALSE(store->has_tier(KvTier::kHost));
    const auto ids = test::prompt_ids(12, hp.n_vocab);
    d.eval(ids);
    h.eval(ids);
    for (int step = 0; step < 24; ++step) {
      const auto ld = d.logits(), lh = h.logits();
      INFO("step " << step);
      // Same kernels on the same page contents: the logits are identical, bit for bit.
      REQUIRE(std::equal(ld.begin(), ld.end(), lh.begin(), lh.end()));
      const int32_t next = test::argmax(ld);
      d.eval(std::span<const int32_t>(&next, 1));
      h.eval(std::span<const int32_t>(&next, 1));
    }
    CHECK(d.kv().pages_outside(KvTier::kDevice) == 0);
    CHECK(store->usage(KvTier::kDevice).used == (12 + 24 + 15) / 16);
  }
  CHECK(store->used_pages() == 0);  // the session's pages went back with it
}

TEST_CASE("a session migrated CPU -> GPU without a store of its own lands on the Device tier",
          "[gpu][kv][session][migration]") {
  auto model = Model::load(test::model_path("stories260K-q4_0"));
  const auto& hp = model->hparams();
  CpuQ4Executor cpu(model, CpuExecutorOptions{1});
  GpuQ4Executor gpu(model);
  SessionOptions so;
  so.n_ctx = 64;
  Session s(model, cpu, so);
  s.eval(test::prompt_ids(20, hp.n_vocab));
  CHECK(s.kv_store()->has_tier(KvTier::kHost));
  const auto r = s.migrate(gpu);
  CHECK(r.pages == 2);
  REQUIRE(s.kv_store()->has_tier(KvTier::kDevice));
  CHECK(s.kv().pages_outside(KvTier::kDevice) == 0);
  const int32_t next = test::argmax(s.logits());
  s.eval(std::span<const int32_t>(&next, 1));  // decodes on the Device pages
  CHECK(s.kv_store()->usage(KvTier::kDevice).used == 2);
}
#endif
