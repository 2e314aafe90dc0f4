#include "tandem/kv/kv_store.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <numeric>

#include "kv/kv_page_file.hpp"

namespace tandem {

std::string_view kv_tier_name(KvTier t) noexcept {
  switch (t) {
    case KvTier::kDevice:
      return "device";
    case KvTier::kHost:
      return "host";
    case KvTier::kFile:
      return "file";
  }
  return "?";
}

std::string_view kv_dtype_name(KvDtype d) noexcept {
  switch (d) {
    case KvDtype::kF16:
      return "f16";
    case KvDtype::kF32:
      return "f32";
    case KvDtype::kQ8_0:
      return "q8_0";
  }
  return "?";
}

bool kv_dtype_from_name(std::string_view name, KvDtype& out) noexcept {
  for (KvDtype d : {KvDtype::kF16, KvDtype::kF32, KvDtype::kQ8_0}) {
    if (name == kv_dtype_name(d)) {
      out = d;
      return true;
    }
  }
  return false;
}

uint64_t kv_row_bytes(KvDtype d, uint64_t elems) noexcept {
  switch (d) {
    case KvDtype::kF16:
      return elems * 2;
    case KvDtype::kF32:
      return elems * 4;
    case KvDtype::kQ8_0:
      return elems % kKvQ8Block == 0 ? elems / kKvQ8Block * kKvQ8BlockBytes : 0;
  }
  return 0;
}

// ------------------------------------------------------------------------------ tiers

struct KvStore::Tier {
  KvTier kind;
  int32_t capacity = 0;
  int32_t used = 0;
  int32_t reserved = 0;
  size_t page_bytes = 0;
  std::vector<int32_t> free_slots;  // a stack; lowest slot on top so files grow in order
  // Host
  std::unique_ptr<std::byte[]> host;
  // File
  std::filesystem::path path;
  int fd = -1;
  int32_t chunk_pages = 0;
  std::vector<std::byte*> chunks;  // mapped chunks, each chunk_pages pages
  // Device
  std::unique_ptr<KvDeviceBackend> device;

  Tier(KvTier k, int32_t cap, size_t pb) : kind(k), capacity(cap), page_bytes(pb) {
    free_slots.reserve(size_t(cap));
    for (int32_t s = cap - 1; s >= 0; --s) free_slots.push_back(s);
  }
  ~Tier() {
    for (std::byte* c : chunks) {
      if (c) ::munmap(c, size_t(chunk_pages) * page_bytes);
    }
    if (fd >= 0) ::close(fd);  // the file has no name (kv_page_file.hpp): closing frees it
  }

  // Host address of a slot (mapping the File chunk on first use); nullptr on Device.
  std::byte* slot_ptr(int32_t slot) {
    if (kind == KvTier::kHost) return host.get() + size_t(slot) * page_bytes;
    if (kind == KvTier::kDevice) return nullptr;
    const size_t c = size_t(slot / chunk_pages);
    if (c >= chunks.size()) chunks.resize(c + 1, nullptr);
    if (!chunks[c]) {
      const size_t chunk_bytes = size_t(chunk_pages) * page_bytes;
      // Allocate the chunk's blocks now (a full disk fails here, not with SIGBUS on a
      // later page fault) and map it pre-faulted, so page moves are plain copies.
      grow_kv_page_file(fd, path, static_cast<off_t>(c * chunk_bytes), static_cast<off_t>(chunk_bytes));
      void* p = ::mmap(nullptr, chunk_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                       static_cast<off_t>(c * chunk_bytes));
      if (p == MAP_FAILED) {
        throw Error(ErrorCode::kIo, fmt::format("KV file tier: cannot map chunk {} of '{}': {}", c, path.string(),
                                                errno_message(errno)));
      }
      chunks[c] = static_cast<std::byte*>(p);
    }
    return chunks[c] + size_t(slot % chunk_pages) * page_bytes;
  }

