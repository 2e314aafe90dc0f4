#include "tandem/exec/cpu/cpu_q4_executor.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include <strings.h>

#include "cpu/cpu_kernels.hpp"
#include "exec/transformer.hpp"

namespace tandem {

namespace k = kernels;

namespace {

// A growable buffer: grows to the largest size requested, never shrinks, so a steady
// decode loop reuses it without allocating.
template <class T>
class Buffer {
 public:
  T* get(size_t n) {
    if (v_.size() < n) v_.resize(n);
    return v_.data();
  }

 private:
  std::vector<T> v_;
};

// Where the activations of the current matmul input have been prepared.
struct PreparedInput {
  const float* x = nullptr;
  int64_t m = 0, k = 0;
  bool q8 = false, f16 = false;
};

// One attention task: positions [first, first + n_pos) of sequence `seq` (indices into
// its tokens), all query heads of KV head `kv_head`. split_slot >= 0: a decode task whose
// keys may be split over the threads (its scratch slot, CpuDecoder::split_scratch).
struct AttnTask {
  int32_t seq, kv_head, first, n_pos, split_slot;
};

// Query rows per attention task (positions x heads of a group): enough to amortise the
// per-tile K/V conversion, small enough for the task's scratch to stay in L2.
constexpr int64_t kAttnTileRows = 64;
constexpr int64_t kAttnScoreFloats = int64_t{1} << 20;
// A decode task's keys are split over the threads (kernels::attn_split_*) when a step has
// fewer than two attention tasks per thread and the layer shows the task at least this many
// chunks of kFlashAttnTile positions: below it the three extra pool dispatches per layer
// cost about what the idle thread loses.
constexpr int64_t kSplitMinChunks = 32;

}  // namespace

struct CpuQ4Executor::Scratch {
  Buffer<float> x, xn, q, kbuf, v, attn, tmp, gate, up, logits_in, rope, rope_swa;  // logits_in: normed rows
  Buffer<k::BlockQ8_0> xq8;
  Buffer<uint16_t> xf16;
  Buffer<int32_t> seq, pos, out_row;  // StepInputs
  Buffer<float> fa_scratch;           // [n_threads][flash_attn_scratch_floats]
  Buffer<float> split_scratch;        // [split slots][CpuDecoder::split_floats]
  Buffer<AttnTask> attn_tasks;        // one per (sequence, KV head, query tile)
  Buffer<const void*> kv_pages;       // per layer: K page pointers of every sequence, then V
  Buffer<size_t> seq_pages;           // per sequence: its first entry in kv_pages
  Buffer<int64_t> seq_first_token;    // per sequence: its first row in the batch
  PreparedInput prepared;
};

struct CpuQ4Executor::Repacked {
  // The copies, keyed by the GGUF data of the matrix (tied embeddings share one entry):
  // kernels::BlockQ4_0x8 records for a Q4_0 matrix, BlockQ4_1x8 for Q4_1, BlockQ5_0x8 for Q5_0,
  // BlockQ4_Kx8 for Q4_K, BlockQ6_Kx8 for Q6_K.
  std::unordered_map<const std::byte*, std::vector<std::byte>> by_data;
  // Per layer, the repacked copy of each matrix (null: not repackable), looked up once at
  // construction so that a step indexes instead of hashing.
  struct Layer {
    const void *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;
    const void *ffn_gate = nullptr, *ffn_up = nullptr, *ffn_down = nullptr;
  };
  std::vector<Layer> layers;  // empty when not repacking
  const void* output = nullptr;
  static bool repackable(const TensorView& W) {
    return W && (((W.type == GgmlType::kQ4_0 || W.type == GgmlType::kQ4_1 || W.type == GgmlType::kQ5_0) &&
                  W.k % k::kQK == 0) ||
                 ((W.type == GgmlType::kQ4_K || W.type == GgmlType::kQ6_K) && W.k % k::kQK_K == 0));
  }
  const void* find(const TensorView& W) const {
    if (!repackable(W)) return nullptr;
    const auto it = by_data.find(W.data);
    return it == by_data.end() ? nullptr : it->second.data();
  }
};

std::shared_ptr<ThreadPool> CpuQ4Executor::make_pool(int n_threads) {
  return std::make_shared<ThreadPool>(n_threads, [] { k::cpu_thread_prepare(); });
}

std::shared_ptr<ThreadPool> CpuQ4Executor::node_pool() {
  static std::mutex mu;
  static std::weak_ptr<ThreadPool> node;
  std::lock_guard<std::mutex> lock(mu);
  if (auto p = node.lock()) return p;
  auto p = make_pool(0);
  node = p;
  return p;
}

CpuQ4Executor::CpuQ4Executor(std::shared_ptr<const Model> model, const CpuExecutorOptions& options)
    : Executor(std::move(model)),
      pool_(options.n_threads > 0 ? make_pool(options.n_threads) : node_pool()),
      s_(std::make_unique<Scratch>()) {
  repack_weights(options.repack);
}

CpuQ4Executor::CpuQ4Executor(std::shared_ptr<const Model> model, std::shared_ptr<ThreadPool> pool)
    : Executor(std::move(model)), pool_(std::move(pool)), s_(std::make_unique<Scratch>()) {
  if (!pool_) throw Error(ErrorCode::kInvalidArgument, "cpu executor: the thread pool is null");
  repack_weights(true);
}

CpuQ4Executor::~CpuQ4Executor() = default;

bool CpuQ4Executor::repacked_weights() const noexcept {
  return !repacked_->by_data.empty();
}

const void* CpuQ4Executor::repacked_weights_id() const noexcept {
  return repacked_->by_data.empty() ? nullptr : repacked_.get();
}

void CpuQ4Executor::repack_weights(bool wanted) {
  static const auto kEmpty = std::make_shared<const Repacked>();
  repacked_ = kEmpty;
  if (!wanted) return;
  // The library never calls setenv: reading the environment cannot race with a write of ours.
  if (const char* env = std::getenv("TANDEM_CPU_REPACK"); env != nullptr) {  // NOLINT(concurrency-mt-unsafe)
    for (const char* off : {"0", "false", "off", "no"})
      if (strcasecmp(env, off) == 0) return;
  }
  // One copy per Model: an executor of a Model already repacked shares that copy. The
  // registry's lock is held while repacking, so two executors built at once repack once.
  static std::mutex registry_mu;
  static std::unordered_map<const Model*, std::weak_ptr<const Repacked>> registry;
  std::lock_guard<std::mutex> lock(registry_mu);
  std::erase_if(registry, [](const auto& e) { return e.second.expired(); });
  if (auto it = registry.find(model_ptr().get()); it != registry.end()) {
    repacked_ = it->second.lock();
    return;
  }
  auto repacked = std::make_shared<Repacked>();
  const Model& m = model();
  // The Model's identity hash (KV export, session files and the scheduler name the Model by
  // it) reads every weight once: have it read them now, while they are resident, so that it
  // does not fault the file pages released below back in.
  (void)m.identity_hash();
  auto add = [&](const TensorView& W) {
    if (!Repacked::repackable(W) || repacked->by_data.count(W.data) != 0) return;
    const size_t record = W.type == GgmlType::kQ4_1   ? sizeof(k::BlockQ4_1x8)
                          : W.type == GgmlType::kQ5_0 ? sizeof(k::BlockQ5_0x8)
                          : W.type == GgmlType::kQ4_K ? sizeof(k::BlockQ4_Kx8)
                          : W.type == GgmlType::kQ6_K ? sizeof(k::BlockQ6_Kx8)
                                                      : sizeof(k::BlockQ4_0x8);
    std::vector<std::byte> packed;
    try {
      packed.resize(static_cast<size_t>(k::q4_0x8_records(W.n, W.k)) * record);
    } catch (const std::bad_alloc&) {
      throw Error(ErrorCode::kOutOfMemory, "cpu executor: no memory for the repacked weights");
    }
    pool_->parallel_for((W.n + 7) / 8, 4, [&](int64_t b, int64_t e, int) {
      if (W.type == GgmlType::kQ4_1) {
        k::repack_q4_1x8(reinterpret_cast<const k::BlockQ4_1*>(W.data), W.n, W.k,
                         reinterpret_cast<k::BlockQ4_1x8*>(packed.data()), b, e);
      } else if (W.type == GgmlType::kQ5_0) {
        k::repack_q5_0x8(reinterpret_cast<const k::BlockQ5_0*>(W.data), W.n, W.k,
                         reinterpret_cast<k::BlockQ5_0x8*>(packed.data()), b, e);
      } else if (W.type == GgmlType::kQ4_K) {
        k::repack_q4_kx8(reinterpret_cast<const k::BlockQ4_K*>(W.data), W.n, W.k,
                         reinterpret_cast<k::BlockQ4_Kx8*>(packed.data()), b, e);
      } else if (W.type == GgmlType::kQ6_K) {
        k::repack_q6_kx8(reinterpret_cast<const k::BlockQ6_K*>(W.data), W.n, W.k,
                         reinterpret_cast<k::BlockQ6_Kx8*>(packed.data()), b, e);
      } else {
        k::repack_q4_0x8(reinterpret_cast<const k::BlockQ4_0*>(W.data), W.n, W.k,
                         reinterpret_cast<k::BlockQ4_0x8*>(packed.data()), b, e);
      }
    });
    repacked->by_data.emplace(W.data, std::move(packed));
    // The steps read the copy only: the file's pages of the original leave the process
    // (read again, e.g. by another executor, they come back from the file). Weights the
    // Model converted live on its heap, not in the mapping: release_pages leaves them.
    m.gguf().release_pages(W.data, W.row_bytes * static_cast<uint64_t>(W.n));
  };
  for (const LayerWeights& L : m.layers())
    for (const TensorView* W : {&L.wq, &L.wk, &L.wv, &L.wo, &L.ffn_gate, &L.ffn_up, &L.ffn_down}) add(*W);
  add(m.output());
  if (!repacked->by_data.empty()) {
    repacked->layers.reserve(m.layers().size());
    for (const LayerWeights& L : m.layers())
      repacked->layers.push_back({repacked->find(L.wq), repacked->find(L.wk), repacked->find(L.wv),
                                  repacked->find(L.wo), repacked->find(L.ffn_gate), repacked->find(L.ffn_up),
                                  repacked->find(L.ffn_down)});
    repacked->output = repacked->find(m.output());
  }
  registry[model_ptr().get()] = repacked;
  repacked_ = std::move(repacked);
}

namespace {

void rms_norm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += double(x[i]) * double(x[i]);
  const float mean = static_cast<float>(sum / double(n));
  const float scale = 1.0f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * scale) * w[i];
}

