// GpuQ4Executor host code: weight upload, the Device-tier KV backend, per-step staging and
// the layer loop that enqueues the kernels of kernels/cuda on the compute stream.
// Compiled by the host compiler into tandem_core (CUDA builds only). Its test harnesses live
// in tests/gpu/hooks (the tandem_gpu_test_hooks target), over exec/gpu/gpu_internal.hpp.
#include "tandem/exec/gpu/gpu_q4_executor.hpp"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <initializer_list>
#include <map>
#include <mutex>
#include <type_traits>
#include <vector>

#include "cpu/cpu_kernels.hpp"
#include "cuda/cuda_kernels.hpp"
#include "exec/gpu/gpu_internal.hpp"
#include "exec/transformer.hpp"

namespace tandem {

namespace ck = kernels::cuda;

namespace gpu_detail {

void cuda_check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();  // clear a non-sticky error so the next call starts clean
  throw Error(e == cudaErrorMemoryAllocation ? ErrorCode::kOutOfMemory : ErrorCode::kInternal,
              fmt::format("CUDA: {} failed: {} ({})", what, cudaGetErrorString(e), cudaGetErrorName(e)));
}

bool gpu_quant_type(GgmlType type, ck::WType& out) noexcept {
  switch (type) {
    case GgmlType::kQ4_0:
      out = ck::WType::kQ4_0;
      return true;
    case GgmlType::kQ8_0:
      out = ck::WType::kQ8_0;
      return true;
    case GgmlType::kQ4_1:
      out = ck::WType::kQ4_1;
      return true;
    case GgmlType::kQ5_0:
      out = ck::WType::kQ5_0;
      return true;
    case GgmlType::kQ5_1:
      out = ck::WType::kQ5_1;
      return true;
    case GgmlType::kQ4_K:
      out = ck::WType::kQ4_K;
      return true;
    case GgmlType::kQ5_K:
      out = ck::WType::kQ5_K;
      return true;
    case GgmlType::kQ6_K:
      out = ck::WType::kQ6_K;
      return true;
    default:
      return false;
  }
}

namespace {

// Sub-block j (0..7) of a K-quant block: the low four bits of its 32 values (at(kb, e): the
// value of element e of the block) in Q4_0's order, byte i = element i low, 16 + i high.
template <class KB, class At>
void split_k_block(const KB& kb, int j, uint8_t* qs, At at) {
  for (int e = 0; e < kernels::kQK / 2; ++e) {
    qs[e] = static_cast<uint8_t>((at(kb, kernels::kQK * j + e) & 0x0F) |
                                 (at(kb, kernels::kQK * j + kernels::kQK / 2 + e) & 0x0F) << 4);
  }
}

// Rows of K-quant blocks (k % 256 == 0) into the device layout: see block_math.cuh.
template <class KB>
void split_k_rows(const std::byte* data, int64_t rows, int64_t k, size_t row_bytes, SplitBlocks& s) {
  const size_t nb = size_t(k) / kernels::kQK, count = size_t(rows) * nb;
  constexpr bool q6 = std::is_same_v<KB, kernels::BlockQ6_K>, q5 = std::is_same_v<KB, kernels::BlockQ5_K>;
  s.qs.resize(count * kernels::kQK / 2);
  s.d.resize(count / 8);
  s.sc.resize(count);
  if (!q6) s.m.resize(count / 8);
  if (q6 || q5) s.qh.resize(q6 ? 2 * count : count);
  for (size_t r = 0; r < size_t(rows); ++r) {
    for (size_t sb = 0; sb < nb / 8; ++sb) {
      KB kb;
      std::memcpy(&kb, data + r * row_bytes + sb * sizeof(KB), sizeof(KB));
      const size_t i0 = r * nb + sb * 8;
      s.d[i0 / 8] = kb.d;
      if constexpr (!q6) s.m[i0 / 8] = kb.dmin;
      for (int j = 0; j < 8; ++j) {
        const size_t i = i0 + size_t(j);
        uint8_t* qs = &s.qs[i * kernels::kQK / 2];
        if constexpr (q6) {
          split_k_block(kb, j, qs, [](const KB& b, int e) { return kernels::q6k_at(b, e) + 32; });
          for (int e = 0; e < kernels::kQK; ++e) {
            const auto top = static_cast<uint32_t>(kernels::q6k_at(kb, kernels::kQK * j + e) + 32) >> 4;
            s.qh[2 * i + size_t(e / 16)] |= top << (2 * (e % 16));
          }
          s.sc[i] = static_cast<uint16_t>(static_cast<uint8_t>(kb.scales[2 * j]) |
                                          static_cast<uint8_t>(kb.scales[2 * j + 1]) << 8);
        } else {
          int sc = 0, mn = 0;
          kernels::k4_scale_min(kb.scales, j, sc, mn);
          s.sc[i] = static_cast<uint16_t>(sc | mn << 8);
          if constexpr (q5) {
            split_k_block(kb, j, qs, [](const KB& b, int e) { return kernels::q5k_at(b, e); });
            for (int e = 0; e < kernels::kQK; ++e) {
              s.qh[i] |= static_cast<uint32_t>(kernels::q5k_at(kb, kernels::kQK * j + e) >> 4) << e;
            }
          } else {
            split_k_block(kb, j, qs, [](const KB& b, int e) { return kernels::q4k_at(b, e); });
          }
        }
      }
    }
  }
}

}  // namespace

SplitBlocks split_blocks(ck::WType type, const std::byte* data, int64_t rows, int64_t k, size_t row_bytes) {
  const bool kquant = type == ck::WType::kQ4_K || type == ck::WType::kQ5_K || type == ck::WType::kQ6_K;
  const int64_t block = kquant ? kernels::kQK_K : kernels::kQK;
  if (k <= 0 || k % block != 0 || rows < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("GPU executor: {} rows of {} elements do not split into blocks of {}", rows, k, block));
  }
  SplitBlocks s;
  size_t qbytes = kernels::kQK / 2, bbytes = 0, qs_at = sizeof(uint16_t), m_at = 0, qh_at = 0;
  switch (type) {
    case ck::WType::kQ4_0:
      bbytes = sizeof(kernels::BlockQ4_0);
      break;
    case ck::WType::kQ8_0:
      bbytes = sizeof(kernels::BlockQ8_0), qbytes = kernels::kQK;
      break;
    case ck::WType::kQ4_1:
      bbytes = sizeof(kernels::BlockQ4_1), qs_at = offsetof(kernels::BlockQ4_1, qs);
      m_at = offsetof(kernels::BlockQ4_1, m);
      break;
    case ck::WType::kQ5_0:
      bbytes = sizeof(kernels::BlockQ5_0), qs_at = offsetof(kernels::BlockQ5_0, qs);
      qh_at = offsetof(kernels::BlockQ5_0, qh);
      break;
    case ck::WType::kQ5_1:
      bbytes = sizeof(kernels::BlockQ5_1), qs_at = offsetof(kernels::BlockQ5_1, qs);
      m_at = offsetof(kernels::BlockQ5_1, m), qh_at = offsetof(kernels::BlockQ5_1, qh);
      break;
    case ck::WType::kQ4_K:
      split_k_rows<kernels::BlockQ4_K>(data, rows, k, row_bytes, s);
      return s;
    case ck::WType::kQ5_K:
      split_k_rows<kernels::BlockQ5_K>(data, rows, k, row_bytes, s);
      return s;
    case ck::WType::kQ6_K:
      split_k_rows<kernels::BlockQ6_K>(data, rows, k, row_bytes, s);
      return s;
    case ck::WType::kF32:
    case ck::WType::kF16:
    case ck::WType::kBF16:
      throw Error(ErrorCode::kInvalidArgument, "GPU executor: float weights have no block layout");
  }
  const size_t nb = size_t(k) / kernels::kQK, count = size_t(rows) * nb;
  s.qs.resize(count * qbytes);
  s.d.resize(count);
  if (m_at != 0) s.m.resize(count);
  if (qh_at != 0) s.qh.resize(count);
  for (size_t r = 0; r < size_t(rows); ++r) {
    for (size_t b = 0; b < nb; ++b) {
      const std::byte* blk = data + r * row_bytes + b * bbytes;
      const size_t i = r * nb + b;
      std::memcpy(&s.d[i], blk, sizeof(uint16_t));
      std::memcpy(&s.qs[i * qbytes], blk + qs_at, qbytes);
      if (m_at != 0) std::memcpy(&s.m[i], blk + m_at, sizeof(uint16_t));
      if (qh_at != 0) std::memcpy(&s.qh[i], blk + qh_at, sizeof(uint32_t));
    }
  }
  return s;
}

}  // namespace gpu_detail