  // Maps (on File: allocates blocks for) the next `n` free slots, so that taking them
  // cannot fail: a full disk throws kIo here, before any page or count has changed.
  void prepare_free_slots(int32_t n) {
    const size_t k = std::min(free_slots.size(), size_t(std::max(n, 0)));
    for (size_t i = 0; i < k; ++i) slot_ptr(free_slots[free_slots.size() - 1 - i]);
  }
};

KvStore::KvStore(KvStoreOptions options) : layout_(options.layout) {
  const KvLayout& l = layout_;
  if (l.n_layer <= 0 || l.n_head_kv <= 0 || l.head_dim <= 0 || l.page_size <= 0 || l.layer_begin < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("KV store: layout needs positive n_layer ({}), n_head_kv ({}), head_dim ({}), "
                            "page_size ({})",
                            l.n_layer, l.n_head_kv, l.head_dim, l.page_size));
  }
  if (l.row_bytes() == 0) {
    throw Error(
        ErrorCode::kInvalidArgument,
        fmt::format("KV store: a {} KV row of {} KV heads x {} dims = {} elements is not a whole number of "
                    "32-element Q8_0 blocks (or the dtype {} is unknown)",
                    kv_dtype_name(l.dtype), l.n_head_kv, l.head_dim, l.row_elems(), static_cast<uint32_t>(l.dtype)));
  }
  if (options.host_pages < 0 || options.file_pages < 0 || options.file_chunk_pages <= 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("KV store: host_pages {} and file_pages {} must be >= 0, file_chunk_pages {} > 0",
                            options.host_pages, options.file_pages, options.file_chunk_pages));
  }
  const size_t pb = l.page_bytes();
  const int32_t device_pages = options.device ? options.device->capacity_pages() : 0;
  tiers_[int(KvTier::kDevice)] = std::make_unique<Tier>(KvTier::kDevice, device_pages, pb);
  tiers_[int(KvTier::kDevice)]->device = std::move(options.device);
  tiers_[int(KvTier::kHost)] = std::make_unique<Tier>(KvTier::kHost, options.host_pages, pb);
  tiers_[int(KvTier::kFile)] = std::make_unique<Tier>(KvTier::kFile, options.file_pages, pb);
  try {
    if (options.host_pages > 0) tiers_[int(KvTier::kHost)]->host.reset(new std::byte[size_t(options.host_pages) * pb]);
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCode::kOutOfMemory,
                fmt::format("KV store: cannot allocate {} host pages of {} bytes", options.host_pages, pb));
  }
  if (options.file_pages > 0) {
    Tier& f = *tiers_[int(KvTier::kFile)];
    f.chunk_pages = options.file_chunk_pages;
    f.fd = create_kv_page_file(kv_page_file_dir(options.file_dir), f.path);
  }
  n_entries_ = device_pages + options.host_pages + options.file_pages;
  entries_ = std::make_unique<Entry[]>(size_t(n_entries_));
  free_ids_.reserve(size_t(n_entries_));
  for (PageId id = n_entries_ - 1; id >= 0; --id) free_ids_.push_back(id);
}

KvStore::~KvStore() = default;

KvTierUsage KvStore::usage(KvTier tier) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Tier& t = *tiers_[int(tier)];
  KvTierUsage u;
  u.capacity = t.capacity;
  u.used = t.used;
  u.reserved = t.reserved;
  u.used_bytes = uint64_t(t.used) * layout_.page_bytes();
  return u;
}

int32_t KvStore::used_pages() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int32_t n = 0;
  for (const auto& t : tiers_) n += t->used;
  return n;
}

bool KvStore::has_tier(KvTier tier) const noexcept {
  return tiers_[int(tier)]->capacity > 0;
}

std::filesystem::path KvStore::file_path() const {
  return tiers_[int(KvTier::kFile)]->path;
}

size_t KvStore::sequence_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return sequences_.size();
}

PageId KvStore::allocate(KvTier tier, bool from_reservation) {
  std::lock_guard<std::mutex> lock(mutex_);
  return allocate_locked(tier, from_reservation);
}

