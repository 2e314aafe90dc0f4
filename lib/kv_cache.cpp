#include "tandem/kv_cache.hpp"

#include <fmt/format.h>

#include <new>

namespace tandem {

KvLayout KvLayout::for_model(const HParams& hp, int32_t page_size, KvDtype dtype) {
  KvLayout l;
  l.n_layer = hp.n_layer;
  l.n_head_kv = hp.n_head_kv;
  l.head_dim = hp.head_dim;
  l.page_size = page_size;
  l.dtype = dtype;
  return l;
}

KvPagePool::KvPagePool(const KvLayout& layout, int32_t n_pages) : layout_(layout), n_pages_(n_pages) {
  if (n_pages <= 0 || layout.page_size <= 0 || layout.n_layer <= 0 || layout.n_head_kv <= 0 ||
      layout.head_dim <= 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("KV pool: page count {} and page size {} must be positive", n_pages,
                            layout.page_size));
  }
  try {
    data_.reset(new std::byte[size_t(n_pages) * layout.page_bytes()]());
    free_.reserve(size_t(n_pages));
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCode::kOutOfMemory,
                fmt::format("KV pool: cannot allocate {} pages of {} bytes", n_pages, layout.page_bytes()));
  }
  for (int32_t p = n_pages - 1; p >= 0; --p) free_.push_back(p);
}

int32_t KvPagePool::used() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return n_pages_ - static_cast<int32_t>(free_.size());
}

int32_t KvPagePool::allocate() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (free_.empty()) return -1;
  const int32_t p = free_.back();
  free_.pop_back();
  return p;
}

void KvPagePool::release(int32_t page) {
  std::lock_guard<std::mutex> lock(mutex_);
  free_.push_back(page);
}

KvSequence::KvSequence(KvPagePool& pool, int32_t max_tokens) : pool_(&pool), max_tokens_(max_tokens) {
  if (max_tokens <= 0) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("KV sequence: max_tokens {} must be positive", max_tokens));
  }
  const int32_t ps = pool.layout().page_size;
  block_table_.reserve(size_t((max_tokens + ps - 1) / ps));
}

KvSequence::~KvSequence() { truncate(0); }

void KvSequence::reserve(int32_t n) {
  if (n > max_tokens_) {
    throw Error(ErrorCode::kContextOverflow,
                fmt::format("context overflow: {} positions needed, the context holds {}", n, max_tokens_));
  }
  const int32_t ps = pool_->layout().page_size;
  const size_t need = size_t((n + ps - 1) / ps);
  const size_t had = block_table_.size();
  while (block_table_.size() < need) {
    const int32_t p = pool_->allocate();
    if (p < 0) {
      while (block_table_.size() > had) {
        pool_->release(block_table_.back());
        block_table_.pop_back();
      }
      throw Error(ErrorCode::kOutOfMemory,
                  fmt::format("KV pool exhausted: {} pages needed for {} positions, {} of {} in use",
                              need, n, pool_->used(), pool_->capacity()));
    }
    block_table_.push_back(p);
  }
}

void KvSequence::truncate(int32_t n) {
  if (n < 0) n = 0;
  if (n < n_tokens_) n_tokens_ = n;
  const int32_t ps = pool_->layout().page_size;
  const size_t keep = size_t((n + ps - 1) / ps);
  while (block_table_.size() > keep) {
    pool_->release(block_table_.back());
    block_table_.pop_back();
  }
}

}  // namespace tandem
