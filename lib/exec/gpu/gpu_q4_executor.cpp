// GpuQ4Executor host code: weight upload, the Device-tier KV backend, per-step staging and
// the layer loop that enqueues the kernels of kernels/cuda on the compute stream.
// Compiled by the host compiler into tandem_core (CUDA builds only).
#include "tandem/exec/gpu/gpu_q4_executor.hpp"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <map>
#include <mutex>
#include <vector>

#include "cpu/cpu_kernels.hpp"
#include "cuda/cuda_kernels.hpp"
#include "tandem/model/requantize.hpp"

namespace tandem {

namespace ck = kernels::cuda;

namespace {

// Decode attention through the split-KV kernels (kernels/cuda attention_split); false
// routes every token through attention().
constexpr bool kSplitDecodeAttention = true;

void cuda_check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();  // clear a non-sticky error so the next call starts clean
  throw Error(e == cudaErrorMemoryAllocation ? ErrorCode::kOutOfMemory : ErrorCode::kInternal,
              fmt::format("CUDA: {} failed: {} ({})", what, cudaGetErrorString(e), cudaGetErrorName(e)));
}
#define TANDEM_CUDA(expr) cuda_check((expr), #expr)

// Makes `device` current for its lifetime, then restores the caller's current device
// (a library call never leaves the caller's thread on another device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    TANDEM_CUDA(cudaGetDevice(&prev_));
    if (prev_ != device_) TANDEM_CUDA(cudaSetDevice(device_));
  }
  ~DeviceGuard() {
    if (prev_ != device_) (void)cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int prev_ = 0;
};