const float* f32_data(const TensorView& t) {
  return reinterpret_cast<const float*>(t.data);
}

// y[m, W.n] = x[m, W.k] * W^T, split over the pool by weight rows.
// packed: W repacked 8 rows at a time (kernels::BlockQ4_0x8, BlockQ4_1x8, BlockQ5_0x8, BlockQ4_Kx8 or BlockQ6_Kx8, as
// W's type), or null.
void matmul(ThreadPool& pool, CpuQ4Executor::Scratch& s, const TensorView& W, const float* x, int64_t m, float* y,
            const void* packed);

// The CPU's primitives of the decoder (exec/transformer.hpp) over one step's buffers. The
// attention inputs of a row (biases, head norms, RoPE, q scale, the K/V store) are one
// per-row loop over the pool; every matmul quantises its input once (Scratch::prepared).
struct CpuDecoder {
  ThreadPool& pool;
  CpuQ4Executor::Scratch& s;
  const Model& model;
  const CpuQ4Executor::Repacked& repacked;  // layers empty: not repacking
  std::span<const SequenceStep> batch;
  std::span<float> logits_out;
  StepInputs in;
  int64_t T = 0, n_out = 0;
  float *x = nullptr, *xn = nullptr, *q = nullptr, *kk = nullptr, *v = nullptr, *attn = nullptr, *tmp = nullptr,
        *gate = nullptr, *up = nullptr;
  // Attention: one task per (sequence, KV head, query tile); per layer, the K and V page
  // pointers of every sequence (kpages / vpages from seq_pages[si]).
  AttnTask* attn_tasks = nullptr;
  int64_t n_attn_tasks = 0;
  float* fa_scratch = nullptr;  // [n_threads][fa_floats]
  size_t fa_floats = 0;
  // Split decode tasks: key ranges per task; per slot the scores [group][split_ld], the
  // ranges' maxima [split_ranges][group], then the chunks' parts [chunks][group][head_dim].
  int64_t split_ranges = 1, split_ld = 0;
  size_t split_floats = 0;
  float* split_scratch = nullptr;
  const void** kpages = nullptr;
  const void** vpages = nullptr;
  size_t* seq_pages = nullptr;
  int64_t* seq_first_token = nullptr;

