// Paged KV cache (host memory).
//
// A page holds `page_size` consecutive token positions of K and V for every layer. Page
// layout (elements of `dtype`): for layer l, K then V, each [page_size][n_head_kv][head_dim]:
//   offset(l, kind, slot, head) = ((l * 2 + kind) * page_size + slot) * n_head_kv * head_dim
//                                 + head * head_dim
// A sequence owns a block table: the page holding positions [i * page_size, (i+1) *
// page_size) is block_table[i]. Executors read and write KV only through block tables,
// so a sequence's pages need not be contiguous.
//
// Thread-safety: KvPagePool::allocate/release are internally locked (called when a
// sequence grows by a page, i.e. once every page_size tokens, never per token); page
// contents are written only by the executor step that owns the sequence.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "tandem/model.hpp"

namespace tandem {

enum class KvDtype { kF16, kF32 };

struct KvLayout {
  int32_t n_layer = 0;
  int32_t n_head_kv = 0;
  int32_t head_dim = 0;
  int32_t page_size = 16;  ///< tokens per page
  KvDtype dtype = KvDtype::kF16;

  static KvLayout for_model(const HParams& hp, int32_t page_size = 16, KvDtype dtype = KvDtype::kF16);
  size_t elem_bytes() const noexcept { return dtype == KvDtype::kF16 ? 2 : 4; }
  /// Elements of one K (or V) row of one token in one layer: n_head_kv * head_dim.
  size_t row_elems() const noexcept { return size_t(n_head_kv) * size_t(head_dim); }
  size_t page_bytes() const noexcept {
    return size_t(n_layer) * 2 * size_t(page_size) * row_elems() * elem_bytes();
  }
  /// Byte offset inside a page of the K (kind 0) or V (kind 1) row of `slot` in `layer`.
  size_t row_offset(int32_t layer, int kind, int32_t slot) const noexcept {
    return ((size_t(layer) * 2 + size_t(kind)) * size_t(page_size) + size_t(slot)) * row_elems() *
           elem_bytes();
  }
};

/// A fixed-capacity pool of pages in host memory, allocated once.
class KvPagePool {
 public:
  /// Throws Error(kInvalidArgument) for a zero page count or page size, kOutOfMemory when
  /// the pool cannot be allocated.
  KvPagePool(const KvLayout& layout, int32_t n_pages);
  const KvLayout& layout() const noexcept { return layout_; }
  int32_t capacity() const noexcept { return n_pages_; }
  int32_t used() const;
  /// Returns a page id, or -1 when the pool is exhausted.
  int32_t allocate();
  void release(int32_t page);
  std::byte* page_data(int32_t page) noexcept { return data_.get() + size_t(page) * layout_.page_bytes(); }
  const std::byte* page_data(int32_t page) const noexcept {
    return data_.get() + size_t(page) * layout_.page_bytes();
  }

 private:
  KvLayout layout_;
  int32_t n_pages_;
  std::unique_ptr<std::byte[]> data_;
  mutable std::mutex mutex_;
  std::vector<int32_t> free_;
};

/// One sequence's KV: its block table and the number of positions filled.
/// Move-only; the destructor returns every page to the pool.
class KvSequence {
 public:
  /// `max_tokens` bounds the sequence (the context size); the block table is reserved
  /// for it up front so growing never allocates.
  KvSequence(KvPagePool& pool, int32_t max_tokens);
  ~KvSequence();
  KvSequence(const KvSequence&) = delete;
  KvSequence& operator=(const KvSequence&) = delete;

  KvPagePool& pool() const noexcept { return *pool_; }
  int32_t n_tokens() const noexcept { return n_tokens_; }
  int32_t max_tokens() const noexcept { return max_tokens_; }
  const std::vector<int32_t>& block_table() const noexcept { return block_table_; }

  /// Make room for positions [0, n). Throws Error(kContextOverflow) when n > max_tokens,
  /// Error(kOutOfMemory) when the pool has no free page (nothing is changed then).
  void reserve(int32_t n);
  /// Mark positions [0, n) as filled (n <= reserved capacity). Called by executors.
  void set_n_tokens(int32_t n) noexcept { n_tokens_ = n; }
  /// Forget positions >= n and release pages no longer needed.
  void truncate(int32_t n);

 private:
  KvPagePool* pool_;
  int32_t max_tokens_;
  int32_t n_tokens_ = 0;
  std::vector<int32_t> block_table_;
};

}  // namespace tandem