PageId KvStore::allocate_locked(KvTier tier, bool from_reservation) {
  Tier& t = *tiers_[int(tier)];
  if (from_reservation ? t.reserved <= 0 : t.capacity - t.used - t.reserved <= 0) return -1;
  const int32_t slot = t.free_slots.back();
  std::byte* p = t.slot_ptr(slot);  // may throw kIo (file tier growth); nothing changed yet
  t.free_slots.pop_back();
  if (from_reservation) --t.reserved;
  ++t.used;
  const PageId id = free_ids_.back();
  free_ids_.pop_back();
  Entry& e = entries_[size_t(id)];
  e.data.store(p, std::memory_order_release);
  e.tier.store(tier, std::memory_order_release);
  e.slot = slot;
  e.refs = 1;
  if (p) std::memset(p, 0, layout_.page_bytes());
  return id;
}

void KvStore::retain(PageId page) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++entries_[size_t(page)].refs;
}

void KvStore::release(PageId page) {
  std::lock_guard<std::mutex> lock(mutex_);
  release_locked(page);
}

void KvStore::release_locked(PageId page) {
  Entry& e = entries_[size_t(page)];
  if (--e.refs > 0) return;
  Tier& t = *tiers_[int(e.tier.load())];
  t.free_slots.push_back(e.slot);
  --t.used;
  e.slot = -1;
  e.data.store(nullptr, std::memory_order_release);
  free_ids_.push_back(page);
}

int32_t KvStore::refcount(PageId page) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_[size_t(page)].refs;
}

KvTier KvStore::tier_of(PageId page) const {
  return entries_[size_t(page)].tier.load(std::memory_order_acquire);
}

std::byte* KvStore::page_data(PageId page) const noexcept {
  return entries_[size_t(page)].data.load(std::memory_order_acquire);
}

int32_t KvStore::device_slot(PageId page) const noexcept {
  const Entry& e = entries_[size_t(page)];
  return e.tier.load(std::memory_order_acquire) == KvTier::kDevice ? e.slot.load(std::memory_order_acquire) : -1;
}

KvDeviceBackend* KvStore::device_backend() const noexcept {
  return tiers_[int(KvTier::kDevice)]->device.get();
}

void KvStore::read_page(PageId page, std::byte* dst) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Entry& e = entries_[size_t(page)];
  const KvTier tier = e.tier.load();
  if (tier == KvTier::kDevice) {
    tiers_[int(tier)]->device->copy_to_host(e.slot, dst, layout_.page_bytes());
  } else {
    std::memcpy(dst, e.data.load(), layout_.page_bytes());
  }
}

void KvStore::write_page(PageId page, const std::byte* src) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Entry& e = entries_[size_t(page)];
  const KvTier tier = e.tier.load();
  if (tier == KvTier::kDevice) {
    tiers_[int(tier)]->device->copy_to_device(e.slot, src, layout_.page_bytes());
  } else {
    std::memcpy(e.data.load(), src, layout_.page_bytes());
  }
}

void KvStore::copy_page_locked(int32_t src_tier, int32_t src_slot, int32_t dst_tier, int32_t dst_slot) {
  Tier& s = *tiers_[src_tier];
  Tier& d = *tiers_[dst_tier];
  const size_t pb = layout_.page_bytes();
  if (s.kind == KvTier::kDevice && d.kind == KvTier::kDevice) {
    s.device->copy_device_to_device(dst_slot, src_slot, pb);
  } else if (s.kind == KvTier::kDevice) {
    s.device->copy_to_host(src_slot, d.slot_ptr(dst_slot), pb);
  } else if (d.kind == KvTier::kDevice) {
    d.device->copy_to_device(dst_slot, s.slot_ptr(src_slot), pb);
  } else {
    std::memcpy(d.slot_ptr(dst_slot), s.slot_ptr(src_slot), pb);
  }
}

KvMoveStats KvStore::move_pages(std::span<const PageId> pages, KvTier dst) {
  std::lock_guard<std::mutex> lock(mutex_);
  return move_pages_locked(pages, dst, false);
}