  const HParams& hp() const noexcept { return model.hparams(); }
  const LayerWeights& weights(const LayerPlan& l) const { return model.layers()[size_t(l.il)]; }
  const CpuQ4Executor::Repacked::Layer& packed(const LayerPlan& l) const {
    static constexpr CpuQ4Executor::Repacked::Layer kNotPacked{};
    return repacked.layers.empty() ? kNotPacked : repacked.layers[size_t(l.il)];
  }
  void norm_rows(const float* src, const TensorView& w, float* dst) const {
    const int64_t n_embd = hp().n_embd;
    for (int64_t t = 0; t < T; ++t) rms_norm_row(src + t * n_embd, f32_data(w), dst + t * n_embd, n_embd, hp().rms_eps);
  }

  void input_norm(const LayerPlan& l, LayerHalf half) {
    const LayerWeights& L = weights(l);
    norm_rows(x, half == LayerHalf::kAttention ? L.attn_norm : L.ffn_norm, xn);
  }

  void attention_inputs(const LayerPlan& l) {
    const LayerWeights& L = weights(l);
    const auto& RL = packed(l);
    s.prepared = {};
    matmul(pool, s, L.wq, xn, T, q, RL.wq);
    matmul(pool, s, L.wk, xn, T, kk, RL.wk);
    matmul(pool, s, L.wv, xn, T, v, RL.wv);
    const HParams& h = hp();
    const int64_t hd = h.head_dim, q_w = int64_t{h.n_head} * hd, kv_w = int64_t{h.n_head_kv} * hd;
    const int64_t half = h.n_rot / 2;
    const float* rope_l = l.swa ? in.rope_swa : in.rope;
    auto apply_rope = [&](float* vec, const float* c) {
      if (!l.neox) {
        for (int64_t i = 0; i < half; ++i) {
          const float x0 = vec[2 * i], x1 = vec[2 * i + 1];
          vec[2 * i] = x0 * c[i] - x1 * c[half + i];
          vec[2 * i + 1] = x0 * c[half + i] + x1 * c[i];
        }
      } else {
        for (int64_t i = 0; i < half; ++i) {
          const float x0 = vec[i], x1 = vec[i + half];
          vec[i] = x0 * c[i] - x1 * c[half + i];
          vec[i + half] = x0 * c[half + i] + x1 * c[i];
        }
      }
    };
    pool.parallel_for(T, 1, [&](int64_t b, int64_t e, int) {
      for (int64_t t = b; t < e; ++t) {
        float* qt = q + t * q_w;
        float* kt = kk + t * kv_w;
        float* vt = v + t * kv_w;
        if (l.qkv_bias) {
          for (int64_t i = 0; i < q_w; ++i) qt[i] += f32_data(L.bq)[i];
          for (int64_t i = 0; i < kv_w; ++i) kt[i] += f32_data(L.bk)[i];
          for (int64_t i = 0; i < kv_w; ++i) vt[i] += f32_data(L.bv)[i];
        }
        for (int64_t hh = 0; hh < h.n_head; ++hh) {
          if (l.q_norm) rms_norm_row(qt + hh * hd, f32_data(L.q_norm), qt + hh * hd, hd, h.rms_eps);
          apply_rope(qt + hh * hd, rope_l + t * h.n_rot);
        }
        if (l.q_scale != 1.0f)
          for (int64_t i = 0; i < q_w; ++i) qt[i] *= l.q_scale;
        for (int64_t hh = 0; hh < h.n_head_kv; ++hh) {
          if (l.k_norm) rms_norm_row(kt + hh * hd, f32_data(L.k_norm), kt + hh * hd, hd, h.rms_eps);
          apply_rope(kt + hh * hd, rope_l + t * h.n_rot);
        }
        // Store K and V of this position (f16 rounded to nearest even, Q8_0 blocks as
        // kernels::quantize_row_q8_0 makes them, or f32).
        const SequenceStep& sq = batch[size_t(in.seq[t])];
        const int32_t pos = in.pos[t];
        const KvStore& store = sq.kv->store();
        const KvLayout& layout = store.layout();
        const int32_t P = layout.page_size;
        const KvLayout::Place pl = layout.place(l.il);
        std::byte* page = store.page_data(sq.kv->page(pl.group, pos / P));
        std::byte* krow = page + layout.row_offset(pl.slot, 0, pos % P);
        std::byte* vrow = page + layout.row_offset(pl.slot, 1, pos % P);
        if (layout.dtype == KvDtype::kF16) {
          k::fp32_to_fp16_row(kt, reinterpret_cast<uint16_t*>(krow), kv_w);
          k::fp32_to_fp16_row(vt, reinterpret_cast<uint16_t*>(vrow), kv_w);
        } else if (layout.dtype == KvDtype::kQ8_0) {
          k::quantize_row_q8_0(kt, reinterpret_cast<k::BlockQ8_0*>(krow), kv_w);
          k::quantize_row_q8_0(vt, reinterpret_cast<k::BlockQ8_0*>(vrow), kv_w);
        } else {
          std::memcpy(krow, kt, size_t(kv_w) * sizeof(float));
          std::memcpy(vrow, vt, size_t(kv_w) * sizeof(float));
        }
      }
    });
  }