// Device memory, freed on destruction.
class DevBuf {
 public:
  DevBuf() = default;
  explicit DevBuf(size_t bytes) { alloc(bytes); }
  ~DevBuf() { reset(); }
  DevBuf(DevBuf&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr, o.bytes_ = 0; }
  DevBuf& operator=(DevBuf&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = o.p_, bytes_ = o.bytes_;
      o.p_ = nullptr, o.bytes_ = 0;
    }
    return *this;
  }
  void alloc(size_t bytes) {
    reset();
    if (bytes == 0) return;
    TANDEM_CUDA(cudaMalloc(&p_, bytes));
    bytes_ = bytes;
  }
  void reset() noexcept {
    if (p_) cudaFree(p_);
    p_ = nullptr, bytes_ = 0;
  }
  /// Grow (contents not kept) to at least `bytes`, doubling. The outgrown allocation is
  /// moved to `retired` rather than freed: cudaFree synchronises the whole device (every
  /// stream of every executor on it), so it waits for the owner's destruction; doubling
  /// bounds what is kept to the final size.
  void* grow(size_t bytes, std::vector<DevBuf>& retired) {
    if (bytes_ < bytes) {
      const size_t want = std::max(bytes, 2 * bytes_);
      if (p_) retired.push_back(std::move(*this));
      alloc(want);
    }
    return p_;
  }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(p_);
  }
  size_t bytes() const noexcept { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

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
    if (converted > 0) {
      fmt::print(stderr,
                 "tandem: GPU executor: {} Q4_1 / Q5_0 weights converted to Q8_0 for the GPU (it has no kernel for "
                 "them yet; the CPU executor runs them as they are, so this model's CPU and GPU logits differ "
                 "slightly)\n",
                 converted);
    }
  }
  int converted = 0;  ///< weights converted to Q8_0 at upload

  const void* upload_bytes(const void* src, size_t n) {
    mem.emplace_back(n);
    TANDEM_CUDA(cudaMemcpy(mem.back().as<void>(), src, n, cudaMemcpyHostToDevice));
    bytes += n;
    return mem.back().as<void>();
  }

  const float* upload_f32(const TensorView& t, const char* what) {
    if (!t) return nullptr;
    if (t.type != GgmlType::kF32) {
      throw Error(ErrorCode::kModelBadTensorShape,
                  fmt::format("GPU executor: {} must be F32, found {}", what, ggml_type_name(t.type)));
    }
    return static_cast<const float*>(upload_bytes(t.data, t.row_bytes * size_t(t.n)));
  }

  // Q4_0 / Q8_0: split each block into its quant bytes and its scale (pure rearrangement).
  ck::DevWeight upload_matrix(const TensorView& t) {
    ck::DevWeight w;
    w.n = t.n;
    w.k = t.k;
    const size_t n = size_t(t.n);
    switch (t.type) {
      case GgmlType::kQ4_0:
      case GgmlType::kQ8_0: {
        const bool q4 = t.type == GgmlType::kQ4_0;
        const size_t nb = size_t(t.k) / kernels::kQK;
        const size_t qbytes = q4 ? kernels::kQK / 2 : kernels::kQK;
        const size_t bbytes = q4 ? sizeof(kernels::BlockQ4_0) : sizeof(kernels::BlockQ8_0);
        std::vector<uint8_t> qs(n * nb * qbytes);
        std::vector<uint16_t> d(n * nb);
        for (size_t r = 0; r < n; ++r) {
          const std::byte* row = t.data + r * t.row_bytes;
          for (size_t b = 0; b < nb; ++b) {
            const std::byte* blk = row + b * bbytes;
            std::memcpy(&d[r * nb + b], blk, sizeof(uint16_t));
            std::memcpy(&qs[(r * nb + b) * qbytes], blk + sizeof(uint16_t), qbytes);
          }
        }
        w.type = q4 ? ck::WType::kQ4_0 : ck::WType::kQ8_0;
        w.q = upload_bytes(qs.data(), qs.size());
        w.d = static_cast<const uint16_t*>(upload_bytes(d.data(), d.size() * sizeof(uint16_t)));
        break;
      }
      case GgmlType::kQ4_1:
      case GgmlType::kQ5_0: {  // no GPU kernel yet: Q8_0 (the CPU's load conversion bytes), said at load
        std::vector<std::byte> q8(n * (size_t(t.k) / kernels::kQK) * sizeof(kernels::BlockQ8_0));
        std::vector<float> scratch(size_t(t.k));
        requantize_rows(*t.info, GgmlType::kQ8_0, 0, t.n, q8.data(), scratch.data());
        TensorView c = t;
        c.type = GgmlType::kQ8_0;
        c.data = q8.data();
        c.row_bytes = q8.size() / n;
        ++converted;
        return upload_matrix(c);
      }
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
        break;  // Model::load converts every other type (model.hpp)
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

// The caller makes `device` current.
int32_t attention_setup_once(int device) {
  DeviceRegistry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  if (auto it = r.score_capacity.find(device); it != r.score_capacity.end()) return it->second;
  int32_t cap = 0;
  TANDEM_CUDA(ck::attention_setup(device, &cap));
  r.score_capacity[device] = cap;
  return cap;
}

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
  DevBuf x, xn, q, k, v, attn, gate, up, xq, xd, rope, pages, page_off, pos, out_index, rows, logits, stage;
  DevBuf attn_tokens, split_acc, split_max, split_sum, split_score;  // attention token lists, flash-decoding partials
  std::vector<DevBuf> retired;
  // Per-step host buffers.
  PinnedBuf h_x, h_rope, h_pages, h_page_off, h_pos, h_out_index, h_logits, h_attn_tokens;
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
  if (this->model().hparams().arch == Arch::kGemma3) {  // before any device work: no device needed to refuse
    throw Error(ErrorCode::kInvalidArgument, "architecture gemma3 is not supported by the GPU executor yet");
  }
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
       {&im.x,      &im.xn,    &im.q,           &im.k,         &im.v,         &im.attn,      &im.gate,       &im.up,
        &im.xq,     &im.xd,    &im.rope,        &im.pages,     &im.page_off,  &im.pos,       &im.out_index,  &im.rows,
        &im.logits, &im.stage, &im.attn_tokens, &im.split_acc, &im.split_max, &im.split_sum, &im.split_score}) {
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

std::shared_ptr<KvStore> GpuQ4Executor::make_kv_store(int32_t device_pages, int32_t host_pages, int32_t page_size,
                                                      KvDtype dtype, int32_t file_pages) const {
  KvStoreOptions o;
  o.layout = KvLayout::for_model(model().hparams(), page_size, dtype);
  o.host_pages = host_pages;
  o.file_pages = file_pages;
  o.device = make_kv_device_backend(o.layout, device_pages);
  return std::make_shared<KvStore>(std::move(o));
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

  int64_t T = 0;
  size_t n_pages = 0;
  int32_t max_pos = 1;
  for (const auto& s : batch) {
    const int32_t end = s.pos0 + static_cast<int32_t>(s.tokens.size());
    T += static_cast<int64_t>(s.tokens.size());
    n_pages += size_t((end + P - 1) / P);
    max_pos = std::max(max_pos, end);
  }
  const int64_t n_out = logits_rows(batch);

  // ---- host side: page table, staging of Host/File pages, token inputs ----------------
  auto* h_pages = pinned<void*>(im.h_pages, n_pages);
  auto* h_page_off = pinned<int32_t>(im.h_page_off, size_t(T));
  auto* h_pos = pinned<int32_t>(im.h_pos, size_t(T));
  auto* h_out_index = pinned<int32_t>(im.h_out_index, size_t(n_out));
  auto* h_x = pinned<float>(im.h_x, size_t(T * n_embd));
  auto* h_rope = pinned<float>(im.h_rope, size_t(T * hp.n_rot));
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
  int64_t n_dec = 0, n_tiles = 0, n_listed = 0;
  for (const auto& s : batch) {
    if (split_fits && s.tokens.size() == 1) ++n_dec;
  }
  {
    int64_t t = 0, di = 0, pi = 0;
    for (const auto& s : batch) {
      const bool dec = split_fits && s.tokens.size() == 1;
      const auto n = static_cast<int32_t>(s.tokens.size());
      if (!dec && tile_q > 0 && n > 1) {
        for (int32_t j = 0; j < n; j += tile_q, ++n_tiles) {
          h_attn_tokens[T + 2 * n_tiles] = static_cast<int32_t>(t + j);
          h_attn_tokens[T + 2 * n_tiles + 1] = std::min(tile_q, n - j);
        }
        t += n;
        continue;
      }
      for (int32_t j = 0; j < n; ++j, ++t) {
        h_attn_tokens[dec ? di++ : n_dec + pi++] = static_cast<int32_t>(t);
      }
    }
    n_listed = n_dec + pi;
  }

  size_t n_staged = 0;
  for (const auto& s : batch) {
    const int32_t end = s.pos0 + static_cast<int32_t>(s.tokens.size());
    for (int32_t j = 0; j < (end + P - 1) / P; ++j) {
      const PageId pid = s.kv->block_table()[size_t(j)];
      if (s.kv->store().tier_of(pid) != KvTier::kDevice) ++n_staged;
    }
  }
  auto* stage = n_staged ? im.scratch<std::byte>(im.stage, n_staged * pb) : nullptr;
  im.write_back.clear();
  {
    size_t pi = 0, si = 0;
    int64_t t = 0, r = 0;
    for (const auto& s : batch) {
      const KvStore& store = s.kv->store();
      const int32_t end = s.pos0 + static_cast<int32_t>(s.tokens.size());
      const auto page_base = static_cast<int32_t>(pi);
      for (int32_t j = 0; j < (end + P - 1) / P; ++j) {
        const PageId pid = s.kv->block_table()[size_t(j)];
        if (store.tier_of(pid) == KvTier::kDevice) {
          const auto* backend = dynamic_cast<const GpuKvBackend*>(store.device_backend());
          if (!backend || backend->device() != im.device) {
            throw Error(ErrorCode::kInvalidArgument,
                        fmt::format("GPU executor: a Device KV page of sequence {} is not in a Device tier of "
                                    "CUDA device {} made by a GpuQ4Executor",
                                    s.kv->id(), im.device));
          }
          h_pages[pi++] = backend->slot_ptr(store.device_slot(pid));
        } else {
          std::byte* host = store.page_data(pid);
          std::byte* d = stage + (si++) * pb;
          TANDEM_CUDA(cudaMemcpyAsync(d, host, pb, cudaMemcpyHostToDevice, st));
          if (j >= s.pos0 / P) im.write_back.push_back({host, d});
          h_pages[pi++] = d;
        }
      }
      const auto n = static_cast<int64_t>(s.tokens.size());
      for (int64_t j = 0; j < n; ++j, ++t) {
        h_page_off[t] = page_base;
        h_pos[t] = s.pos0 + static_cast<int32_t>(j);
        embedding_row(model.token_embd(), s.tokens[size_t(j)], h_x + t * n_embd);
        const bool want = s.logits == LogitsRows::kAll || (s.logits == LogitsRows::kLast && j == n - 1);
        if (want) h_out_index[r++] = static_cast<int32_t>(t);
      }
    }
  }
  // RoPE cos/sin per token, built exactly as the CPU builds them (repeated multiplication).
  const int64_t half = hp.n_rot / 2;
  const float theta_scale = std::pow(hp.rope_freq_base, -2.0f / float(hp.n_rot));
  for (int64_t t = 0; t < T; ++t) {
    float theta = static_cast<float>(h_pos[t]);
    float* c = h_rope + t * hp.n_rot;
    for (int64_t i = 0; i < half; ++i) {
      const float th = hp.rope_freq_scale * theta;
      c[i] = std::cos(th);
      c[half + i] = std::sin(th);
      theta *= theta_scale;
    }
  }

  // ---- device buffers and uploads ----------------------------------------------------
  float* x = im.scratch<float>(im.x, size_t(T * n_embd));
  float* xn = im.scratch<float>(im.xn, size_t(T * n_embd));
  float* q = im.scratch<float>(im.q, size_t(T * q_w));
  float* kk = im.scratch<float>(im.k, size_t(T * kv_w));
  float* v = im.scratch<float>(im.v, size_t(T * kv_w));
  float* attn = im.scratch<float>(im.attn, size_t(T * q_w));
  float* gate = im.scratch<float>(im.gate, size_t(T * n_ff));
  float* up = im.scratch<float>(im.up, size_t(T * n_ff));
  auto* xq = im.scratch<int8_t>(im.xq, size_t(std::max(T, n_out) * max_k));
  auto* xd = im.scratch<uint16_t>(im.xd, size_t(std::max(T, n_out) * max_k / kernels::kQK));
  float* rope = im.scratch<float>(im.rope, size_t(T * hp.n_rot));
  auto* d_pages = im.scratch<void*>(im.pages, n_pages);
  auto* d_page_off = im.scratch<int32_t>(im.page_off, size_t(T));
  auto* d_pos = im.scratch<int32_t>(im.pos, size_t(T));
  auto* d_attn_tokens = im.scratch<int32_t>(im.attn_tokens, size_t(3 * T));
  ck::AttentionSplitScratch split;
  if (n_dec > 0) {
    const int32_t max_parts = (max_pos + split.part - 1) / split.part;
    const size_t slots = size_t(n_dec) * size_t(hp.n_head) * size_t(max_parts);
    split.acc = im.scratch<float>(im.split_acc, slots * size_t(hd));
    split.max = im.scratch<float>(im.split_max, slots);
    split.sum = im.scratch<double>(im.split_sum, slots);
    split.score = im.scratch<float>(im.split_score, size_t(n_dec) * size_t(hp.n_head) * size_t(max_pos));
  }
  auto* d_out_index = im.scratch<int32_t>(im.out_index, size_t(n_out));
  float* rows = im.scratch<float>(im.rows, size_t(n_out * n_embd));
  float* d_logits = im.scratch<float>(im.logits, size_t(n_out * n_vocab));

  float* h_logits = pinned<float>(im.h_logits, size_t(n_out) * size_t(n_vocab));

  // With every page in VRAM the step's work (uploads from pinned buffers, kernels, the
  // logits download into a pinned buffer) is captured into a CUDA graph and replayed: one
  // launch instead of hundreds. The executable graph is updated in place while the
  // batch's shape stays the same and re-instantiated when it changes.
  StepCapture capture(im.use_graphs && n_staged == 0 ? st : nullptr);

  TANDEM_CUDA(cudaMemcpyAsync(d_pages, h_pages, n_pages * sizeof(void*), cudaMemcpyHostToDevice, st));
  TANDEM_CUDA(cudaMemcpyAsync(d_page_off, h_page_off, size_t(T) * sizeof(int32_t), cudaMemcpyHostToDevice, st));
  TANDEM_CUDA(cudaMemcpyAsync(d_pos, h_pos, size_t(T) * sizeof(int32_t), cudaMemcpyHostToDevice, st));
  TANDEM_CUDA(cudaMemcpyAsync(d_attn_tokens, h_attn_tokens, size_t(T + 2 * n_tiles) * sizeof(int32_t),
                              cudaMemcpyHostToDevice, st));
  if (n_out > 0) {
    TANDEM_CUDA(cudaMemcpyAsync(d_out_index, h_out_index, size_t(n_out) * sizeof(int32_t), cudaMemcpyHostToDevice, st));
  }
  TANDEM_CUDA(cudaMemcpyAsync(x, h_x, size_t(T * n_embd) * sizeof(float), cudaMemcpyHostToDevice, st));
  TANDEM_CUDA(cudaMemcpyAsync(rope, h_rope, size_t(T * hp.n_rot) * sizeof(float), cudaMemcpyHostToDevice, st));

  // y = W x (or y += W x), quantising x to Q8_0 first when W is quantised. `prepared`
  // remembers which input is already quantised (several matmuls share one input).
  const float* prepared = nullptr;
  auto matmul = [&](const ck::DevWeight& w, const float* in, int64_t m, float* out, bool accumulate) {
    if (w.quantized() && prepared != in) {
      ck::quantize_q8_0(in, m, w.k, xq, xd, st);
      prepared = in;
    }
    ck::gemm(w, in, xq, xd, m, out, w.n, accumulate, st, im.tensor_cores);
  };
  // out_i = W_i in (+ bias_i, when given) for matrices sharing the input (Q, K, V; gate,
  // up): one launch, biases included, where gemm_parts can merge them
  // (GpuExecutorOptions::merge_matmuls), else matmul() and add_bias() each.
  auto matmuls = [&](std::initializer_list<const ck::DevWeight*> ws, const float* in, int64_t m,
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
  };
  // RMSNorm of x rows into `out` for the matmuls in `users`: with fused kernels and a
  // quantised user, the Q8_0 input is made in the same launch (the result as rms_norm then
  // quantize_q8_0, bit for bit) and marked prepared.
  auto norm = [&](const float* in, const float* weight, float* out, int64_t m, const int32_t* gather,
                  std::initializer_list<const ck::DevWeight*> users) {
    const bool quant = std::any_of(users.begin(), users.end(), [](const ck::DevWeight* u) { return u->quantized(); });
    if (im.fused && quant) {
      ck::rms_norm_q8_0(in, weight, out, xq, xd, m, n_embd, hp.rms_eps, gather, st);
      prepared = out;
    } else {
      ck::rms_norm(in, weight, out, m, n_embd, hp.rms_eps, gather, st);
      prepared = nullptr;
    }
  };

  ck::KvArgs kv;
  kv.pages = d_pages;
  kv.page_off = d_page_off;
  kv.pos = d_pos;
  kv.page_size = P;
  kv.n_head_kv = hp.n_head_kv;
  kv.head_dim = hp.head_dim;
  kv.f16 = layout.dtype == KvDtype::kF16;
  const float kq_scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const bool neox = hp.rope_type == RopeType::kNeox;

  for (int32_t il = 0; il < hp.n_layer; ++il) {
    const DevLayer& L = im.weights->layers[size_t(il)];
    norm(x, L.attn_norm, xn, T, nullptr, {&L.wq, &L.wk, &L.wv});
    matmuls({&L.wq, &L.wk, &L.wv}, xn, T, {q, kk, v}, {L.bq, L.bk, L.bv});
    if (L.q_norm) ck::rms_norm(q, L.q_norm, q, T * hp.n_head, hd, hp.rms_eps, nullptr, st);
    if (L.k_norm) ck::rms_norm(kk, L.k_norm, kk, T * hp.n_head_kv, hd, hp.rms_eps, nullptr, st);
    kv.layer = il;
    if (im.fused) {
      ck::rope_kv_store(kv, q, kk, v, rope, T, hp.n_head, hp.n_rot, neox, st);
    } else {
      ck::rope(q, rope, T, hp.n_head, hp.head_dim, hp.n_rot, neox, st);
      ck::rope(kk, rope, T, hp.n_head_kv, hp.head_dim, hp.n_rot, neox, st);
      ck::kv_store_rows(kv, kk, v, T, st);
    }
    // Every token decoding through the split kernels: their last launch also makes Wo's
    // Q8_0 input (the result of quantize_q8_0 on attn, bit for bit).
    const bool attn_q8 = im.fused && L.wo.quantized() && n_dec == T && hd % kernels::kQK == 0;
    ck::attention_split(kv, q, attn, d_attn_tokens, n_dec, hp.n_head, kq_scale, max_pos, split, st,
                        attn_q8 ? xq : nullptr, attn_q8 ? xd : nullptr);
    ck::attention(kv, q, attn, n_listed - n_dec, hp.n_head, kq_scale, max_pos, im.score_capacity, st,
                  d_attn_tokens + n_dec);
    ck::attention_prefill(kv, q, attn, d_attn_tokens + T, n_tiles, hp.n_head, kq_scale, st);
    prepared = attn_q8 ? attn : nullptr;
    matmul(L.wo, attn, T, x, true);  // residual: x += Wo attn
    norm(x, L.ffn_norm, xn, T, nullptr, {&L.gate, &L.up});
    matmuls({&L.gate, &L.up}, xn, T, {gate, up}, {});
    if (im.fused && L.down.quantized()) {
      ck::swiglu_q8_0(gate, up, T * n_ff, xq, xd, st);  // the down projection's Q8_0 input
      prepared = gate;
    } else {
      ck::swiglu(gate, up, T * n_ff, st);
      prepared = nullptr;
    }
    matmul(L.down, gate, T, x, true);  // residual: x += W_down h
  }

  if (n_out > 0) {
    norm(x, im.weights->output_norm, rows, n_out, d_out_index, {&im.weights->output});
    matmul(im.weights->output, rows, n_out, d_logits, false);
    TANDEM_CUDA(cudaMemcpyAsync(h_logits, d_logits, size_t(n_out) * size_t(n_vocab) * sizeof(float),
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

// ---- test hooks ---------------------------------------------------------------------------

namespace gpu_testing {

int current_device() {
  int d = 0;
  TANDEM_CUDA(cudaGetDevice(&d));
  return d;
}

void set_current_device(int device) {
  TANDEM_CUDA(cudaSetDevice(device));
}

void quantize_q8_0(const float* x, int64_t m, int64_t k, void* blocks_out, int device) {
  if (device < 0 || device >= GpuQ4Executor::device_count()) {
    throw Error(ErrorCode::kInvalidArgument, "gpu_testing: no such CUDA device");
  }
  const DeviceGuard guard(device);
  const size_t nb = size_t(k) / kernels::kQK;
  DevBuf dx(size_t(m * k) * sizeof(float)), dq(size_t(m * k)), dd(size_t(m) * nb * sizeof(uint16_t));
  TANDEM_CUDA(cudaMemcpy(dx.as<void>(), x, dx.bytes(), cudaMemcpyHostToDevice));
  ck::quantize_q8_0(dx.as<float>(), m, k, dq.as<int8_t>(), dd.as<uint16_t>(), nullptr);
  TANDEM_CUDA(cudaGetLastError());
  std::vector<int8_t> q(size_t(m * k));
  std::vector<uint16_t> d(size_t(m) * nb);
  TANDEM_CUDA(cudaMemcpy(q.data(), dq.as<void>(), q.size(), cudaMemcpyDeviceToHost));
  TANDEM_CUDA(cudaMemcpy(d.data(), dd.as<void>(), d.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  auto* out = static_cast<kernels::BlockQ8_0*>(blocks_out);
  for (size_t b = 0; b < size_t(m) * nb; ++b) {
    out[b].d = d[b];
    std::memcpy(out[b].qs, &q[b * kernels::kQK], kernels::kQK);
  }
}

namespace {

void require_device(int device) {
  if (device < 0 || device >= GpuQ4Executor::device_count()) {
    throw Error(ErrorCode::kInvalidArgument, "gpu_testing: no such CUDA device");
  }
}

template <class T>
void to_device(DevBuf& b, const T* src, size_t n) {
  b.alloc(std::max<size_t>(n, 1) * sizeof(T));
  if (n) TANDEM_CUDA(cudaMemcpy(b.as<void>(), src, n * sizeof(T), cudaMemcpyHostToDevice));
}

template <class T>
void to_host(T* dst, const DevBuf& b, size_t n) {
  if (n) TANDEM_CUDA(cudaMemcpy(dst, b.as<void>(), n * sizeof(T), cudaMemcpyDeviceToHost));
}

// Device Q8_0 data (qs [n_blocks][32], d [n_blocks]) -> GGUF Q8_0 blocks.
void q8_blocks_to_host(const DevBuf& dq, const DevBuf& dd, size_t n_blocks, void* blocks_out) {
  std::vector<int8_t> q(n_blocks * kernels::kQK);
  std::vector<uint16_t> d(n_blocks);
  to_host(q.data(), dq, q.size());
  to_host(d.data(), dd, d.size());
  auto* out = static_cast<kernels::BlockQ8_0*>(blocks_out);
  for (size_t b = 0; b < n_blocks; ++b) {
    out[b].d = d[b];
    std::memcpy(out[b].qs, &q[b * kernels::kQK], kernels::kQK);
  }
}

// The KvArgs of a harness: page table, page offsets and positions in device buffers, rows
// in layer 1 of two-layer pages.
ck::KvArgs layer1_kv_args(const DevBuf& table, const DevBuf& page_off, const DevBuf& pos, int32_t page_size,
                          int32_t n_head_kv, int32_t head_dim, bool f16) {
  ck::KvArgs kv;
  kv.pages = table.as<void*>();
  kv.page_off = page_off.as<int32_t>();
  kv.pos = pos.as<int32_t>();
  kv.page_size = page_size;
  kv.n_head_kv = n_head_kv;
  kv.head_dim = head_dim;
  kv.layer = 1;
  kv.f16 = f16;
  return kv;
}

// GGUF Q4_0 / Q8_0 blocks [n][nb] -> the device layout (block_math.cuh) in qs and d.
ck::DevWeight upload_quant_weight(bool q8, const void* blocks, int64_t n, int64_t k, DevBuf& qs, DevBuf& d) {
  const size_t nb = size_t(k) / kernels::kQK, count = size_t(n) * nb;
  const size_t qbytes = q8 ? kernels::kQK : kernels::kQK / 2;
  const size_t bbytes = q8 ? sizeof(kernels::BlockQ8_0) : sizeof(kernels::BlockQ4_0);
  std::vector<uint8_t> hq(count * qbytes);
  std::vector<uint16_t> hd(count);
  const auto* src = static_cast<const std::byte*>(blocks);
  for (size_t b = 0; b < count; ++b) {
    std::memcpy(&hd[b], src + b * bbytes, sizeof(uint16_t));
    std::memcpy(&hq[b * qbytes], src + b * bbytes + sizeof(uint16_t), qbytes);
  }
  to_device(qs, hq.data(), hq.size());
  to_device(d, hd.data(), hd.size());
  ck::DevWeight w;
  w.type = q8 ? ck::WType::kQ8_0 : ck::WType::kQ4_0;
  w.n = n;
  w.k = k;
  w.q = qs.as<void>();
  w.d = d.as<uint16_t>();
  return w;
}

}  // namespace

void rms_norm_q8_0(const float* x, const float* w, int64_t n_x_rows, int64_t n, float eps,
                   const std::vector<int32_t>& rows, bool fused, float* y, void* blocks_out, int device) {
  require_device(device);
  const DeviceGuard guard(device);
  const int64_t m = rows.empty() ? n_x_rows : static_cast<int64_t>(rows.size());
  const size_t nb = size_t(m) * size_t(n) / kernels::kQK;
  DevBuf dx, dw, drows, dy(std::max<size_t>(size_t(m * n), 1) * sizeof(float)), dq(std::max<size_t>(nb, 1) * 32),
      dd(std::max<size_t>(nb, 1) * sizeof(uint16_t));
  to_device(dx, x, size_t(n_x_rows * n));
  to_device(dw, w, size_t(n));
  to_device(drows, rows.data(), rows.size());
  const int32_t* r = rows.empty() ? nullptr : drows.as<int32_t>();
  ck::fill_nan(dy.as<float>(), m * n, nullptr);
  TANDEM_CUDA(cudaMemset(dq.as<void>(), 0x5A, dq.bytes()));
  TANDEM_CUDA(cudaMemset(dd.as<void>(), 0x5A, dd.bytes()));
  if (fused) {
    ck::rms_norm_q8_0(dx.as<float>(), dw.as<float>(), dy.as<float>(), dq.as<int8_t>(), dd.as<uint16_t>(), m, n, eps, r,
                      nullptr);
  } else {
    ck::rms_norm(dx.as<float>(), dw.as<float>(), dy.as<float>(), m, n, eps, r, nullptr);
    ck::quantize_q8_0(dy.as<float>(), m, n, dq.as<int8_t>(), dd.as<uint16_t>(), nullptr);
  }
  TANDEM_CUDA(cudaGetLastError());
  to_host(y, dy, size_t(m * n));
  q8_blocks_to_host(dq, dd, nb, blocks_out);
}

void swiglu_q8_0(const float* gate, const float* up, int64_t n, bool fused, float* h, void* blocks_out, int device) {
  require_device(device);
  const DeviceGuard guard(device);
  const size_t nb = size_t(n) / kernels::kQK;
  DevBuf dg, du, dq(std::max<size_t>(nb, 1) * 32), dd(std::max<size_t>(nb, 1) * sizeof(uint16_t));
  to_device(dg, gate, size_t(n));
  to_device(du, up, size_t(n));
  TANDEM_CUDA(cudaMemset(dq.as<void>(), 0x5A, dq.bytes()));
  TANDEM_CUDA(cudaMemset(dd.as<void>(), 0x5A, dd.bytes()));
  if (fused) {
    ck::swiglu_q8_0(dg.as<float>(), du.as<float>(), n, dq.as<int8_t>(), dd.as<uint16_t>(), nullptr);
  } else {
    ck::swiglu(dg.as<float>(), du.as<float>(), n, nullptr);
    ck::quantize_q8_0(dg.as<float>(), 1, n, dq.as<int8_t>(), dd.as<uint16_t>(), nullptr);
  }
  TANDEM_CUDA(cudaGetLastError());
  to_host(h, dg, size_t(n));
  q8_blocks_to_host(dq, dd, nb, blocks_out);
}

void rope_kv_store(int32_t n_head, int32_t n_head_kv, int32_t head_dim, int32_t n_rot, bool neox, int32_t page_size,
                   bool f16, const std::vector<int32_t>& seq, const std::vector<int32_t>& pos, float* q, float* k,
                   const float* v, const float* cs, std::vector<uint8_t>& pages_out, bool fused, int device) {
  require_device(device);
  if (seq.size() != pos.size() || seq.empty() || seq.front() != 0) {
    throw Error(ErrorCode::kInvalidArgument, "gpu_testing: seq and pos must list the same tokens, from sequence 0");
  }
  const DeviceGuard guard(device);
  const auto T = static_cast<int64_t>(seq.size());
  const int32_t row = n_head_kv * head_dim;
  const size_t page_bytes = size_t(2) * 2 * size_t(page_size) * size_t(row) * (f16 ? 2 : 4);  // 2 layers, K and V
  // Pages per sequence, from the largest position of each.
  std::vector<int32_t> seq_pages;
  for (int64_t t = 0; t < T; ++t) {
    const auto s = static_cast<size_t>(seq[size_t(t)]);
    if (s + 1 < seq_pages.size() || s > seq_pages.size()) {
      throw Error(ErrorCode::kInvalidArgument, "gpu_testing: seq must be non-decreasing without gaps");
    }
    if (s == seq_pages.size()) seq_pages.push_back(0);
    seq_pages[s] = std::max(seq_pages[s], pos[size_t(t)] / page_size + 1);
  }
  std::vector<int32_t> seq_off(seq_pages.size());
  int32_t n_pages = 0;
  for (size_t s = 0; s < seq_pages.size(); ++s) {
    seq_off[s] = n_pages;
    n_pages += seq_pages[s];
  }
  std::vector<int32_t> page_off(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) page_off[size_t(t)] = seq_off[size_t(seq[size_t(t)])];
  DevBuf dpages(size_t(n_pages) * page_bytes);
  TANDEM_CUDA(cudaMemset(dpages.as<void>(), 0x5A, dpages.bytes()));
  std::vector<void*> table(static_cast<size_t>(n_pages));
  for (int32_t j = 0; j < n_pages; ++j) table[size_t(j)] = dpages.as<std::byte>() + size_t(j) * page_bytes;
  const size_t q_elems = size_t(T) * size_t(n_head) * size_t(head_dim), k_elems = size_t(T) * size_t(row);
  DevBuf dtable, doff, dpos, dq, dk, dv, dcs;
  to_device(dtable, table.data(), table.size());
  to_device(doff, page_off.data(), page_off.size());
  to_device(dpos, pos.data(), pos.size());
  to_device(dq, q, q_elems);
  to_device(dk, k, k_elems);
  to_device(dv, v, k_elems);
  to_device(dcs, cs, size_t(T) * size_t(n_rot));
  const ck::KvArgs kv = layer1_kv_args(dtable, doff, dpos, page_size, n_head_kv, head_dim, f16);
  if (fused) {
    ck::rope_kv_store(kv, dq.as<float>(), dk.as<float>(), dv.as<float>(), dcs.as<float>(), T, n_head, n_rot, neox,
                      nullptr);
  } else {
    ck::rope(dq.as<float>(), dcs.as<float>(), T, n_head, head_dim, n_rot, neox, nullptr);
    ck::rope(dk.as<float>(), dcs.as<float>(), T, n_head_kv, head_dim, n_rot, neox, nullptr);
    ck::kv_store_rows(kv, dk.as<float>(), dv.as<float>(), T, nullptr);
  }
  TANDEM_CUDA(cudaGetLastError());
  to_host(q, dq, q_elems);
  to_host(k, dk, k_elems);
  pages_out.resize(dpages.bytes());
  to_host(pages_out.data(), dpages, pages_out.size());
}

void gemm_q4_0(const void* w_blocks, int64_t n, int64_t k, const float* x, int64_t m, float* y, int device) {
  require_device(device);
  const DeviceGuard guard(device);
  const size_t nb = size_t(k) / kernels::kQK;
  DevBuf dqs, dd, dx, dxq(std::max<size_t>(size_t(m * k), 1)), dxd(std::max<size_t>(size_t(m) * nb, 1) * 2),
      dy(std::max<size_t>(size_t(m * n), 1) * sizeof(float));
  const ck::DevWeight w = upload_quant_weight(false, w_blocks, n, k, dqs, dd);
  to_device(dx, x, size_t(m * k));
  ck::fill_nan(dy.as<float>(), m * n, nullptr);
  ck::quantize_q8_0(dx.as<float>(), m, k, dxq.as<int8_t>(), dxd.as<uint16_t>(), nullptr);
  ck::gemm(w, dx.as<float>(), dxq.as<int8_t>(), dxd.as<uint16_t>(), m, dy.as<float>(), n, false, nullptr);
  TANDEM_CUDA(cudaGetLastError());
  to_host(y, dy, size_t(m * n));
}

void gemm_q8_blocks(bool q8_weights, const void* w_blocks, int64_t n, int64_t k, const void* x_blocks, int64_t m,
                    bool tensor_cores, float* y, int device) {
  require_device(device);
  if (k <= 0 || k % kernels::kQK != 0 || n <= 0 || m <= 0) {
    throw Error(ErrorCode::kInvalidArgument, "gpu_testing: gemm_q8_blocks needs n, m >= 1 and k a multiple of 32");
  }
  std::vector<std::vector<float>> ys;  // one matrix through gemm(): the same launches
  gemm_parts_q8_blocks(q8_weights, {w_blocks}, {n}, k, x_blocks, m, false, tensor_cores, ys, {}, device);
  std::copy(ys[0].begin(), ys[0].end(), y);
}

void gemm_parts_q8_blocks(bool q8_weights, const std::vector<const void*>& w_blocks, const std::vector<int64_t>& n,
                          int64_t k, const void* x_blocks, int64_t m, bool merged, bool tensor_cores,
                          std::vector<std::vector<float>>& y, const std::vector<std::vector<float>>& bias, int device) {
  require_device(device);
  if (k <= 0 || k % kernels::kQK != 0 || m <= 0 || w_blocks.size() != n.size() || n.empty() ||
      std::any_of(n.begin(), n.end(), [](int64_t r) { return r < 1; }) || (!bias.empty() && bias.size() != n.size())) {
    throw Error(ErrorCode::kInvalidArgument,
                "gpu_testing: gemm_parts_q8_blocks needs matrices of n >= 1 rows, m >= 1, k a multiple of 32 and "
                "no biases or one (maybe empty) per matrix");
  }
  for (size_t i = 0; i < bias.size(); ++i) {
    if (!bias[i].empty() && int64_t(bias[i].size()) != n[i]) {
      throw Error(ErrorCode::kInvalidArgument, "gpu_testing: gemm_parts_q8_blocks: a bias needs n values");
    }
  }
  const DeviceGuard guard(device);
  const size_t count = n.size();
  std::vector<DevBuf> dqs(count), dd(count), dy(count);
  std::vector<ck::DevWeight> w(count);
  std::vector<const ck::DevWeight*> wp(count);
  std::vector<float*> yp(count);
  for (size_t i = 0; i < count; ++i) {
    w[i] = upload_quant_weight(q8_weights, w_blocks[i], n[i], k, dqs[i], dd[i]);
    wp[i] = &w[i];
    dy[i].alloc(size_t(m * n[i]) * sizeof(float));
    yp[i] = dy[i].as<float>();
    ck::fill_nan(yp[i], m * n[i], nullptr);
  }
  std::vector<DevBuf> db(count);
  std::vector<const float*> bp(count, nullptr);
  for (size_t i = 0; i < bias.size(); ++i) {
    if (bias[i].empty()) continue;
    to_device(db[i], bias[i].data(), bias[i].size());
    bp[i] = db[i].as<float>();
  }
  DevBuf dxq, dxd;
  const ck::DevWeight x = upload_quant_weight(true, x_blocks, m, k, dxq, dxd);
  const auto* xq = static_cast<const int8_t*>(x.q);
  if (merged) {
    ck::gemm_parts(wp.data(), yp.data(), bp.data(), static_cast<int>(count), nullptr, xq, x.d, m, false, nullptr,
                   tensor_cores);
  } else {
    for (size_t i = 0; i < count; ++i) {
      ck::gemm(w[i], nullptr, xq, x.d, m, yp[i], n[i], false, nullptr, tensor_cores);
      if (bp[i] != nullptr) ck::add_bias(yp[i], bp[i], m, n[i], nullptr);
    }
  }
  TANDEM_CUDA(cudaGetLastError());
  y.assign(count, {});
  for (size_t i = 0; i < count; ++i) {
    y[i].resize(size_t(m * n[i]));
    to_host(y[i].data(), dy[i], y[i].size());
  }
}

namespace {

// Shared body of the attention harnesses: sequence s holds positions [0, lens[s]) and its
// chunk[s] query tokens sit at positions [lens[s] - chunk[s], lens[s]), step rows in order.
// mode: 0 attention(), 1 attention_prefill() (tiles of the plan's bq), 2 attention_split().
void attention_harness(int32_t n_head, int32_t n_head_kv, int32_t head_dim, int32_t page_size, bool f16,
                       const std::vector<int32_t>& lens, const std::vector<int32_t>& chunks, const float* q,
                       const float* k, const float* v, float* out, int mode, int32_t part, int32_t page_shift,
                       void* q8_blocks_out, int device) {
  if (device < 0 || device >= GpuQ4Executor::device_count()) {
    throw Error(ErrorCode::kInvalidArgument, "gpu_testing: no such CUDA device");
  }
  if (lens.size() != chunks.size() || lens.empty() || head_dim <= 0 || n_head_kv <= 0 || n_head % n_head_kv != 0) {
    throw Error(ErrorCode::kInvalidArgument, "gpu_testing: bad attention harness shape");
  }
  for (size_t s = 0; s < lens.size(); ++s) {
    if (chunks[s] < 1 || chunks[s] > lens[s]) {
      throw Error(ErrorCode::kInvalidArgument, "gpu_testing: chunk must be in [1, len]");
    }
  }
  if (q8_blocks_out != nullptr && (mode != 2 || head_dim % kernels::kQK != 0)) {
    throw Error(ErrorCode::kInvalidArgument, "gpu_testing: Q8_0 output needs the split kernels and head_dim % 32 == 0");
  }
  if (page_shift < 0 || page_shift >= 16 || page_shift % (f16 ? 2 : 4) != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                "gpu_testing: page_shift must be a multiple of the KV element size in [0, 16)");
  }
  const DeviceGuard guard(device);
  const auto n_seq = static_cast<int64_t>(lens.size());
  const int32_t row = n_head_kv * head_dim;
  const size_t es = f16 ? 2 : 4;
  const size_t page_bytes = size_t(2) * 2 * size_t(page_size) * size_t(row) * es;  // 2 layers, K and V
  std::vector<int32_t> seq_off(static_cast<size_t>(n_seq)), page_off, pos, tokens;
  int32_t n_pages = 0, max_pos = 1;
  for (int64_t s = 0; s < n_seq; ++s) {
    seq_off[size_t(s)] = n_pages;
    for (int32_t j = 0; j < chunks[size_t(s)]; ++j) {
      tokens.push_back(static_cast<int32_t>(pos.size()));
      page_off.push_back(n_pages);
      pos.push_back(lens[size_t(s)] - chunks[size_t(s)] + j);
    }
    n_pages += (lens[size_t(s)] + page_size - 1) / page_size;
    max_pos = std::max(max_pos, lens[size_t(s)]);
  }
  const auto T = static_cast<int64_t>(pos.size());
  std::vector<std::byte> host(size_t(n_pages) * page_bytes);
  int64_t r = 0;
  for (int64_t s = 0; s < n_seq; ++s) {
    for (int32_t p = 0; p < lens[size_t(s)]; ++p, ++r) {
      std::byte* page = host.data() + size_t(seq_off[size_t(s)] + p / page_size) * page_bytes;
      for (int kind = 0; kind < 2; ++kind) {
        const float* src = (kind == 0 ? k : v) + r * row;
        const int64_t off = ((int64_t{1} * 2 + kind) * page_size + p % page_size) * int64_t{row};  // layer 1
        for (int32_t e = 0; e < row; ++e) {
          if (f16) {
            const uint16_t b = kernels::fp32_to_fp16_bits(src[e]);
            std::memcpy(page + size_t(off + e) * 2, &b, 2);
          } else {
            std::memcpy(page + size_t(off + e) * 4, &src[e], 4);
          }
        }
      }
    }
  }
  // Page j of the step lives in device slot n_pages - 1 - j.
  DevBuf dpages(host.size() + size_t(page_shift) + 1);
  std::vector<void*> table(size_t(std::max(n_pages, 1)));
  for (int32_t j = 0; j < n_pages; ++j) {
    std::byte* slot = dpages.as<std::byte>() + size_t(page_shift) + size_t(n_pages - 1 - j) * page_bytes;
    TANDEM_CUDA(cudaMemcpy(slot, host.data() + size_t(j) * page_bytes, page_bytes, cudaMemcpyHostToDevice));
    table[size_t(j)] = slot;
  }
  const size_t q_elems = size_t(T) * size_t(n_head) * size_t(head_dim);
  DevBuf dtable(table.size() * sizeof(void*)), doff(size_t(T) * 4), dpos(size_t(T) * 4), dtok(size_t(T) * 4),
      dq(q_elems * 4), dout(q_elems * 4);
  TANDEM_CUDA(cudaMemcpy(dtable.as<void>(), table.data(), dtable.bytes(), cudaMemcpyHostToDevice));
  TANDEM_CUDA(cudaMemcpy(doff.as<void>(), page_off.data(), doff.bytes(), cudaMemcpyHostToDevice));
  TANDEM_CUDA(cudaMemcpy(dpos.as<void>(), pos.data(), dpos.bytes(), cudaMemcpyHostToDevice));
  TANDEM_CUDA(cudaMemcpy(dtok.as<void>(), tokens.data(), dtok.bytes(), cudaMemcpyHostToDevice));
  TANDEM_CUDA(cudaMemcpy(dq.as<void>(), q, dq.bytes(), cudaMemcpyHostToDevice));
  ck::fill_nan(dout.as<float>(), int64_t(q_elems), nullptr);
  const ck::KvArgs kv = layer1_kv_args(dtable, doff, dpos, page_size, n_head_kv, head_dim, f16);
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  if (mode == 2) {
    const int32_t max_parts = (max_pos + part - 1) / part;
    const size_t slots = size_t(T) * size_t(n_head) * size_t(max_parts);
    DevBuf acc(slots * size_t(head_dim) * 4), mx(slots * 4), sum(slots * 8),
        score(size_t(T) * size_t(n_head) * size_t(max_pos) * 4);
    ck::AttentionSplitScratch sc;
    sc.acc = acc.as<float>();
    sc.max = mx.as<float>();
    sc.sum = sum.as<double>();
    sc.score = score.as<float>();
    sc.part = part;
    const size_t n_blocks = q8_blocks_out != nullptr ? q_elems / kernels::kQK : 0;
    DevBuf dxq(std::max<size_t>(n_blocks * kernels::kQK, 1)), dxd(std::max<size_t>(n_blocks, 1) * 2);
    ck::attention_split(kv, dq.as<float>(), dout.as<float>(), dtok.as<int32_t>(), T, n_head, scale, max_pos, sc,
                        nullptr, n_blocks ? dxq.as<int8_t>() : nullptr, n_blocks ? dxd.as<uint16_t>() : nullptr);
    TANDEM_CUDA(cudaGetLastError());
    TANDEM_CUDA(cudaMemcpy(out, dout.as<void>(), dout.bytes(), cudaMemcpyDeviceToHost));
    if (n_blocks) q8_blocks_to_host(dxq, dxd, n_blocks, q8_blocks_out);
  } else if (mode == 1) {
    const ck::AttentionPrefillPlan plan = ck::attention_prefill_plan(head_dim, n_head / n_head_kv);
    if (plan.bq < 1) throw Error(ErrorCode::kInvalidArgument, "gpu_testing: no prefill tile fits this shape");
    std::vector<int32_t> tiles;
    int32_t t0 = 0;
    for (int64_t s = 0; s < n_seq; ++s) {
      for (int32_t j = 0; j < chunks[size_t(s)]; j += plan.bq) {
        tiles.push_back(t0 + j);
        tiles.push_back(std::min(plan.bq, chunks[size_t(s)] - j));
      }
      t0 += chunks[size_t(s)];
    }
    DevBuf dtiles(tiles.size() * 4);
    TANDEM_CUDA(cudaMemcpy(dtiles.as<void>(), tiles.data(), dtiles.bytes(), cudaMemcpyHostToDevice));
    ck::attention_prefill(kv, dq.as<float>(), dout.as<float>(), dtiles.as<int32_t>(), int64_t(tiles.size() / 2), n_head,
                          scale, nullptr);
    TANDEM_CUDA(cudaGetLastError());
    TANDEM_CUDA(cudaMemcpy(out, dout.as<void>(), dout.bytes(), cudaMemcpyDeviceToHost));
  } else {
    ck::attention(kv, dq.as<float>(), dout.as<float>(), T, n_head, scale, max_pos, attention_setup_once(device),
                  nullptr);
    TANDEM_CUDA(cudaGetLastError());
    TANDEM_CUDA(cudaMemcpy(out, dout.as<void>(), dout.bytes(), cudaMemcpyDeviceToHost));
  }
}

}  // namespace

void attention_decode(int32_t n_head, int32_t n_head_kv, int32_t head_dim, int32_t page_size, bool f16,
                      const std::vector<int32_t>& lens, const float* q, const float* k, const float* v, float* out,
                      int32_t part, int32_t page_shift, void* q8_blocks_out, int device) {
  const std::vector<int32_t> chunks(lens.size(), 1);
  attention_harness(n_head, n_head_kv, head_dim, page_size, f16, lens, chunks, q, k, v, out, part > 0 ? 2 : 0, part,
                    page_shift, q8_blocks_out, device);
}

void attention_prefill(int32_t n_head, int32_t n_head_kv, int32_t head_dim, int32_t page_size, bool f16,
                       const std::vector<int32_t>& lens, const std::vector<int32_t>& chunks, const float* q,
                       const float* k, const float* v, float* out, bool tiled, int32_t page_shift, int device) {
  attention_harness(n_head, n_head_kv, head_dim, page_size, f16, lens, chunks, q, k, v, out, tiled ? 1 : 0, 0,
                    page_shift, nullptr, device);
}

}  // namespace gpu_testing

}  // namespace tandem