KvMoveStats KvStore::move_pages_locked(std::span<const PageId> pages, KvTier dst, bool exclusive_only) {
  const auto t0 = std::chrono::steady_clock::now();
  Tier& d = *tiers_[int(dst)];
  int32_t need = 0;
  for (PageId p : pages) {
    const Entry& e = entries_[size_t(p)];
    if (e.tier.load() != dst && (!exclusive_only || e.refs == 1)) ++need;
  }
  KvMoveStats stats;
  if (need == 0) return stats;
  if (d.capacity - d.used - d.reserved < need) {
    throw Error(ErrorCode::kOutOfMemory,
                fmt::format("KV store: {} pages do not fit in the {} tier ({} of {} used, {} reserved)", need,
                            kv_tier_name(dst), d.used, d.capacity, d.reserved));
  }
  // Map (and, on File, allocate blocks for) every destination slot first: a full disk
  // refuses the whole move before any page has changed tier.
  d.prepare_free_slots(need);
  for (PageId p : pages) {
    Entry& e = entries_[size_t(p)];
    const KvTier src = e.tier.load();
    if (src == dst || (exclusive_only && e.refs != 1)) continue;
    Tier& s = *tiers_[int(src)];
    const int32_t slot = d.free_slots.back();
    std::byte* dp = d.slot_ptr(slot);
    d.free_slots.pop_back();
    ++d.used;
    copy_page_locked(int(src), e.slot, int(dst), slot);
    s.free_slots.push_back(e.slot);
    --s.used;
    e.slot = slot;
    e.data.store(dp, std::memory_order_release);
    e.tier.store(dst, std::memory_order_release);
    ++stats.pages;
  }
  stats.bytes = uint64_t(stats.pages) * layout_.page_bytes();
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

void KvStore::reserve(KvTier tier, int32_t n_pages) {
  std::lock_guard<std::mutex> lock(mutex_);
  Tier& t = *tiers_[int(tier)];
  if (n_pages < 0 || t.capacity - t.used - t.reserved < n_pages) {
    throw Error(ErrorCode::kOutOfMemory, fmt::format("KV store: cannot reserve {} pages of the {} tier ({} free)",
                                                     n_pages, kv_tier_name(tier), t.capacity - t.used - t.reserved));
  }
  t.reserved += n_pages;
}

void KvStore::unreserve(KvTier tier, int32_t n_pages) {
  std::lock_guard<std::mutex> lock(mutex_);
  Tier& t = *tiers_[int(tier)];
  t.reserved -= std::min(n_pages, t.reserved);
}

void KvStore::register_sequence(KvSequence* s) {
  std::lock_guard<std::mutex> lock(mutex_);
  sequences_.push_back(s);
}

void KvStore::unregister_sequence(KvSequence* s) {
  std::lock_guard<std::mutex> lock(mutex_);
  sequences_.erase(std::remove(sequences_.begin(), sequences_.end(), s), sequences_.end());
}

uint64_t KvStore::next_use() {
  return use_clock_.fetch_add(1, std::memory_order_relaxed) + 1;
}

int32_t KvStore::evict_lru(KvTier from, KvTier to, int32_t pages_needed, const KvSequence* keep) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<KvSequence*> candidates;
  for (KvSequence* s : sequences_) {
    if (s != keep && !s->pinned() && s->tier() == from) candidates.push_back(s);
  }
  std::sort(candidates.begin(), candidates.end(),
            [](const KvSequence* a, const KvSequence* b) { return a->last_use() < b->last_use(); });
  int32_t freed = 0;
  for (KvSequence* s : candidates) {
    if (freed >= pages_needed) break;
    Tier& d = *tiers_[int(to)];
    const std::vector<PageId> held = s->held_page_ids();
    int32_t exclusive = 0;
    for (PageId p : held) exclusive += entries_[size_t(p)].refs == 1 ? 1 : 0;
    if (exclusive == 0 || d.capacity - d.used - d.reserved < exclusive) continue;
    // Only pages this sequence holds alone move: pages shared with others stay for them.
    freed += move_pages_locked(held, to, true).pages;
    s->tier_ = to;
    // Its unused reservation belonged to `from`: return it there (an evicted sequence
    // reserves again when it is brought back).
    Tier& f = *tiers_[int(from)];
    f.reserved -= std::min(s->reserved_, f.reserved);
    s->reserved_ = 0;
  }
  return freed;
}

// ------------------------------------------------------------------------- layout