  // Causal GQA attention, tiled over the paged KV (kernels::attn_tiled); a task's query rows
  // are all the heads of its KV head at consecutive positions, so each K/V row is read once
  // per task. A long decode task with too few tasks to fill the threads runs as
  // kernels::attn_split_* phases over key ranges instead (the same bits).
  void attention(const LayerPlan& l) {
    const HParams& h = hp();
    const int64_t hd = h.head_dim, q_w = int64_t{h.n_head} * hd;
    const int64_t group = h.n_head / h.n_head_kv;
    size_t pg = 0;
    for (size_t si = 0; si < batch.size(); ++si) {
      const SequenceStep& sq = batch[si];
      const KvStore& store = sq.kv->store();
      const KvLayout& layout = store.layout();
      const int32_t n_pages =
          (sq.pos0 + static_cast<int32_t>(sq.tokens.size()) + layout.page_size - 1) / layout.page_size;
      seq_pages[si] = pg;
      const KvLayout::Place pl = layout.place(l.il);
      for (int32_t j = 0; j < n_pages; ++j, ++pg) {
        // A windowed layer's page out of the window is released (kNoPage): never read.
        const PageId id = sq.kv->page(pl.group, j);
        std::byte* page = id == kNoPage ? nullptr : store.page_data(id);
        kpages[pg] = page ? page + layout.row_offset(pl.slot, 0, 0) : nullptr;
        vpages[pg] = page ? page + layout.row_offset(pl.slot, 1, 0) : nullptr;
      }
    }
    auto args = [&](const AttnTask& at) {
      const SequenceStep& sq = batch[size_t(at.seq)];
      const KvLayout& layout = sq.kv->store().layout();
      k::FlashAttnArgs fa;
      fa.k_pages = kpages + seq_pages[size_t(at.seq)];
      fa.v_pages = vpages + seq_pages[size_t(at.seq)];
      fa.page_size = layout.page_size;
      fa.row_stride = static_cast<int64_t>(layout.row_elems());
      fa.head_offset = int64_t{at.kv_head} * hd;
      fa.kv_f16 = layout.dtype == KvDtype::kF16;
      fa.kv_q8_0 = layout.dtype == KvDtype::kQ8_0;
      fa.head_dim = hd;
      const int64_t row0 = seq_first_token[size_t(at.seq)] + at.first;
      fa.q = q + row0 * q_w + int64_t{at.kv_head} * group * hd;
      fa.out = attn + row0 * q_w + int64_t{at.kv_head} * group * hd;
      fa.q_stride = q_w;
      fa.pos0 = sq.pos0 + at.first;
      fa.n_pos = at.n_pos;
      fa.group = static_cast<int32_t>(group);
      fa.scale = l.kq_scale;
      fa.window = l.window;
      return fa;
    };
    auto split = [&](const AttnTask& at, const k::FlashAttnArgs& fa) {
      return at.split_slot >= 0 && k::attn_split_applies(fa) && k::attn_split_chunks(fa) >= kSplitMinChunks;
    };
    bool any_split = false;
    for (int64_t task = 0; task < n_attn_tasks && !any_split; ++task)
      any_split = split(attn_tasks[task], args(attn_tasks[task]));
    if (!any_split) {
      pool.parallel_for(n_attn_tasks, 1, [&](int64_t b, int64_t e, int th) {
        for (int64_t task = b; task < e; ++task)
          k::attn_tiled(args(attn_tasks[task]), fa_scratch + size_t(th) * fa_floats);
      });
      return;
    }
    // Flash decoding: the split tasks' scores over key ranges (beside the whole tasks), each
    // split task's softmax, its ranges' chunk parts, their sum in chunk order.
    const int64_t R = split_ranges;
    struct Slot {
      float *s, *range_max, *parts;
    };
    auto slot = [&](const AttnTask& at) {
      float* base = split_scratch + size_t(at.split_slot) * split_floats;
      return Slot{base, base + group * split_ld, base + group * split_ld + R * group};
    };
    auto chunks = [&](const k::FlashAttnArgs& fa, int64_t j) {
      const int64_t n = k::attn_split_chunks(fa);
      return std::pair{j * n / R, (j + 1) * n / R};
    };
    pool.parallel_for(n_attn_tasks * R, 1, [&](int64_t b, int64_t e, int th) {
      for (int64_t u = b; u < e; ++u) {
        const AttnTask& at = attn_tasks[u / R];
        const k::FlashAttnArgs fa = args(at);
        if (!split(at, fa)) {
          if (u % R == 0) k::attn_tiled(fa, fa_scratch + size_t(th) * fa_floats);
          continue;
        }
        const Slot sl = slot(at);
        const auto [c0, c1] = chunks(fa, u % R);
        k::attn_split_scores(fa, c0, c1, sl.s, split_ld, sl.range_max + (u % R) * group);
      }
    });
    pool.parallel_for(n_attn_tasks, 1, [&](int64_t b, int64_t e, int) {
      for (int64_t task = b; task < e; ++task) {
        const AttnTask& at = attn_tasks[task];
        const k::FlashAttnArgs fa = args(at);
        if (split(at, fa)) k::attn_split_softmax(fa, slot(at).s, split_ld, slot(at).range_max, R);
      }
    });
    pool.parallel_for(n_attn_tasks * R, 1, [&](int64_t b, int64_t e, int) {
      for (int64_t u = b; u < e; ++u) {
        const AttnTask& at = attn_tasks[u / R];
        const k::FlashAttnArgs fa = args(at);
        if (!split(at, fa)) continue;
        const auto [c0, c1] = chunks(fa, u % R);
        k::attn_split_wv(fa, c0, c1, slot(at).s, split_ld, slot(at).parts);
      }
    });
    pool.parallel_for(n_attn_tasks, 1, [&](int64_t b, int64_t e, int) {
      for (int64_t task = b; task < e; ++task) {
        const AttnTask& at = attn_tasks[task];
        const k::FlashAttnArgs fa = args(at);
        if (split(at, fa)) k::attn_split_combine(fa, slot(at).parts);
      }
    });
  }

