// The per-token path does no heap allocation: after a warm-up, executor decode steps
// allocate nothing. Global operator new is replaced by a counting version for the
// whole test binary; the count is read only around the steps under test.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>

#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/exec/paced_executor.hpp"
#include "test_support.hpp"

namespace {
std::atomic<long> g_allocations{0};
}

// Every replaceable form is replaced, so memory from any of them is freed by its twin
// (ASan checks new/delete pairing).
namespace {
void* counted_alloc(std::size_t n, std::size_t align = 0) noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (n == 0) n = 1;
  if (align <= alignof(std::max_align_t)) return std::malloc(n);
  return std::aligned_alloc(align, (n + align - 1) / align * align);
}
}  // namespace

void* operator new(std::size_t n) {
  if (void* p = counted_alloc(n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) {
  if (void* p = counted_alloc(n)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  return counted_alloc(n);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return counted_alloc(n);
}
void* operator new(std::size_t n, std::align_val_t a) {
  if (void* p = counted_alloc(n, static_cast<std::size_t>(a))) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) {
  if (void* p = counted_alloc(n, static_cast<std::size_t>(a))) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete[](void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete(void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}

using namespace tandem;

TEST_CASE("decode steps do no heap allocation after warm-up", "[executor][alloc]") {
  const auto model_name = GENERATE(as<std::string>{}, "aidreams260K-q4_0", "synth-qwen3-hd64-small-q4_0");
  const auto dtype = GENERATE(KvDtype::kF16, KvDtype::kQ8_0);  // q8_0: quantised rows, dequantised tiles
  auto model = Model::load(test::model_path(model_name));
  CpuQ4Executor exec(model, CpuExecutorOptions{2});
  KvStoreOptions so;
  so.layout = KvLayout::for_model(model->hparams(), 16, dtype);
  so.host_pages = 8;
  KvStore store(std::move(so));
  KvSequence kv(store, 128);
  std::vector<float> logits(static_cast<size_t>(model->hparams().n_vocab));
  int32_t id = 1;
  auto step = [&] {
    SequenceStep st{&kv, std::span<const int32_t>(&id, 1), kv.n_tokens(), LogitsRows::kLast};
    exec.step(std::span<const SequenceStep>(&st, 1), logits);
    id = 3 + kv.n_tokens() % 100;
  };
  for (int i = 0; i < 40; ++i) step();  // warm-up: scratch grows to its steady size
  const long before = g_allocations.load();
  for (int i = 0; i < 40; ++i) step();
  CHECK(g_allocations.load() - before == 0);
}

TEST_CASE("paced decode steps do no heap allocation after warm-up", "[executor][alloc][paced]") {
  auto model = Model::load(test::model_path("aidreams260K-q4_0"));
  CpuQ4Executor inner(model, CpuExecutorOptions{1});
  // 27B-class on an H200, time compressed 1000x: ~10 us of sleep per step.
  PacedExecutor exec(
      inner, PerfModel(processor_profile("h200"), ModelProfile::from_shape(model_shape("qwen-27b-class"))), 1000.0);
  KvStoreOptions so;
  so.layout = KvLayout::for_model(model->hparams());
  so.host_pages = 8;
  KvStore store(std::move(so));
  KvSequence kv(store, 128);
  std::vector<float> logits(static_cast<size_t>(model->hparams().n_vocab));
  int32_t id = 1;
  auto step = [&] {
    SequenceStep st{&kv, std::span<const int32_t>(&id, 1), kv.n_tokens(), LogitsRows::kLast};
    exec.step(std::span<const SequenceStep>(&st, 1), logits);
    id = 3 + kv.n_tokens() % 100;
  };
  for (int i = 0; i < 40; ++i) step();
  const long before = g_allocations.load();
  for (int i = 0; i < 40; ++i) step();
  CHECK(g_allocations.load() - before == 0);
  CHECK(exec.steps() == 80);
}