int32_t KvLayout::n_window_layers() const noexcept {
  if (window <= 0 || window_pattern <= 0 || n_layer <= 0) return 0;
  // Full layers below x: those j < x with j % pattern == pattern - 1, floor(x / pattern).
  const int32_t full = (layer_begin + n_layer) / window_pattern - layer_begin / window_pattern;
  return n_layer - full;
}

int32_t KvLayout::page_layers() const noexcept {
  const int32_t w = n_window_layers();
  return w == 0 || w == n_layer ? n_layer : std::gcd(w, n_layer - w);
}

KvLayout::Place KvLayout::place(int32_t il) const noexcept {
  const int32_t w = n_window_layers();
  const int32_t rel = il - layer_begin;
  if (w == 0 || w == n_layer) return {0, rel};
  const int32_t pl = std::gcd(w, n_layer - w);
  const int32_t full_before = il / window_pattern - layer_begin / window_pattern;
  if (!is_window_layer(il)) return {full_before / pl, full_before % pl};
  const int32_t idx = rel - full_before;
  return {(n_layer - w) / pl + idx / pl, idx % pl};
}

int32_t KvLayout::window_live_page(int64_t n) const noexcept {
  if (n_window_layers() == 0 || page_size <= 0) return 0;
  return static_cast<int32_t>(std::max<int64_t>(0, n - window + 1 - window_slack) / page_size);
}

int64_t KvLayout::pages_holding(int64_t n) const noexcept {
  if (page_size <= 0 || page_layers() <= 0) return 0;
  const int64_t pages = (n + page_size - 1) / page_size;
  return n_groups() * pages - int64_t{n_groups() - n_full_groups()} * window_live_page(n);
}

int64_t KvLayout::sequence_pages(int64_t n_ctx, int64_t max_step) const noexcept {
  if (page_size <= 0 || page_layers() <= 0) return 0;
  const int64_t full = (n_ctx + page_size - 1) / page_size + 1;
  const int64_t windowed = std::min(full, (window - 1 + window_slack + max_step + page_size - 1) / page_size + 2);
  const int64_t wg = n_groups() - n_full_groups();
  return n_full_groups() * full + wg * windowed;
}

// ------------------------------------------------------------------------- sequences

KvSequence::KvSequence(KvStore& store, int32_t max_tokens, KvTier tier)
    : store_(&store), id_(store.next_sequence_id_.fetch_add(1)), max_tokens_(max_tokens), tier_(tier) {
  if (max_tokens <= 0) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("KV sequence: max_tokens {} must be positive", max_tokens));
  }
  if (!store.has_tier(tier)) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("KV sequence: the store has no {} tier", kv_tier_name(tier)));
  }
  const KvLayout& l = store.layout();
  n_groups_ = l.n_groups();
  cap_ = size_t((int64_t{max_tokens} + l.page_size - 1) / l.page_size);
  table_.assign(size_t(n_groups_) * cap_, kNoPage);
  touch();
  store.register_sequence(this);
}

KvSequence::~KvSequence() {
  store_->unregister_sequence(this);
  truncate(0);
  if (reserved_ > 0) store_->unreserve(tier_, reserved_);
}

void KvSequence::touch() noexcept {
  last_use_.store(store_->next_use(), std::memory_order_relaxed);
}

int32_t KvSequence::held_pages() const noexcept {
  const KvLayout& l = store_->layout();
  return n_groups_ * n_pages_ - (l.n_groups() - l.n_full_groups()) * dropped_;
}

std::vector<PageId> KvSequence::held_page_ids() const {
  std::vector<PageId> ids;
  ids.reserve(size_t(held_pages()));
  for (int32_t g = 0; g < n_groups_; ++g) {
    for (PageId p : block_table(g)) {
      if (p != kNoPage) ids.push_back(p);
    }
  }
  return ids;
}

bool KvSequence::holds_prefix(int32_t n) const noexcept {
  if (n < 0 || n > n_tokens_) return false;
  const KvLayout& l = store_->layout();
  return n == 0 || l.n_window_layers() == 0 || std::max(0, n - l.window + 1) >= window_from_;
}