  // x += [post_norm](W in): W in into tmp, normed in place, added.
  void residual(const LayerPlan& l, LayerHalf half) {
    const LayerWeights& L = weights(l);
    const auto& RL = packed(l);
    const bool attn_half = half == LayerHalf::kAttention;
    s.prepared = {};
    if (attn_half) {
      matmul(pool, s, L.wo, attn, T, tmp, RL.wo);
    } else {
      matmul(pool, s, L.ffn_down, gate, T, tmp, RL.ffn_down);
    }
    if (attn_half ? l.attn_post_norm : l.ffn_post_norm)
      norm_rows(tmp, attn_half ? L.attn_post_norm : L.ffn_post_norm, tmp);
    const int64_t n = T * hp().n_embd;
    for (int64_t i = 0; i < n; ++i) x[i] += tmp[i];
  }

  void ffn_inputs(const LayerPlan& l) {
    const LayerWeights& L = weights(l);
    const auto& RL = packed(l);
    s.prepared = {};
    matmul(pool, s, L.ffn_gate, xn, T, gate, RL.ffn_gate);
    matmul(pool, s, L.ffn_up, xn, T, up, RL.ffn_up);
  }

  void activation(const LayerPlan& l) {
    const uint16_t* gelu_table = l.gelu ? k::gelu_f16_table() : nullptr;
    pool.parallel_for(T * hp().n_ff, 256, [&](int64_t b, int64_t e, int) {
      if (gelu_table != nullptr) {
        k::geglu(gelu_table, gate + b, up + b, e - b);  // GELU(tanh)-gated (gemma3)
        return;
      }
      k::swiglu(gate + b, up + b, e - b);  // SwiGLU, the written SiLU
    });
  }

