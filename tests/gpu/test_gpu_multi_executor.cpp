// Several GPU executors in one process (run with CUEMU_DEVICES=2 under cuemu to use two
// devices): one weight upload per (model, device), the caller's current device restored by
// every call, and two executors on one device stepping concurrently from two threads (the
// attention kernels' shared-memory attribute is set once per device, not per launch, so
// they cannot race) with the logits of a solo run, bit for bit.
#include <catch2/catch.hpp>

#include <thread>
#include <vector>

#include "gpu_test_support.hpp"
#include "hooks/gpu_hooks.hpp"
#include "kv_test_support.hpp"

using namespace tandem;

TEST_CASE("GPU executors share weights per device and restore the caller's device", "[gpu][multi-executor]") {
#if TANDEM_HAVE_CUDA
  auto model = Model::load(test::model_path("synth-qwen2-small-q4_0"));
  const int n_dev = GpuQ4Executor::device_count();
  const int last = n_dev - 1;
  INFO(n_dev << " device(s)");
  gpu_testing::set_current_device(last);
  GpuQ4Executor a(model, GpuExecutorOptions{0});
  CHECK(gpu_testing::current_device() == last);
  GpuQ4Executor b(model, GpuExecutorOptions{0});
  CHECK(a.weights_id() == b.weights_id());
  CHECK(a.weight_bytes() == b.weight_bytes());
  auto other_model = Model::load(test::model_path("synth-qwen2-small-q4_0"));
  GpuQ4Executor c(other_model, GpuExecutorOptions{0});
  CHECK(c.weights_id() != a.weights_id());  // another Model object: its own upload
  if (n_dev >= 2) {
    GpuQ4Executor d(model, GpuExecutorOptions{1});
    CHECK(d.weights_id() != a.weights_id());
    CHECK(d.weight_bytes() == a.weight_bytes());
    gpu_testing::set_current_device(0);
    auto store = test::gpu_kv_store(d, 4);
    CHECK(gpu_testing::current_device() == 0);
    gpu_testing::set_current_device(last);
  }
  auto store = test::gpu_kv_store(a, 8);
  CHECK(gpu_testing::current_device() == last);
  SessionOptions so;
  so.kv_store = store;
  so.kv_tier = KvTier::kDevice;
  so.n_ctx = 64;
  Session s(model, a, so);
  s.eval(test::prompt_ids(9, model->hparams().n_vocab));
  CHECK(gpu_testing::current_device() == last);
#endif
}

TEST_CASE("two GPU executors on one device step concurrently with the solo logits", "[gpu][multi-executor]") {
#if TANDEM_HAVE_CUDA
  auto model = Model::load(test::model_path("synth-qwen2-small-q4_0"));
  const int32_t n_vocab = model->hparams().n_vocab;
  const auto ids = test::prompt_ids(40, n_vocab);
  // The prompt then 6 greedy steps. The stores are made and destroyed on this thread: cuemu
  // cannot have a stream destroyed while another thread drains every stream (cudaFreeHost),
  // which CUDA allows (see the emulator note in the issue).
  auto run = [&](GpuQ4Executor& ex, const std::shared_ptr<KvStore>& store, std::vector<float>& out) {
    SessionOptions so;
    so.kv_store = store;
    so.kv_tier = KvTier::kDevice;
    so.n_ctx = 64;
    Session s(model, ex, so);
    s.eval(ids);
    for (int i = 0; i < 6; ++i) {
      const int32_t next = test::argmax(s.logits());
      s.eval(std::span<const int32_t>(&next, 1));
    }
    out.assign(s.logits().begin(), s.logits().end());
  };
  std::vector<float> ref, la, lb;
  {
    GpuQ4Executor solo(model);
    run(solo, test::gpu_kv_store(solo, 8), ref);
  }
  GpuQ4Executor a(model), b(model);
  auto sa = test::gpu_kv_store(a, 8), sb = test::gpu_kv_store(b, 8);
  std::thread ta([&] { run(a, sa, la); });
  std::thread tb([&] { run(b, sb, lb); });
  ta.join();
  tb.join();
  REQUIRE(ref.size() == size_t(n_vocab));
  CHECK(la == ref);
  CHECK(lb == ref);
#endif
}