int32_t KvSequence::pages_outside(KvTier tier) const noexcept {
  int32_t n = 0;
  for (int32_t g = 0; g < n_groups_; ++g) {
    for (PageId p : block_table(g)) n += p != kNoPage && store_->tier_of(p) != tier ? 1 : 0;
  }
  return n;
}

void KvSequence::reserve(int32_t n) {
  if (n > max_tokens_) {
    throw Error(ErrorCode::kContextOverflow,
                fmt::format("context overflow: {} positions needed, the context holds {}", n, max_tokens_));
  }
  const KvLayout& l = store_->layout();
  const int32_t ps = l.page_size;
  const int32_t need = (n + ps - 1) / ps;
  const int32_t live = l.window_live_page(n_tokens_);
  const bool cow_check = shares_pages_.load(std::memory_order_acquire) && n > n_tokens_ && n_tokens_ % ps != 0;
  if (need <= n_pages_ && !cow_check && live <= dropped_) return;  // the per-token fast path: no lock
  std::lock_guard<std::mutex> lock(store_->mutex_);
  grow_locked(n, live);
}

void KvSequence::reserve_filled(int32_t n, int32_t window_from) {
  const KvLayout& l = store_->layout();
  if (n_tokens_ != 0 || n_pages_ != 0) {
    throw Error(ErrorCode::kInvalidArgument, "KV sequence: reserve_filled needs an empty sequence");
  }
  if (window_from < 0 || (l.n_window_layers() > 0 && window_from > std::max(0, n - l.window + 1))) {
    throw Error(
        ErrorCode::kInvalidArgument,
        fmt::format("KV sequence: windowed rows from position {} miss what a query at {} sees", window_from, n));
  }
  if (n > max_tokens_) {
    throw Error(ErrorCode::kContextOverflow,
                fmt::format("context overflow: {} positions needed, the context holds {}", n, max_tokens_));
  }
  std::lock_guard<std::mutex> lock(store_->mutex_);
  grow_locked(n, l.n_window_layers() > 0 ? std::max(l.window_live_page(n), window_from / l.page_size) : 0);
  window_from_ = std::max(window_from_, window_from);
  n_tokens_ = n;
}

void KvSequence::grow_locked(int32_t n, int32_t live) {
  const KvLayout& l = store_->layout();
  const int32_t ps = l.page_size;
  const int32_t need = (n + ps - 1) / ps;
  const int32_t first_windowed = l.n_full_groups();
  // Windowed pages no later query sees: released (an empty sequence just skips them).
  if (n_pages_ == 0) {
    dropped_ = std::min(live, need);
  } else {
    for (; dropped_ < std::min(live, n_pages_); ++dropped_) {
      for (int32_t g = first_windowed; g < n_groups_; ++g) {
        PageId& p = entry(g, dropped_);
        if (p != kNoPage) store_->release_locked(p);
        p = kNoPage;
      }
    }
  }
  window_from_ = std::max(window_from_, dropped_ * ps);
  // Copy-on-write: the page that position n_tokens_ falls in is about to be written.
  if (n > n_tokens_ && n_tokens_ % ps != 0) {
    const int32_t idx = n_tokens_ / ps;
    for (int32_t g = 0; g < n_groups_; ++g) {
      PageId& old = entry(g, idx);
      if (old == kNoPage) continue;
      KvStore::Entry& e = store_->entries_[size_t(old)];
      if (e.refs <= 1) continue;
      const bool res = reserved_ > 0;
      const PageId fresh = store_->allocate_locked(tier_, res);
      if (fresh < 0) {
        throw Error(
            ErrorCode::kOutOfMemory,
            fmt::format("KV store: no free {} page to copy shared page {} before writing", kv_tier_name(tier_), old));
      }
      if (res) --reserved_;
      KvStore::Entry& f = store_->entries_[size_t(fresh)];
      store_->copy_page_locked(int(e.tier.load()), e.slot, int(f.tier.load()), f.slot);
      store_->release_locked(old);
      old = fresh;
    }
  }
  if (need <= n_pages_) return;
  const int32_t had = n_pages_;
  const int32_t windowed_from = std::max(had, dropped_);  // windowed groups' first page to allocate
  const int32_t new_pages =
      first_windowed * (need - had) + (n_groups_ - first_windowed) * std::max(0, need - windowed_from);
  store_->tiers_[int(tier_.load())]->prepare_free_slots(new_pages);  // kIo: nothing taken
  for (int32_t j = had; j < need; ++j) {
    for (int32_t g = 0; g < n_groups_; ++g) {
      if (g >= first_windowed && j < windowed_from) continue;
      const bool res = reserved_ > 0;
      const PageId p = store_->allocate_locked(tier_, res);
      if (p < 0) {
        for (int32_t jj = had; jj <= j; ++jj) {
          for (int32_t gg = 0; gg < n_groups_; ++gg) {
            PageId& q = entry(gg, jj);
            if (q != kNoPage) store_->release_locked(q);
            q = kNoPage;
          }
        }
        if (had == 0) dropped_ = window_from_ = 0;
        const KvStore::Tier& t = *store_->tiers_[int(tier_.load())];
        throw Error(ErrorCode::kOutOfMemory,
                    fmt::format("KV store: {} tier exhausted: {} pages needed for {} positions, {} of {} in use",
                                kv_tier_name(tier_), new_pages, n, t.used, t.capacity));
      }
      if (res) --reserved_;
      entry(g, j) = p;
    }
  }
  n_pages_ = need;
}