  // The final norm and the output projection for the logits rows only.
  void logits(float softcap) {
    if (n_out == 0) return;
    const HParams& h = hp();
    const int64_t n_embd = h.n_embd;
    float* rows = s.logits_in.get(size_t(n_out * n_embd));
    for (int64_t r = 0; r < n_out; ++r)
      rms_norm_row(x + in.out_row[r] * n_embd, f32_data(model.output_norm()), rows + r * n_embd, n_embd, h.rms_eps);
    s.prepared = {};
    matmul(pool, s, model.output(), rows, n_out, logits_out.data(),
           repacked.layers.empty() ? nullptr : repacked.output);
    if (softcap > 0.0f) {  // c * tanh(logits * (1 / c)), as three ggml ops
      const float c = softcap, inv = 1.0f / c;
      float* lg = logits_out.data();
      pool.parallel_for(n_out * h.n_vocab, 4096, [&](int64_t b, int64_t e, int) {
        for (int64_t i = b; i < e; ++i) lg[i] = std::tanh(lg[i] * inv) * c;
      });
    }
  }
};

}  // namespace

void CpuQ4Executor::step_impl(std::span<const SequenceStep> batch, std::span<float> logits) {
  Scratch& s = *s_;
  if (!k::cpu_thread_prepare()) {  // the calling thread's kernel scratch (allocated on its first step only)
    throw Error(ErrorCode::kOutOfMemory, "cpu executor: no memory for the kernels' per-thread scratch");
  }
  const Model& model = this->model();
  const HParams& hp = model.hparams();
  const int64_t n_embd = hp.n_embd;
  const int64_t hd = hp.head_dim;
  const int64_t q_w = int64_t{hp.n_head} * hd;
  const int64_t kv_w = int64_t{hp.n_head_kv} * hd;
  const int n_threads = pool_->size();
  const int64_t group = hp.n_head / hp.n_head_kv;

  CpuDecoder d{*pool_, s, model, *repacked_, batch, logits};
  d.T = step_token_rows(batch);
  d.n_out = logits_rows(batch);
  const int64_t T = d.T;
  // Scratch is sized for the largest context of the batch, so decode steps never regrow it.
  int64_t max_ctx = 1, max_kv_pages = 0;
  for (const auto& sq : batch) {
    max_ctx = std::max<int64_t>(max_ctx, sq.kv->max_tokens());
    const int32_t P = sq.kv->store().layout().page_size;
    max_kv_pages += (sq.kv->max_tokens() + P - 1) / P;
  }
  // Positions per attention task: about kAttnTileRows query rows, fewer when a long context
  // would make the task's scores (rows x context) pass kAttnScoreFloats.
  const int64_t attn_pos_per_task =
      std::max<int64_t>(1, std::min(kAttnTileRows / group, kAttnScoreFloats / (group * max_ctx)));
  for (const auto& sq : batch) {
    const auto n = static_cast<int64_t>(sq.tokens.size());
    d.n_attn_tasks += (n + attn_pos_per_task - 1) / attn_pos_per_task * hp.n_head_kv;
  }

  d.in.seq = s.seq.get(size_t(T));
  d.in.pos = s.pos.get(size_t(T));
  d.in.out_row = s.out_row.get(size_t(d.n_out));
  d.in.x = d.x = s.x.get(size_t(T * n_embd));
  d.in.rope = s.rope.get(size_t(T * hp.n_rot));
  d.in.rope_swa = has_sliding_window(hp) ? s.rope_swa.get(size_t(T * hp.n_rot)) : nullptr;
  fill_step_inputs(model, batch, d.in);
  d.xn = s.xn.get(size_t(T * n_embd));
  d.q = s.q.get(size_t(T * q_w));
  d.kk = s.kbuf.get(size_t(T * kv_w));
  d.v = s.v.get(size_t(T * kv_w));
  d.attn = s.attn.get(size_t(T * q_w));
  d.tmp = s.tmp.get(size_t(T * n_embd));
  d.gate = s.gate.get(size_t(T * hp.n_ff));
  d.up = s.up.get(size_t(T * hp.n_ff));
  d.fa_floats = k::attn_tiled_scratch_floats(hd, attn_pos_per_task * group, max_ctx);
  d.fa_scratch = s.fa_scratch.get(size_t(n_threads) * d.fa_floats);
  d.kpages = s.kv_pages.get(size_t(2 * max_kv_pages));
  d.vpages = d.kpages + max_kv_pages;
  d.seq_pages = s.seq_pages.get(batch.size());
  d.seq_first_token = s.seq_first_token.get(batch.size());
  d.attn_tasks = s.attn_tasks.get(size_t(d.n_attn_tasks));
  // Fewer than two attention tasks per thread: a long decode task's keys go in ranges, about
  // two per thread over the step's tasks (at most kSplitMinChunks: every range has a chunk).
  const int64_t two_per_thread = int64_t{2} * n_threads;
  if (n_threads > 1 && d.n_attn_tasks < two_per_thread)
    d.split_ranges = std::min<int64_t>(kSplitMinChunks, (two_per_thread + d.n_attn_tasks - 1) / d.n_attn_tasks);
  int32_t n_split_slots = 0;
  {
    // The longest tasks (latest positions) first, so the pool's threads end together.
    int64_t t = 0, first_token = 0;
    for (size_t si = 0; si < batch.size(); ++si) {
      d.seq_first_token[si] = first_token;
      const auto n = static_cast<int64_t>(batch[si].tokens.size());
      first_token += n;
      for (int64_t i0 = (n - 1) / attn_pos_per_task * attn_pos_per_task; i0 >= 0; i0 -= attn_pos_per_task)
        for (int32_t h = 0; h < hp.n_head_kv; ++h)
          d.attn_tasks[t++] =
              AttnTask{static_cast<int32_t>(si), h, static_cast<int32_t>(i0),
                       static_cast<int32_t>(std::min(attn_pos_per_task, n - i0)),
                       d.split_ranges > 1 && n == 1 && batch[si].pos0 + 1 >= kSplitMinChunks * k::kFlashAttnTile
                           ? n_split_slots++
                           : -1};
    }
  }

  if (n_split_slots > 0) {
    d.split_ld = (max_ctx + 15) / 16 * 16;
    const int64_t max_chunks = (max_ctx + k::kFlashAttnTile - 1) / k::kFlashAttnTile;
    d.split_floats = size_t(group * d.split_ld + d.split_ranges * group + max_chunks * group * hd);
    d.split_scratch = s.split_scratch.get(size_t(n_split_slots) * d.split_floats);
  }
  run_decoder(model, d);
  for (const auto& sq : batch) sq.kv->set_n_tokens(sq.pos0 + static_cast<int32_t>(sq.tokens.size()));
}

