// The GPU test harnesses (gpu_hooks.hpp) over the executor's internals (lib/exec/gpu/
// gpu_internal.hpp) and the kernels/cuda launchers.
#include "gpu_hooks.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/cpu_kernels.hpp"
#include "cuda/cuda_kernels.hpp"
#include "exec/gpu/gpu_internal.hpp"
#include "quant_blocks.hpp"
#include "tandem/core/error.hpp"
#include "tandem/exec/gpu/gpu_q4_executor.hpp"

namespace tandem::gpu_testing {

namespace ck = kernels::cuda;
using gpu_detail::attention_setup_once;
using gpu_detail::DevBuf;
using gpu_detail::DeviceGuard;

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

// GGUF blocks of `type` [n][nb] -> the device layout (block_math.cuh), as the executor uploads them.
struct QuantBufs {
  DevBuf qs, d, m, qh, sc;
};
ck::DevWeight upload_quant_weight(GgmlType type, const void* blocks, int64_t n, int64_t k, QuantBufs& b) {
  ck::WType wtype = ck::WType::kQ4_0;
  if (!gpu_detail::gpu_quant_type(type, wtype)) {
    throw Error(ErrorCode::kInvalidArgument, "gpu_testing: no GPU kernel for this weight type");
  }
  if (k % ggml_block_elements(type) != 0) {
    throw Error(ErrorCode::kInvalidArgument, "gpu_testing: k is not a whole number of the type's blocks");
  }
  const auto s = gpu_detail::split_blocks(wtype, static_cast<const std::byte*>(blocks), n, k,
                                          size_t(k / ggml_block_elements(type)) * size_t(ggml_block_bytes(type)));
  to_device(b.qs, s.qs.data(), s.qs.size());
  to_device(b.d, s.d.data(), s.d.size());
  to_device(b.m, s.m.data(), s.m.size());
  to_device(b.qh, s.qh.data(), s.qh.size());
  to_device(b.sc, s.sc.data(), s.sc.size());
  ck::DevWeight w;
  w.type = wtype;
  w.n = n;
  w.k = k;
  w.q = b.qs.as<void>();
  w.d = b.d.as<uint16_t>();
  if (!s.m.empty()) w.m = b.m.as<uint16_t>();
  if (!s.qh.empty()) w.qh = b.qh.as<uint32_t>();
  if (!s.sc.empty()) w.sc = b.sc.as<uint16_t>();
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

void geglu_q8_0(const float* gate, const float* up, int64_t n, bool fused, float* h, void* blocks_out, int device) {
  require_device(device);
  const DeviceGuard guard(device);
  const size_t nb = size_t(n) / kernels::kQK;
  DevBuf dg, du, dq(std::max<size_t>(nb, 1) * 32), dd(std::max<size_t>(nb, 1) * sizeof(uint16_t));
  DevBuf table(size_t(ck::kGeluTableSize) * sizeof(uint16_t));
  TANDEM_CUDA(cudaMemcpy(table.as<void>(), kernels::gelu_f16_table(), table.bytes(), cudaMemcpyHostToDevice));
  to_device(dg, gate, size_t(n));
  to_device(du, up, size_t(n));
  TANDEM_CUDA(cudaMemset(dq.as<void>(), 0x5A, dq.bytes()));
  TANDEM_CUDA(cudaMemset(dd.as<void>(), 0x5A, dd.bytes()));
  if (fused) {
    ck::geglu_q8_0(dg.as<float>(), du.as<float>(), n, table.as<uint16_t>(), dq.as<int8_t>(), dd.as<uint16_t>(),
                   nullptr);
  } else {
    ck::geglu(dg.as<float>(), du.as<float>(), n, table.as<uint16_t>(), nullptr);
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
  QuantBufs wb;
  DevBuf dx, dxq(std::max<size_t>(size_t(m * k), 1)), dxd(std::max<size_t>(size_t(m) * nb, 1) * 2),
      dy(std::max<size_t>(size_t(m * n), 1) * sizeof(float));
  const ck::DevWeight w = upload_quant_weight(GgmlType::kQ4_0, w_blocks, n, k, wb);
  to_device(dx, x, size_t(m * k));
  ck::fill_nan(dy.as<float>(), m * n, nullptr);
  ck::quantize_q8_0(dx.as<float>(), m, k, dxq.as<int8_t>(), dxd.as<uint16_t>(), nullptr);
  ck::gemm(w, dx.as<float>(), dxq.as<int8_t>(), dxd.as<uint16_t>(), m, dy.as<float>(), n, false, nullptr);
  TANDEM_CUDA(cudaGetLastError());
  to_host(y, dy, size_t(m * n));
}

void gemm_q8_blocks(GgmlType wtype, const void* w_blocks, int64_t n, int64_t k, const void* x_blocks, int64_t m,
                    bool tensor_cores, float* y, int device) {
  require_device(device);
  if (k <= 0 || k % kernels::kQK != 0 || n <= 0 || m <= 0) {
    throw Error(ErrorCode::kInvalidArgument, "gpu_testing: gemm_q8_blocks needs n, m >= 1 and k a multiple of 32");
  }
  std::vector<std::vector<float>> ys;  // one matrix through gemm(): the same launches
  gemm_parts_q8_blocks(wtype, {w_blocks}, {n}, k, x_blocks, m, false, tensor_cores, ys, {}, device);
  std::copy(ys[0].begin(), ys[0].end(), y);
}

void gemm_parts_q8_blocks(GgmlType wtype, const std::vector<const void*>& w_blocks, const std::vector<int64_t>& n,
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
  std::vector<QuantBufs> wb(count);
  std::vector<DevBuf> dy(count);
  std::vector<ck::DevWeight> w(count);
  std::vector<const ck::DevWeight*> wp(count);
  std::vector<float*> yp(count);
  for (size_t i = 0; i < count; ++i) {
    w[i] = upload_quant_weight(wtype, w_blocks[i], n[i], k, wb[i]);
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
  QuantBufs xb;
  const ck::DevWeight x = upload_quant_weight(GgmlType::kQ8_0, x_blocks, m, k, xb);
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
                       void* q8_blocks_out, int device, int32_t window) {
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
  if (mode == 2 && (part <= 0 || part % ck::kAttentionChunk != 0)) {
    throw Error(ErrorCode::kInvalidArgument, "gpu_testing: the split partition must be a multiple of the chunk");
  }
  if (window < 0) throw Error(ErrorCode::kInvalidArgument, "gpu_testing: negative window");
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
  ck::KvArgs kv = layer1_kv_args(dtable, doff, dpos, page_size, n_head_kv, head_dim, f16);
  kv.window = window;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  if (mode == 2) {
    const int32_t max_parts = (max_pos + part - 1) / part;
    const int32_t max_chunks = (max_pos + ck::kAttentionChunk - 1) / ck::kAttentionChunk;
    const size_t heads = size_t(T) * size_t(n_head);
    DevBuf acc(heads * size_t(max_chunks) * size_t(head_dim) * 4), mx(heads * size_t(max_parts) * 4),
        score(heads * size_t(max_pos) * 4);
    ck::AttentionSplitScratch sc;
    sc.acc = acc.as<float>();
    sc.max = mx.as<float>();
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
                      int32_t part, int32_t page_shift, void* q8_blocks_out, int device, int32_t window) {
  const std::vector<int32_t> chunks(lens.size(), 1);
  attention_harness(n_head, n_head_kv, head_dim, page_size, f16, lens, chunks, q, k, v, out, part > 0 ? 2 : 0, part,
                    page_shift, q8_blocks_out, device, window);
}

void attention_prefill(int32_t n_head, int32_t n_head_kv, int32_t head_dim, int32_t page_size, bool f16,
                       const std::vector<int32_t>& lens, const std::vector<int32_t>& chunks, const float* q,
                       const float* k, const float* v, float* out, bool tiled, int32_t page_shift, int device,
                       int32_t window) {
  attention_harness(n_head, n_head_kv, head_dim, page_size, f16, lens, chunks, q, k, v, out, tiled ? 1 : 0, 0,
                    page_shift, nullptr, device, window);
}

}  // namespace tandem::gpu_testing