int32_t KvSequence::truncate(int32_t n) {
  n = std::max(n, 0);
  if (n < n_tokens_ && !holds_prefix(n)) n = 0;
  n_tokens_ = std::min(n_tokens_, n);
  const int32_t keep = (n + store_->layout().page_size - 1) / store_->layout().page_size;
  std::lock_guard<std::mutex> lock(store_->mutex_);
  for (; n_pages_ > keep; --n_pages_) {
    for (int32_t g = 0; g < n_groups_; ++g) {
      PageId& p = entry(g, n_pages_ - 1);
      if (p != kNoPage) store_->release_locked(p);
      p = kNoPage;
    }
  }
  dropped_ = std::min(dropped_, n_pages_);
  if (n_pages_ == 0) window_from_ = 0;
  return n_tokens_;
}

void KvSequence::share_prefix(const KvSequence& other, int32_t n_tokens) {
  if (&other.store() != store_) {
    throw Error(ErrorCode::kInvalidArgument, "KV sequence: prefix sharing needs both sequences in one store");
  }
  if (n_pages_ != 0 || n_tokens_ != 0) {
    throw Error(ErrorCode::kInvalidArgument, "KV sequence: share_prefix needs an empty sequence");
  }
  if (n_tokens < 0 || !other.holds_prefix(n_tokens) || n_tokens > max_tokens_) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("KV sequence: cannot share {} positions of a sequence holding {} (context {}, windowed "
                            "pages released before page {})",
                            n_tokens, other.n_tokens(), max_tokens_, other.dropped_));
  }
  const KvLayout& l = store_->layout();
  const int32_t n_pages = (n_tokens + l.page_size - 1) / l.page_size;
  const int32_t live = std::max(l.window_live_page(n_tokens), other.dropped_);
  std::lock_guard<std::mutex> lock(store_->mutex_);
  for (int32_t g = 0; g < n_groups_; ++g) {
    for (int32_t j = l.group_windowed(g) ? live : 0; j < n_pages; ++j) {
      const PageId p = other.page(g, j);
      ++store_->entries_[size_t(p)].refs;
      entry(g, j) = p;
    }
  }
  n_pages_ = n_pages;
  dropped_ = std::min(live, n_pages);
  window_from_ = std::max(other.window_from_, dropped_ * l.page_size);
  n_tokens_ = n_tokens;
  tier_ = other.tier();
  shares_pages_.store(true, std::memory_order_release);
  other.shares_pages_.store(true, std::memory_order_release);
}

KvMoveStats KvSequence::move_to(KvTier tier) {
  return move_pages(tier, false);
}

KvMoveStats KvSequence::move_exclusive_to(KvTier tier) {
  return move_pages(tier, true);
}