namespace {

void matmul(ThreadPool& pool, CpuQ4Executor::Scratch& s, const TensorView& W, const float* x, int64_t m, float* y,
            const void* packed) {
  const int64_t kdim = W.k;
  const int64_t n = W.n;
  PreparedInput& prep = s.prepared;
  if (prep.x != x || prep.m != m || prep.k != kdim) prep = PreparedInput{x, m, kdim, false, false};
  constexpr int64_t kRowGrain = 16;
  switch (W.type) {
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
    case GgmlType::kQ6_K:
    case GgmlType::kQ8_0: {
      const int64_t nb = kdim / k::kQK;
      k::BlockQ8_0* xq = s.xq8.get(size_t(m * nb));
      if (!prep.q8) {
        pool.parallel_for(m, 1, [&](int64_t b, int64_t e, int) {
          for (int64_t i = b; i < e; ++i) k::quantize_row_q8_0(x + i * kdim, xq + i * nb, kdim);
        });
        prep.q8 = true;
      }
      pool.parallel_for(n, kRowGrain, [&](int64_t b, int64_t e, int) {
        if (packed != nullptr && W.type == GgmlType::kQ4_1) {  // row chunks: multiples of kRowGrain (8 | 16)
          k::gemm_q4_1x8_q8_0(static_cast<const k::BlockQ4_1x8*>(packed), xq, y, kdim, m, n, b, e);
        } else if (packed != nullptr && W.type == GgmlType::kQ5_0) {
          k::gemm_q5_0x8_q8_0(static_cast<const k::BlockQ5_0x8*>(packed), xq, y, kdim, m, n, b, e);
        } else if (packed != nullptr && W.type == GgmlType::kQ4_K) {
          k::gemm_q4_kx8_q8_0(static_cast<const k::BlockQ4_Kx8*>(packed), xq, y, kdim, m, n, b, e);
        } else if (packed != nullptr && W.type == GgmlType::kQ6_K) {
          k::gemm_q6_kx8_q8_0(static_cast<const k::BlockQ6_Kx8*>(packed), xq, y, kdim, m, n, b, e);
        } else if (packed != nullptr) {
          k::gemm_q4_0x8_q8_0(static_cast<const k::BlockQ4_0x8*>(packed), xq, y, kdim, m, n, b, e);
        } else if (W.type == GgmlType::kQ4_0) {
          k::gemm_q4_0_q8_0(reinterpret_cast<const k::BlockQ4_0*>(W.data), xq, y, kdim, m, n, b, e);
        } else if (W.type == GgmlType::kQ4_1) {
          k::gemm_q4_1_q8_0(reinterpret_cast<const k::BlockQ4_1*>(W.data), xq, y, kdim, m, n, b, e);
        } else if (W.type == GgmlType::kQ5_0) {
          k::gemm_q5_0_q8_0(reinterpret_cast<const k::BlockQ5_0*>(W.data), xq, y, kdim, m, n, b, e);
        } else if (W.type == GgmlType::kQ5_1) {
          k::gemm_q5_1_q8_0(reinterpret_cast<const k::BlockQ5_1*>(W.data), xq, y, kdim, m, n, b, e);
        } else if (W.type == GgmlType::kQ4_K) {
          k::gemm_q4_k_q8_0(reinterpret_cast<const k::BlockQ4_K*>(W.data), xq, y, kdim, m, n, b, e);
        } else if (W.type == GgmlType::kQ5_K) {
          k::gemm_q5_k_q8_0(reinterpret_cast<const k::BlockQ5_K*>(W.data), xq, y, kdim, m, n, b, e);
        } else if (W.type == GgmlType::kQ6_K) {
          k::gemm_q6_k_q8_0(reinterpret_cast<const k::BlockQ6_K*>(W.data), xq, y, kdim, m, n, b, e);
        } else {
          k::gemm_q8_0_q8_0(reinterpret_cast<const k::BlockQ8_0*>(W.data), xq, y, kdim, m, n, b, e);
        }
      });
      break;
    }
    case GgmlType::kF16: {
      uint16_t* xh = s.xf16.get(size_t(m * kdim));
      if (!prep.f16) {
        k::fp32_to_fp16_row(x, xh, m * kdim);
        prep.f16 = true;
      }
      pool.parallel_for(n, kRowGrain, [&](int64_t b, int64_t e, int) {
        k::gemm_f16_f16(reinterpret_cast<const uint16_t*>(W.data), xh, y, kdim, m, n, b, e);
      });
      break;
    }
    case GgmlType::kBF16:
      pool.parallel_for(n, kRowGrain, [&](int64_t b, int64_t e, int) {
        k::gemm_bf16_f32(reinterpret_cast<const uint16_t*>(W.data), x, y, kdim, m, n, b, e);
      });
      break;
    case GgmlType::kF32:
      pool.parallel_for(n, kRowGrain, [&](int64_t b, int64_t e, int) {
        k::gemm_f32_f32(reinterpret_cast<const float*>(W.data), x, y, kdim, m, n, b, e);
      });
      break;
    default:
      break;  // Model::load converts every other type (model.hpp)
  }
}

}  // namespace

}  // namespace tandem