using gpu_detail::attention_setup_once;
using gpu_detail::DevBuf;
using gpu_detail::DeviceGuard;

namespace {

// Decode attention through the split-KV kernels (kernels/cuda attention_split); false
// routes every token through attention().
constexpr bool kSplitDecodeAttention = true;

// Pinned host memory, grown on demand (contents not kept).
class PinnedBuf {
 public:
  PinnedBuf() = default;
  ~PinnedBuf() { reset(); }
  PinnedBuf(const PinnedBuf&) = delete;
  PinnedBuf& operator=(const PinnedBuf&) = delete;
  void* get(size_t bytes) {
    if (bytes_ < bytes) {
      reset();
      TANDEM_CUDA(cudaMallocHost(&p_, bytes));
      bytes_ = bytes;
    }
    return p_;
  }
  void reset() noexcept {
    if (p_) cudaFreeHost(p_);
    p_ = nullptr, bytes_ = 0;
  }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

class Stream {
 public:
  Stream() { TANDEM_CUDA(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~Stream() {
    if (s_) cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const noexcept { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// ---- the Device tier --------------------------------------------------------------------

class GpuKvBackend final : public KvDeviceBackend {
 public:
  /// The caller makes `device` current (the stream member is created on it).
  GpuKvBackend(int device, size_t page_bytes, int32_t pages) : device_(device), page_bytes_(page_bytes), pages_(pages) {
    if (pages < 0) throw Error(ErrorCode::kInvalidArgument, "GPU KV backend: negative page count");
    try {
      mem_.alloc(page_bytes * size_t(pages));
    } catch (const Error&) {
      throw Error(ErrorCode::kOutOfMemory,
                  fmt::format("GPU KV backend: {} pages of {} bytes do not fit in device {}'s memory", pages,
                              page_bytes, device));
    }
    staging_bytes_ = std::min<size_t>(page_bytes, size_t(8) << 20);
    staging_.get(staging_bytes_);
  }
  ~GpuKvBackend() override { (void)cudaStreamSynchronize(stream_.get()); }

  int32_t capacity_pages() const noexcept override { return pages_; }

  void copy_to_device(int32_t slot, const std::byte* src, size_t bytes) override {
    check(slot, bytes);
    const DeviceGuard guard(device_);
    std::byte* dst = slot_ptr(slot);
    auto* stage = static_cast<std::byte*>(staging_.get(staging_bytes_));
    for (size_t off = 0; off < bytes; off += staging_bytes_) {
      const size_t n = std::min(staging_bytes_, bytes - off);
      std::memcpy(stage, src + off, n);
      TANDEM_CUDA(cudaMemcpyAsync(dst + off, stage, n, cudaMemcpyHostToDevice, stream_.get()));
      TANDEM_CUDA(cudaStreamSynchronize(stream_.get()));  // the staging buffer is reused next
    }
  }

  void copy_to_host(int32_t slot, std::byte* dst, size_t bytes) override {
    check(slot, bytes);
    const DeviceGuard guard(device_);
    const std::byte* src = slot_ptr(slot);
    auto* stage = static_cast<std::byte*>(staging_.get(staging_bytes_));
    for (size_t off = 0; off < bytes; off += staging_bytes_) {
      const size_t n = std::min(staging_bytes_, bytes - off);
      TANDEM_CUDA(cudaMemcpyAsync(stage, src + off, n, cudaMemcpyDeviceToHost, stream_.get()));
      TANDEM_CUDA(cudaStreamSynchronize(stream_.get()));
      std::memcpy(dst + off, stage, n);
    }
  }

  void copy_device_to_device(int32_t dst_slot, int32_t src_slot, size_t bytes) override {
    check(dst_slot, bytes);
    check(src_slot, bytes);
    const DeviceGuard guard(device_);
    TANDEM_CUDA(
        cudaMemcpyAsync(slot_ptr(dst_slot), slot_ptr(src_slot), bytes, cudaMemcpyDeviceToDevice, stream_.get()));
    TANDEM_CUDA(cudaStreamSynchronize(stream_.get()));
  }

  std::byte* slot_ptr(int32_t slot) const noexcept { return mem_.as<std::byte>() + size_t(slot) * page_bytes_; }
  int device() const noexcept { return device_; }

 private:
  void check(int32_t slot, size_t bytes) const {
    if (slot < 0 || slot >= pages_ || bytes > page_bytes_) {
      throw Error(ErrorCode::kInternal, fmt::format("GPU KV backend: slot {} / {} bytes outside {} pages of {} bytes",
                                                    slot, bytes, pages_, page_bytes_));
    }
  }

  int device_;
  size_t page_bytes_;
  int32_t pages_;
  DevBuf mem_;
  Stream stream_;
  PinnedBuf staging_;
  size_t staging_bytes_ = 0;
};

// ---- weights ----------------------------------------------------------------------------

struct DevLayer {
  const float *attn_norm = nullptr, *ffn_norm = nullptr;
  const float *bq = nullptr, *bk = nullptr, *bv = nullptr;
  const float *q_norm = nullptr, *k_norm = nullptr;
  const float *attn_post_norm = nullptr, *ffn_post_norm = nullptr;  // gemma3
  ck::DevWeight wq, wk, wv, wo, gate, up, down;
};

// ---- weights, one upload per (model, device) ---------------------------------------------

// A model's weights in one device's memory, shared by every executor of that model on that
// device (device_weights()). Immutable after construction.
struct DeviceWeights {
  int device = 0;
  std::vector<DevBuf> mem;
  uint64_t bytes = 0;
  std::vector<DevLayer> layers;
  const float* output_norm = nullptr;
  ck::DevWeight output;
  const uint16_t* gelu_table = nullptr;  // kernels::gelu_f16_table() (GELU-gated FFN only)

  // The caller makes `device` current.
  DeviceWeights(const Model& m, int dev) : device(dev) {
    for (const LayerWeights& L : m.layers()) {
      DevLayer d;
      d.attn_norm = upload_f32(L.attn_norm, "attn_norm");
      d.ffn_norm = upload_f32(L.ffn_norm, "ffn_norm");
      d.bq = upload_f32(L.bq, "attn_q.bias");
      d.bk = upload_f32(L.bk, "attn_k.bias");
      d.bv = upload_f32(L.bv, "attn_v.bias");
      d.q_norm = upload_f32(L.q_norm, "attn_q_norm");
      d.k_norm = upload_f32(L.k_norm, "attn_k_norm");
      d.attn_post_norm = upload_f32(L.attn_post_norm, "post_attention_norm");
      d.ffn_post_norm = upload_f32(L.ffn_post_norm, "post_ffw_norm");
      d.wq = upload_matrix(L.wq);
      d.wk = upload_matrix(L.wk);
      d.wv = upload_matrix(L.wv);
      d.wo = upload_matrix(L.wo);
      d.gate = upload_matrix(L.ffn_gate);
      d.up = upload_matrix(L.ffn_up);
      d.down = upload_matrix(L.ffn_down);
      layers.push_back(d);
    }
    output_norm = upload_f32(m.output_norm(), "output_norm");
    output = upload_matrix(m.output());
    if (m.hparams().gelu_ffn) {
      gelu_table = static_cast<const uint16_t*>(
          upload_bytes(kernels::gelu_f16_table(), size_t(ck::kGeluTableSize) * sizeof(uint16_t)));
    }
  }

  const void* upload_bytes(const void* src, size_t n) {
    mem.emplace_back(n);
    TANDEM_CUDA(cudaMemcpy(mem.back().as<void>(), src, n, cudaMemcpyHostToDevice));
    bytes += n;
    return mem.back().as<void>();
  }
  template <class T>
  const T* upload_vector(const std::vector<T>& v) {
    return v.empty() ? nullptr : static_cast<const T*>(upload_bytes(v.data(), v.size() * sizeof(T)));
  }

  const float* upload_f32(const TensorView& t, const char* what) {
    if (!t) return nullptr;
    if (t.type != GgmlType::kF32) {
      throw Error(ErrorCode::kModelBadTensorShape,
                  fmt::format("GPU executor: {} must be F32, found {}", what, ggml_type_name(t.type)));
    }
    return static_cast<const float*>(upload_bytes(t.data, t.row_bytes * size_t(t.n)));
  }

  // Quantised weights: the device layout of split_blocks (a pure rearrangement).
  ck::DevWeight upload_quant(const TensorView& t, ck::WType type) {
    const gpu_detail::SplitBlocks s = gpu_detail::split_blocks(type, t.data, t.n, t.k, t.row_bytes);
    ck::DevWeight w;
    w.type = type;
    w.n = t.n;
    w.k = t.k;
    w.q = upload_vector(s.qs);
    w.d = upload_vector(s.d);
    w.m = upload_vector(s.m);
    w.qh = upload_vector(s.qh);
    w.sc = upload_vector(s.sc);
    return w;
  }

  // Quantised weights through upload_quant, float weights as they are. Model::load leaves
  // only types with a kernel (it converts the others); any other type is refused.
  ck::DevWeight upload_matrix(const TensorView& t) {
    ck::DevWeight w;
    w.n = t.n;
    w.k = t.k;
    const size_t n = size_t(t.n);
    if (ck::WType q; gpu_detail::gpu_quant_type(t.type, q)) return upload_quant(t, q);
    switch (t.type) {
      case GgmlType::kF32:
        w.type = ck::WType::kF32;
        w.q = upload_bytes(t.data, t.row_bytes * n);
        break;
      case GgmlType::kF16:
        w.type = ck::WType::kF16;
        w.q = upload_bytes(t.data, t.row_bytes * n);
        break;
      case GgmlType::kBF16:
        w.type = ck::WType::kBF16;
        w.q = upload_bytes(t.data, t.row_bytes * n);
        break;
      default:
        throw Error(ErrorCode::kModelBadTensorShape,
                    fmt::format("GPU executor: no kernel for {} weights", ggml_type_name(t.type)));
    }
    return w;
  }
};

// Process-wide state per device, set up once under a mutex (executor construction only,
// never on the per-token path): the attention kernels' shared-memory attribute (global per
// function and device, so it is set once to the device's opt-in maximum and checked,
// instead of before each launch where two executors would race), and the weights of each
// model on it (weak: freed with the last executor using them).
struct DeviceRegistry {
  std::mutex mu;
  std::map<int, int32_t> score_capacity;  // device -> attention score capacity
  std::map<std::pair<const Model*, int>, std::weak_ptr<const DeviceWeights>> weights;
};

DeviceRegistry& registry() {
  static DeviceRegistry r;
  return r;
}

}  // namespace

int32_t gpu_detail::attention_setup_once(int device) {
  DeviceRegistry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  if (auto it = r.score_capacity.find(device); it != r.score_capacity.end()) return it->second;
  int32_t cap = 0;
  TANDEM_CUDA(ck::attention_setup(device, &cap));
  r.score_capacity[device] = cap;
  return cap;
}

namespace {

// The caller makes `device` current. Holding the model keeps the key's address valid.
std::shared_ptr<const DeviceWeights> device_weights(const std::shared_ptr<const Model>& model, int device) {
  DeviceRegistry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  auto& slot = r.weights[{model.get(), device}];
  if (auto w = slot.lock()) return w;
  std::shared_ptr<const DeviceWeights> w(new DeviceWeights(*model, device),
                                         [model](const DeviceWeights* p) { delete p; });
  slot = w;
  return w;
}

}  // namespace

// ---- the executor -------------------------------------------------------------------------

struct GpuQ4Executor::Impl {
  int device = 0;
  std::shared_ptr<const DeviceWeights> weights;
  int32_t score_capacity = 0;
  Stream stream;

  // Per-step device buffers (grow by doubling, never shrink; outgrown ones in `retired`).
  DevBuf x, xn, q, k, v, attn, gate, up, xq, xd, rope, rope_swa, pages, page_off, pos, out_row, rows, logits, stage;
  DevBuf attn_tokens, split_acc, split_max, split_score;  // attention token lists, flash-decoding partials
  std::vector<DevBuf> retired;
  // Per-step host buffers.
  PinnedBuf h_x, h_rope, h_rope_swa, h_pages, h_page_off, h_pos, h_out_row, h_logits, h_attn_tokens;
  // The decode step as a CUDA graph (GpuExecutorOptions::cuda_graphs).
  bool use_graphs = true;
  bool fused = true;          // GpuExecutorOptions::fused_kernels
  bool tensor_cores = true;   // GpuExecutorOptions::tensor_cores
  bool flash_prefill = true;  // GpuExecutorOptions::flash_prefill
  bool merge_matmuls = true;  // GpuExecutorOptions::merge_matmuls
  cudaGraphExec_t graph_exec = nullptr;
  int64_t graph_instantiations = 0;
  struct StagedPage {
    std::byte* host;
    std::byte* dev;
  };
  std::vector<StagedPage> write_back;

  // The caller makes `dev` current (the stream is created on it).
  Impl(const std::shared_ptr<const Model>& model, int dev, const GpuExecutorOptions& o)
      : device(dev),
        weights(device_weights(model, dev)),
        score_capacity(attention_setup_once(dev)),
        use_graphs(o.cuda_graphs),
        fused(o.fused_kernels),
        tensor_cores(o.tensor_cores),
        flash_prefill(o.flash_prefill),
        merge_matmuls(o.merge_matmuls) {}
  ~Impl() {
    (void)cudaStreamSynchronize(stream.get());
    if (graph_exec) (void)cudaGraphExecDestroy(graph_exec);
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  template <class T>
  T* scratch(DevBuf& b, size_t n) {
    return static_cast<T*>(b.grow(std::max<size_t>(n, 1) * sizeof(T), retired));
  }
};

namespace {

// Stream capture of one step (inactive for a null stream). launch() ends the capture and
// runs the graph through the executor's executable graph: updated in place when the
// topology is unchanged, else instantiated anew. On an exception before launch() the
// destructor ends the capture and drops the graph, so the stream is usable again.
class StepCapture {
 public:
  explicit StepCapture(cudaStream_t s) : s_(s) {
    if (s_) TANDEM_CUDA(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
  }
  ~StepCapture() {
    if (!s_) return;
    cudaGraph_t g = nullptr;
    (void)cudaStreamEndCapture(s_, &g);
    if (g) (void)cudaGraphDestroy(g);
    (void)cudaGetLastError();
  }
  StepCapture(const StepCapture&) = delete;
  StepCapture& operator=(const StepCapture&) = delete;

  void launch(GpuQ4Executor::Impl& im) {
    if (!s_) return;
    cudaGraph_t g = nullptr;
    const cudaStream_t s = s_;
    s_ = nullptr;  // the capture is over, whatever happens next
    TANDEM_CUDA(cudaStreamEndCapture(s, &g));
    struct GraphOwner {
      cudaGraph_t g;
      ~GraphOwner() { (void)cudaGraphDestroy(g); }
    } owner{g};
    if (im.graph_exec) {
      cudaGraphExecUpdateResultInfo info{};
      if (cudaGraphExecUpdate(im.graph_exec, g, &info) != cudaSuccess) {
        (void)cudaGetLastError();  // a changed topology: instantiate anew
        (void)cudaGraphExecDestroy(im.graph_exec);
        im.graph_exec = nullptr;
      }
    }
    if (!im.graph_exec) {
      TANDEM_CUDA(cudaGraphInstantiate(&im.graph_exec, g, 0));
      ++im.graph_instantiations;
    }
    TANDEM_CUDA(cudaGraphLaunch(im.graph_exec, s));
  }

 private:
  cudaStream_t s_;
};

template <class T>
T* pinned(PinnedBuf& b, size_t n) {
  return static_cast<T*>(b.get(std::max<size_t>(n, 1) * sizeof(T)));
}

// The GPU's primitives of the decoder (exec/transformer.hpp), launched on one stream over a
// step's device buffers. Its fusions stay here: an RMSNorm makes its quantised matmuls' Q8_0
// input in the same launch, the activation makes W_down's, decode attention makes Wo's, RoPE
// and the K/V store are one kernel, and matrices sharing an input are one launch.
struct GpuDecoder {
  GpuQ4Executor::Impl& im;
  cudaStream_t st;
  const HParams& hp;
  int64_t T = 0, n_out = 0;
  float *x = nullptr, *xn = nullptr, *q = nullptr, *kk = nullptr, *v = nullptr, *attn = nullptr, *gate = nullptr,
        *up = nullptr, *rope = nullptr, *rope_swa = nullptr, *rows = nullptr, *logits_dev = nullptr;
  int8_t* xq = nullptr;             // the Q8_0 input of the next quantised matmul: quants ...
  uint16_t* xd = nullptr;           // ... and f16 block scales
  const float* prepared = nullptr;  // the input xq/xd hold, null for none
  const KvLayout* layout = nullptr;
  void** pages = nullptr;  // [n_groups][n_pages] (KvLayout::place)
  size_t n_pages = 0;
  ck::KvArgs kv;
  // Attention routing (step_impl): attn_tokens lists the decode tokens (n_dec, split-KV),
  // then attention()'s (up to n_listed), and from index T the prefill tiles (n_tiles).
  int32_t* attn_tokens = nullptr;
  int64_t n_dec = 0, n_listed = 0, n_tiles = 0;
  int32_t max_pos = 1;
  ck::AttentionSplitScratch split;
  int32_t* out_row = nullptr;  // [n_out] the token row of each logits row

  const DevLayer& weights(const LayerPlan& l) const { return im.weights->layers[size_t(l.il)]; }

  // y = W x (or y += W x), quantising x to Q8_0 first when W is quantised and x is not prepared.
  void matmul(const ck::DevWeight& w, const float* in, int64_t m, float* out, bool accumulate) {
    if (w.quantized() && prepared != in) {
      ck::quantize_q8_0(in, m, w.k, xq, xd, st);
      prepared = in;
    }
    ck::gemm(w, in, xq, xd, m, out, w.n, accumulate, st, im.tensor_cores);
  }
  // out_i = W_i in (+ bias_i, when given) for matrices sharing the input (Q, K, V; gate, up):
  // one launch, biases included, where gemm_parts can merge them (GpuExecutorOptions::
  // merge_matmuls), else matmul() and add_bias() each.
  void matmuls(std::initializer_list<const ck::DevWeight*> ws, const float* in, int64_t m,
               std::initializer_list<float*> outs, std::initializer_list<const float*> bias) {
    const size_t count = ws.size();
    if (!im.merge_matmuls) {
      for (size_t i = 0; i < count; ++i) {
        matmul(*ws.begin()[i], in, m, outs.begin()[i], false);
        if (bias.size() == count && bias.begin()[i] != nullptr) {
          ck::add_bias(outs.begin()[i], bias.begin()[i], m, ws.begin()[i]->n, st);
        }
      }
      return;
    }
    const bool quant = std::any_of(ws.begin(), ws.end(), [](const ck::DevWeight* w) { return w->quantized(); });
    if (quant && prepared != in) {
      ck::quantize_q8_0(in, m, (*ws.begin())->k, xq, xd, st);
      prepared = in;
    }
    ck::gemm_parts(ws.begin(), outs.begin(), bias.size() == count ? bias.begin() : nullptr, static_cast<int>(count), in,
                   xq, xd, m, false, st, im.tensor_cores);
  }
  // RMSNorm of x rows into `out` for the matmuls in `users`: with fused kernels and a
  // quantised user, the Q8_0 input is made in the same launch (the result as rms_norm then
  // quantize_q8_0, bit for bit) and marked prepared.
  void norm(const float* in, const float* weight, float* out, int64_t m, const int32_t* gather,
            std::initializer_list<const ck::DevWeight*> users) {
    const bool quant = std::any_of(users.begin(), users.end(), [](const ck::DevWeight* u) { return u->quantized(); });
    if (im.fused && quant) {
      ck::rms_norm_q8_0(in, weight, out, xq, xd, m, hp.n_embd, hp.rms_eps, gather, st);
      prepared = out;
    } else {
      ck::rms_norm(in, weight, out, m, hp.n_embd, hp.rms_eps, gather, st);
      prepared = nullptr;
    }
  }

  // The KV arguments of layer l: its group's page table, its slot in the pages, its window.
  void set_layer_kv(const LayerPlan& l) {
    const KvLayout::Place place = layout->place(l.il);
    kv.pages = pages + size_t(place.group) * n_pages;
    kv.layer = place.slot;
    kv.window = l.window;
  }

  void input_norm(const LayerPlan& l, LayerHalf half) {
    const DevLayer& L = weights(l);
    if (half == LayerHalf::kAttention) {
      norm(x, L.attn_norm, xn, T, nullptr, {&L.wq, &L.wk, &L.wv});
    } else {
      norm(x, L.ffn_norm, xn, T, nullptr, {&L.gate, &L.up});
    }
  }

  void attention_inputs(const LayerPlan& l) {
    const DevLayer& L = weights(l);
    if (l.qkv_bias) {
      matmuls({&L.wq, &L.wk, &L.wv}, xn, T, {q, kk, v}, {L.bq, L.bk, L.bv});
    } else {
      matmuls({&L.wq, &L.wk, &L.wv}, xn, T, {q, kk, v}, {});
    }
    const int64_t hd = hp.head_dim;
    if (l.q_norm) ck::rms_norm(q, L.q_norm, q, T * hp.n_head, hd, hp.rms_eps, nullptr, st);
    if (l.k_norm) ck::rms_norm(kk, L.k_norm, kk, T * hp.n_head_kv, hd, hp.rms_eps, nullptr, st);
    set_layer_kv(l);
    const float* rope_l = l.swa ? rope_swa : rope;
    if (im.fused) {
      ck::rope_kv_store(kv, q, kk, v, rope_l, T, hp.n_head, hp.n_rot, l.neox, st);
    } else {
      ck::rope(q, rope_l, T, hp.n_head, hp.head_dim, hp.n_rot, l.neox, st);
      ck::rope(kk, rope_l, T, hp.n_head_kv, hp.head_dim, hp.n_rot, l.neox, st);
      ck::kv_store_rows(kv, kk, v, T, st);
    }
    if (l.q_scale != 1.0f) ck::scale(q, l.q_scale, T * int64_t{hp.n_head} * hd, st);
  }

  void attention(const LayerPlan& l) {
    const DevLayer& L = weights(l);
    set_layer_kv(l);
    // Every token decoding through the split kernels: their last launch also makes Wo's
    // Q8_0 input (the result of quantize_q8_0 on attn, bit for bit).
    const bool attn_q8 = im.fused && L.wo.quantized() && n_dec == T && hp.head_dim % kernels::kQK == 0;
    ck::attention_split(kv, q, attn, attn_tokens, n_dec, hp.n_head, l.kq_scale, max_pos, split, st,
                        attn_q8 ? xq : nullptr, attn_q8 ? xd : nullptr);
    ck::attention(kv, q, attn, n_listed - n_dec, hp.n_head, l.kq_scale, max_pos, im.score_capacity, st,
                  attn_tokens + n_dec);
    ck::attention_prefill(kv, q, attn, attn_tokens + T, n_tiles, hp.n_head, l.kq_scale, st);
    prepared = attn_q8 ? attn : nullptr;
  }

  // x += [post_norm](W in): with a post-norm (gemma3), W in into xn (free between the norms'
  // uses), normed in place, then added (the CPU's order); else accumulated by the matmul.
  void residual(const LayerPlan& l, LayerHalf half) {
    const DevLayer& L = weights(l);
    const bool attn_half = half == LayerHalf::kAttention;
    const ck::DevWeight& w = attn_half ? L.wo : L.down;
    const float* in = attn_half ? attn : gate;
    if (!(attn_half ? l.attn_post_norm : l.ffn_post_norm)) {
      matmul(w, in, T, x, true);
      return;
    }
    matmul(w, in, T, xn, false);
    ck::rms_norm(xn, attn_half ? L.attn_post_norm : L.ffn_post_norm, xn, T, hp.n_embd, hp.rms_eps, nullptr, st);
    ck::add(x, xn, T * hp.n_embd, st);
  }

  void ffn_inputs(const LayerPlan& l) {
    const DevLayer& L = weights(l);
    matmuls({&L.gate, &L.up}, xn, T, {gate, up}, {});
  }

  void activation(const LayerPlan& l) {
    const DevLayer& L = weights(l);
    const int64_t n = T * hp.n_ff;
    const uint16_t* gelu_table = l.gelu ? im.weights->gelu_table : nullptr;
    if (im.fused && L.down.quantized()) {  // the down projection's Q8_0 input in the same launch
      if (gelu_table) {
        ck::geglu_q8_0(gate, up, n, gelu_table, xq, xd, st);
      } else {
        ck::swiglu_q8_0(gate, up, n, xq, xd, st);
      }
      prepared = gate;
    } else {
      if (gelu_table) {
        ck::geglu(gate, up, n, gelu_table, st);
      } else {
        ck::swiglu(gate, up, n, st);
      }
      prepared = nullptr;
    }
  }

  void logits(float softcap) {
    if (n_out == 0) return;
    norm(x, im.weights->output_norm, rows, n_out, out_row, {&im.weights->output});
    matmul(im.weights->output, rows, n_out, logits_dev, false);
    if (softcap > 0.0f) ck::softcap(logits_dev, n_out * hp.n_vocab, softcap, st);
  }
};

}  // namespace

int GpuQ4Executor::device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

GpuQ4Executor::GpuQ4Executor(std::shared_ptr<const Model> model, const GpuExecutorOptions& options)
    : Executor(std::move(model)) {
  const int n_dev = device_count();
  if (options.device < 0 || options.device >= n_dev) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("GPU executor: CUDA device {} requested, {} visible", options.device, n_dev));
  }
  const HParams& hp = this->model().hparams();
  if (hp.head_dim > 1024 || hp.head_dim < 1 || hp.n_rot > hp.head_dim) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("GPU executor: head_dim {} (n_rot {}) outside the kernels' range (1..1024)", hp.head_dim,
                            hp.n_rot));
  }
  const DeviceGuard guard(options.device);
  impl_ = std::make_unique<Impl>(model_ptr(), options.device, options);
}

GpuQ4Executor::~GpuQ4Executor() = default;

int64_t GpuQ4Executor::graph_instantiations() const noexcept {
  return impl_->graph_instantiations;
}

int GpuQ4Executor::device() const noexcept {
  return impl_->device;
}
uint64_t GpuQ4Executor::weight_bytes() const noexcept {
  return impl_->weights->bytes;
}
const void* GpuQ4Executor::weights_id() const noexcept {
  return impl_->weights.get();
}
void* GpuQ4Executor::stream() const noexcept {
  return impl_->stream.get();
}

uint64_t GpuQ4Executor::scratch_bytes() const noexcept {
  const Impl& im = *impl_;
  uint64_t b = 0;
  for (const DevBuf* d :
       {&im.x,    &im.xn,     &im.q,     &im.k,           &im.v,         &im.attn,      &im.gate,       &im.up,
        &im.xq,   &im.xd,     &im.rope,  &im.rope_swa,    &im.pages,     &im.page_off,  &im.pos,        &im.out_row,
        &im.rows, &im.logits, &im.stage, &im.attn_tokens, &im.split_acc, &im.split_max, &im.split_score}) {
    b += d->bytes();
  }
  for (const DevBuf& d : im.retired) b += d.bytes();
  return b;
}

std::unique_ptr<KvDeviceBackend> GpuQ4Executor::make_kv_device_backend(const KvLayout& layout, int32_t pages) const {
  if (!supports(layout.dtype)) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("gpu executor: {} KV pages are unsupported on the GPU (use f16 or f32, or a CPU executor)",
                            kv_dtype_name(layout.dtype)));
  }
  const DeviceGuard guard(impl_->device);  // the backend's stream is created on the current device
  return std::make_unique<GpuKvBackend>(impl_->device, layout.page_bytes(), pages);
}

void GpuQ4Executor::step_impl(std::span<const SequenceStep> batch, std::span<float> logits) {
  const Model& model = this->model();
  const HParams& hp = model.hparams();
  const int32_t n_vocab = hp.n_vocab;

  // The kernels take one page size and dtype per step: a batch mixing stores with
  // different layouts runs one sequence at a time.
  for (const auto& s : batch) {
    const KvLayout& l = s.kv->store().layout();
    const KvLayout& l0 = batch[0].kv->store().layout();
    if (l.page_size != l0.page_size || l.dtype != l0.dtype) {
      size_t row = 0;
      for (const auto& one : batch) {
        const auto sub = std::span<const SequenceStep>(&one, 1);
        const size_t rows = size_t(logits_rows(sub));
        step_impl(sub, logits.subspan(row * size_t(n_vocab), rows * size_t(n_vocab)));
        row += rows;
      }
      return;
    }
  }

  Impl& im = *impl_;
  const DeviceGuard guard(im.device);
  cudaStream_t st = im.stream.get();
  // Whatever happens below, nothing of this step is in flight when step_impl returns (the
  // pinned buffers are rewritten by the next step). A no-op after the final sync.
  struct DrainOnExit {
    cudaStream_t s;
    ~DrainOnExit() { (void)cudaStreamSynchronize(s); }
  } drain{st};
  const KvLayout& layout = batch[0].kv->store().layout();
  const int32_t P = layout.page_size;
  const size_t pb = layout.page_bytes();
  const int64_t n_embd = hp.n_embd, hd = hp.head_dim, n_ff = hp.n_ff;
  const int64_t q_w = int64_t{hp.n_head} * hd;
  const int64_t kv_w = int64_t{hp.n_head_kv} * hd;
  const int64_t max_k = std::max({n_embd, q_w, n_ff});

  GpuDecoder d{im, st, hp};
  d.layout = &layout;
  const int64_t T = d.T = step_token_rows(batch);
  const int64_t n_out = d.n_out = logits_rows(batch);
  for (const auto& s : batch) {
    const int32_t end = s.pos0 + static_cast<int32_t>(s.tokens.size());
    d.n_pages += size_t((end + P - 1) / P);
    d.max_pos = std::max(d.max_pos, end);
  }
  const size_t n_pages = d.n_pages;

  // ---- host side: token inputs, page table, staging of Host/File pages ----------------
  StepInputs in;
  in.pos = pinned<int32_t>(im.h_pos, size_t(T));
  in.out_row = pinned<int32_t>(im.h_out_row, size_t(n_out));
  in.x = pinned<float>(im.h_x, size_t(T * n_embd));
  in.rope = pinned<float>(im.h_rope, size_t(T * hp.n_rot));
  in.rope_swa = has_sliding_window(hp) ? pinned<float>(im.h_rope_swa, size_t(T * hp.n_rot)) : nullptr;
  fill_step_inputs(model, batch, in);
  // The page table: one per layer group (KvLayout::place), [group][n_pages]; a windowed
  // group's page out of the window is null (never read).
  const int32_t n_groups = layout.n_groups();
  auto* h_pages = pinned<void*>(im.h_pages, size_t(n_groups) * n_pages);
  auto* h_page_off = pinned<int32_t>(im.h_page_off, size_t(T));
  // Attention routing: with kSplitDecodeAttention, the single token of a sequence's step
  // (decode) goes through split-KV attention (attention_split) when its shared-memory tile
  // fits the default 48 KiB; the tokens of multi-token steps (prefill) through the tiled
  // flash-attention kernel (attention_prefill, GpuExecutorOptions::flash_prefill) when one
  // tile fits, else through attention(). h_attn_tokens: the token list, decode first, then
  // attention()'s; from index T, the prefill tiles as (first token, count) pairs.
  auto* h_attn_tokens = pinned<int32_t>(im.h_attn_tokens, size_t(3 * T));
  const int32_t group = hp.n_head / hp.n_head_kv;
  const bool split_fits = kSplitDecodeAttention &&
                          ck::attention_split_shmem(hp.head_dim, group, ck::kAttentionPartition) <= size_t(47) * 1024;
  const int32_t tile_q = im.flash_prefill ? ck::attention_prefill_plan(hp.head_dim, group).bq : 0;
  for (const auto& s : batch) {
    if (split_fits && s.tokens.size() == 1) ++d.n_dec;
  }
  {
    int64_t t = 0, di = 0, pi = 0;
    for (const auto& s : batch) {
      const bool dec = split_fits && s.tokens.size() == 1;
      const auto n = static_cast<int32_t>(s.tokens.size());
      if (!dec && tile_q > 0 && n > 1) {
        for (int32_t j = 0; j < n; j += tile_q, ++d.n_tiles) {
          h_attn_tokens[T + 2 * d.n_tiles] = static_cast<int32_t>(t + j);
          h_attn_tokens[T + 2 * d.n_tiles + 1] = std::min(tile_q, n - j);
        }
        t += n;
        continue;
      }
      for (int32_t j = 0; j < n; ++j, ++t) {
        h_attn_tokens[dec ? di++ : d.n_dec + pi++] = static_cast<int32_t>(t);
      }
    }
    d.n_listed = d.n_dec + pi;
  }

  size_t n_staged = 0;
  for (const auto& s : batch) {
    const int32_t end = s.pos0 + static_cast<int32_t>(s.tokens.size());
    for (int32_t g = 0; g < n_groups; ++g) {
      for (int32_t j = 0; j < (end + P - 1) / P; ++j) {
        const PageId pid = s.kv->page(g, j);
        if (pid != kNoPage && s.kv->store().tier_of(pid) != KvTier::kDevice) ++n_staged;
      }
    }
  }
  auto* stage = n_staged ? im.scratch<std::byte>(im.stage, n_staged * pb) : nullptr;
  im.write_back.clear();
  {
    size_t pi = 0, si = 0;
    int64_t t = 0;
    for (const auto& s : batch) {
      const KvStore& store = s.kv->store();
      const int32_t end = s.pos0 + static_cast<int32_t>(s.tokens.size());
      const auto page_base = static_cast<int32_t>(pi);
      const int32_t seq_pages = (end + P - 1) / P;
      for (int32_t gj = 0; gj < n_groups * seq_pages; ++gj) {
        const int32_t g = gj / seq_pages, j = gj % seq_pages;
        void** slot = h_pages + size_t(g) * n_pages + size_t(page_base + j);
        const PageId pid = s.kv->page(g, j);
        if (pid == kNoPage) {
          *slot = nullptr;
        } else if (store.tier_of(pid) == KvTier::kDevice) {
          const auto* backend = dynamic_cast<const GpuKvBackend*>(store.device_backend());
          if (!backend || backend->device() != im.device) {
            throw Error(ErrorCode::kInvalidArgument,
                        fmt::format("GPU executor: a Device KV page of sequence {} is not in a Device tier of "
                                    "CUDA device {} made by a GpuQ4Executor",
                                    s.kv->id(), im.device));
          }
          *slot = backend->slot_ptr(store.device_slot(pid));
        } else {
          std::byte* host = store.page_data(pid);
          std::byte* dst = stage + (si++) * pb;
          TANDEM_CUDA(cudaMemcpyAsync(dst, host, pb, cudaMemcpyHostToDevice, st));
          if (j >= s.pos0 / P) im.write_back.push_back({host, dst});
          *slot = dst;
        }
      }
      pi += size_t(seq_pages);
      for (size_t j = 0; j < s.tokens.size(); ++j) h_page_off[t++] = page_base;
    }
  }

  // ---- device buffers and uploads ----------------------------------------------------
  d.x = im.scratch<float>(im.x, size_t(T * n_embd));
  d.xn = im.scratch<float>(im.xn, size_t(T * n_embd));
  d.q = im.scratch<float>(im.q, size_t(T * q_w));
  d.kk = im.scratch<float>(im.k, size_t(T * kv_w));
  d.v = im.scratch<float>(im.v, size_t(T * kv_w));
  d.attn = im.scratch<float>(im.attn, size_t(T * q_w));
  d.gate = im.scratch<float>(im.gate, size_t(T * n_ff));
  d.up = im.scratch<float>(im.up, size_t(T * n_ff));
  d.xq = im.scratch<int8_t>(im.xq, size_t(std::max(T, n_out) * max_k));
  d.xd = im.scratch<uint16_t>(im.xd, size_t(std::max(T, n_out) * max_k / kernels::kQK));
  d.rope = im.scratch<float>(im.rope, size_t(T * hp.n_rot));
  d.rope_swa = in.rope_swa ? im.scratch<float>(im.rope_swa, size_t(T * hp.n_rot)) : nullptr;
  d.pages = im.scratch<void*>(im.pages, size_t(n_groups) * n_pages);
  auto* d_page_off = im.scratch<int32_t>(im.page_off, size_t(T));
  auto* d_pos = im.scratch<int32_t>(im.pos, size_t(T));
  d.attn_tokens = im.scratch<int32_t>(im.attn_tokens, size_t(3 * T));
  if (d.n_dec > 0) {
    ck::AttentionSplitScratch& split = d.split;
    const int32_t max_parts = (d.max_pos + split.part - 1) / split.part;
    const int32_t max_chunks = (d.max_pos + ck::kAttentionChunk - 1) / ck::kAttentionChunk;
    const size_t heads = size_t(d.n_dec) * size_t(hp.n_head);
    split.acc = im.scratch<float>(im.split_acc, heads * size_t(max_chunks) * size_t(hd));
    split.max = im.scratch<float>(im.split_max, heads * size_t(max_parts));
    split.score = im.scratch<float>(im.split_score, size_t(d.n_dec) * size_t(hp.n_head) * size_t(d.max_pos));
  }
  d.out_row = im.scratch<int32_t>(im.out_row, size_t(n_out));
  d.rows = im.scratch<float>(im.rows, size_t(n_out * n_embd));
  d.logits_dev = im.scratch<float>(im.logits, size_t(n_out * n_vocab));

  float* h_logits = pinned<float>(im.h_logits, size_t(n_out) * size_t(n_vocab));

  // With every page in VRAM the step's work (uploads from pinned buffers, kernels, the
  // logits download into a pinned buffer) is captured into a CUDA graph and replayed: one
  // launch instead of hundreds. The executable graph is updated in place while the
  // batch's shape stays the same and re-instantiated when it changes.
  StepCapture capture(im.use_graphs && n_staged == 0 ? st : nullptr);

  TANDEM_CUDA(
      cudaMemcpyAsync(d.pages, h_pages, size_t(n_groups) * n_pages * sizeof(void*), cudaMemcpyHostToDevice, st));
  TANDEM_CUDA(cudaMemcpyAsync(d_page_off, h_page_off, size_t(T) * sizeof(int32_t), cudaMemcpyHostToDevice, st));
  TANDEM_CUDA(cudaMemcpyAsync(d_pos, in.pos, size_t(T) * sizeof(int32_t), cudaMemcpyHostToDevice, st));
  TANDEM_CUDA(cudaMemcpyAsync(d.attn_tokens, h_attn_tokens, size_t(T + 2 * d.n_tiles) * sizeof(int32_t),
                              cudaMemcpyHostToDevice, st));
  if (n_out > 0) {
    TANDEM_CUDA(cudaMemcpyAsync(d.out_row, in.out_row, size_t(n_out) * sizeof(int32_t), cudaMemcpyHostToDevice, st));
  }
  TANDEM_CUDA(cudaMemcpyAsync(d.x, in.x, size_t(T * n_embd) * sizeof(float), cudaMemcpyHostToDevice, st));
  TANDEM_CUDA(cudaMemcpyAsync(d.rope, in.rope, size_t(T * hp.n_rot) * sizeof(float), cudaMemcpyHostToDevice, st));
  if (d.rope_swa) {
    TANDEM_CUDA(
        cudaMemcpyAsync(d.rope_swa, in.rope_swa, size_t(T * hp.n_rot) * sizeof(float), cudaMemcpyHostToDevice, st));
  }

  d.kv.page_off = d_page_off;
  d.kv.pos = d_pos;
  d.kv.page_size = P;
  d.kv.n_head_kv = hp.n_head_kv;
  d.kv.head_dim = hp.head_dim;
  d.kv.f16 = layout.dtype == KvDtype::kF16;
  run_decoder(model, d);

  if (n_out > 0) {
    TANDEM_CUDA(cudaMemcpyAsync(h_logits, d.logits_dev, size_t(n_out) * size_t(n_vocab) * sizeof(float),
                                cudaMemcpyDeviceToHost, st));
  }
  for (const auto& w : im.write_back) {
    TANDEM_CUDA(cudaMemcpyAsync(w.host, w.dev, pb, cudaMemcpyDeviceToHost, st));
  }
  TANDEM_CUDA(cudaGetLastError());  // launch errors
  capture.launch(im);
  TANDEM_CUDA(cudaStreamSynchronize(st));
  if (n_out > 0) std::memcpy(logits.data(), h_logits, size_t(n_out) * size_t(n_vocab) * sizeof(float));
  for (const auto& s : batch) s.kv->set_n_tokens(s.pos0 + static_cast<int32_t>(s.tokens.size()));
}

}  // namespace tandem