KvMoveStats KvSequence::move_pages(KvTier tier, bool exclusive_only) {
  if (!store_->has_tier(tier)) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("KV sequence: the store has no {} tier", kv_tier_name(tier)));
  }
  const std::vector<PageId> held = held_page_ids();
  std::lock_guard<std::mutex> lock(store_->mutex_);
  const KvMoveStats s = store_->move_pages_locked(held, tier, exclusive_only);
  if (reserved_ > 0) {  // a reservation belongs to the tier the sequence lived in
    KvStore::Tier& from = *store_->tiers_[int(tier_.load())];
    from.reserved -= std::min(reserved_, from.reserved);
    reserved_ = 0;
  }
  tier_ = tier;
  return s;
}

// ------------------------------------------------------------------------- placement

int32_t KvPlacement::pages_to_grow(const KvSequence& seq, int64_t end) const {
  const KvLayout& l = store_->layout();
  const int32_t ps = l.page_size;
  // Writing into a partly filled page that another holder shares copies it first.
  int32_t cow = 0;
  if (end > seq.n_tokens() && seq.n_tokens() % ps != 0 && seq.n_pages() > seq.n_tokens() / ps) {
    for (int32_t g = 0; g < l.n_groups(); ++g) {
      const PageId p = seq.page(g, seq.n_tokens() / ps);
      cow += p != kNoPage && store_->refcount(p) > 1 ? 1 : 0;
    }
  }
  const int64_t need = (end + ps - 1) / ps;
  const int64_t grow = std::max<int64_t>(0, need - seq.n_pages()) * l.n_groups();
  return int32_t(std::max<int64_t>(0, grow + cow - seq.reservation()));
}

bool KvPlacement::free_pages(KvTier tier, int32_t pages, const KvSequence* keep) {
  const int32_t free = store_->usage(tier).free();
  if (free >= pages) return true;
  if (tier == KvTier::kFile || !store_->has_tier(KvTier::kFile)) return false;
  store_->evict_lru(tier, KvTier::kFile, pages - free, keep);
  return store_->usage(tier).free() >= pages;
}

KvMoveStats KvPlacement::make_resident(KvSequence& seq, KvTier tier) {
  seq.touch();
  const int32_t outside = seq.pages_outside(tier);
  if (outside == 0) {
    if (seq.tier() != tier) {  // nothing to move: new pages go to `tier` from now on
      std::lock_guard<std::mutex> lock(store_->mutex_);
      seq.tier_ = tier;
    }
    return {};
  }
  free_pages(tier, outside, &seq);
  return seq.move_to(tier);
}

void KvPlacement::prepare_step(KvSequence& seq, KvTier tier, int32_t end) {
  if (store_->has_tier(tier) && (seq.tier() != tier || seq.pages_outside(tier) > 0)) {
    make_resident(seq, tier);
  } else {
    seq.touch();
  }
  const int32_t need = pages_to_grow(seq, end);
  if (need > 0) free_pages(seq.tier(), need, &seq);
}

bool KvPlacement::spill(KvSequence& seq) {
  if (!store_->has_tier(KvTier::kFile)) return false;
  try {
    seq.move_to(KvTier::kFile);  // its reservation is returned
  } catch (const Error&) {       // no room in the File tier: nothing moved
    return false;
  }
  return true;
}

KvMoveStats KvPlacement::park(KvSequence& seq) {
  if (!store_->has_tier(KvTier::kFile)) {
    throw Error(ErrorCode::kInvalidArgument, "KV placement: the store has no File tier to park a sequence in");
  }
  return seq.move_exclusive_to(KvTier::kFile);
}

KvMoveStats KvPlacement::unpark(KvSequence& seq, KvTier tier) {
  const KvMoveStats st = seq.move_exclusive_to(tier);
  seq.touch();
  return st;
}

KvTier KvPlacement::import_tier(std::span<const KvTier> candidates, int32_t pages) const {
  const KvTier* first = nullptr;
  for (const KvTier& t : candidates) {
    if (!store_->has_tier(t)) continue;
    if (store_->usage(t).free() >= pages) return t;
    if (first == nullptr) first = &t;
  }
  if (first == nullptr) {
    throw Error(ErrorCode::kInvalidArgument, "KV placement: the store has none of the tiers an import can land in");
  }
  return *first;
}

}  // namespace tandem
