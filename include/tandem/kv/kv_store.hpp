// KvStore: the paged KV cache, in tiers (Device / Host / File), with reference-counted
// pages, per-sequence block tables, exact capacity accounting, moves between tiers and
// LRU eviction of inactive sequences (the policy that decides when: KvPlacement, below).
//
// Pages. A page holds `page_size` consecutive token positions of K and V for the
// page_layers() layers of one layer group. Without sliding-window layers there is one group,
// the layers [layer_begin, layer_begin + n_layer). With them (Gemma 3: `window` > 0), the
// full-attention layers and the windowed layers are grouped apart, each kind in model order,
// page_layers() = gcd(full, windowed) layers per group, the full groups first (place());
// a windowed group's pages that no later query can see (every position before
// n_tokens - window + 1) are released as the sequence grows, so a long Gemma 3 session
// keeps 1/6 of the full KV plus one window. Inside a page, for the layer in `slot`
// (place(il).slot), K then V, each [page_size] rows of one token's [n_head_kv][head_dim]
// elements:
//   row_offset(slot, kind, pos) = ((slot * 2 + kind) * page_size + pos) * row_bytes()
// A row is n_head_kv * head_dim elements of `dtype`: f32 (4 bytes), f16 (2 bytes), or
// q8_0 — ggml's Q8_0 blocks over the row (kernels/quant_blocks.hpp: per 32 consecutive
// elements an fp16 scale d = max|x| / 127 and 32 int8 q = round(x / d), 34 bytes), so a
// q8_0 row needs row_elems() % 32 == 0 and takes row_elems() / 32 * 34 bytes.
// A PageId names a page for its whole life; moving a page to another tier changes where
// its bytes live, not its id, so block tables stay valid across moves.
//
// Tiers. Host: one allocation in RAM. File: pages in a memory-mapped file created in a
// configurable directory and unlinked at once (freed by the kernel on any exit), grown in
// chunks with blocks reserved first (a full disk is a kIo error, never SIGBUS); the OS
// pages it in and out. Device: GPU memory through a KvDeviceBackend supplied by the GPU
// executor (absent on CPU-only builds: capacity 0). Host and File pages are addressable by
// the CPU; Device pages only through copies.
//
// Ownership. Pages are reference-counted: sequences sharing a prefix hold the same pages,
// and a sequence about to write into a shared page first copies it (copy-on-write).
// Every page has one owner at a time in the sense of the brief: the set of sequences (and
// hand-off leases) holding a reference; the page returns to its tier's free list when the
// last reference goes. Accounting (used / reserved / free per tier) is exact.
//
// Thread-safety: all KvStore members are internally synchronised (one mutex, taken only
// when pages are allocated, released, moved or reserved — once per page_size tokens of a
// growing sequence, never per token). page_data() is lock-free; the caller must not read a
// page while another thread moves or releases it (a sequence is moved only between its
// executor steps). A KvSequence is used by one thread at a time.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>
#include <vector>

#include "tandem/core/error.hpp"

namespace tandem {

struct HParams;  // tandem/model.hpp; only KvLayout::for_model reads it (defined in kv_contract.cpp)

enum class KvDtype : uint32_t { kF16 = 1, kF32 = 0, kQ8_0 = 2 };
/// Elements per Q8_0 block and bytes per block (fp16 scale + 32 int8), as ggml's block_q8_0.
inline constexpr size_t kKvQ8Block = 32;
inline constexpr size_t kKvQ8BlockBytes = 34;
enum class KvTier : uint32_t { kDevice = 0, kHost = 1, kFile = 2 };
inline constexpr int kKvTierCount = 3;

std::string_view kv_tier_name(KvTier t) noexcept;    ///< "device", "host", "file"
std::string_view kv_dtype_name(KvDtype d) noexcept;  ///< "f16", "f32", "q8_0" ("?" otherwise)
/// The dtype named "f16", "f32" or "q8_0" (llama.cpp's --cache-type-k/-v spelling); false
/// for any other name (out unchanged).
bool kv_dtype_from_name(std::string_view name, KvDtype& out) noexcept;
/// Bytes of a K (or V) row of `elems` elements of `d`: elems * 4 (f32), * 2 (f16), or
/// elems / 32 * 34 (q8_0, elems % 32 == 0); 0 when the dtype is unknown or a q8_0 row is
/// not a whole number of blocks.
uint64_t kv_row_bytes(KvDtype d, uint64_t elems) noexcept;

struct KvLayout {
  int32_t n_layer = 0;      ///< model layers held by the store (all groups)
  int32_t layer_begin = 0;  ///< first model layer held
  int32_t n_head_kv = 0;
  int32_t head_dim = 0;
  int32_t page_size = 16;  ///< tokens per page
  KvDtype dtype = KvDtype::kF16;
  /// Sliding window: positions a windowed layer's query sees, itself included (0: none).
  int32_t window = 0;
  /// Model layer il is windowed when window > 0 and il % window_pattern < window_pattern - 1
  /// (HParams::is_swa_layer: Gemma 3's 5 local layers, then 1 global).
  int32_t window_pattern = 0;
  /// Positions a windowed group keeps behind the window (for_model: half the window, at most
  /// 256), so a sequence cut back by that much (a repeated prompt, a chat turn tokenized
  /// again) keeps its KV and shares its prefix.
  int32_t window_slack = 0;

  /// Where a model layer's rows live: its group (block table) and its slot in that group's pages.
  struct Place {
    int32_t group = 0;
    int32_t slot = 0;
  };
  bool is_window_layer(int32_t il) const noexcept {
    return window > 0 && window_pattern > 0 && il % window_pattern < window_pattern - 1;
  }
  /// Windowed layers among [layer_begin, layer_begin + n_layer).
  int32_t n_window_layers() const noexcept;
  /// Layers per page: n_layer without windowed layers (or with only windowed ones), else
  /// gcd(full layers, windowed layers).
  int32_t page_layers() const noexcept;
  int32_t n_groups() const noexcept { return page_layers() > 0 ? n_layer / page_layers() : 0; }
  /// Groups of full-attention layers (groups [0, n_full_groups())); the rest are windowed.
  int32_t n_full_groups() const noexcept {
    return page_layers() > 0 ? (n_layer - n_window_layers()) / page_layers() : 0;
  }
  bool group_windowed(int32_t group) const noexcept { return group >= n_full_groups(); }
  /// The group and slot of model layer il (il in [layer_begin, layer_begin + n_layer)).
  Place place(int32_t il) const noexcept;
  /// First page index a windowed group keeps when positions [0, n) are filled: the page of
  /// position n - window + 1 - window_slack (n - window + 1 is the earliest any later query
  /// sees); 0 without a windowed group.
  int32_t window_live_page(int64_t n) const noexcept;
  /// Pages a sequence with positions [0, n) filled holds: every group's ceil(n / page_size),
  /// less the windowed groups' pages before window_live_page(n) (what an import allocates).
  int64_t pages_holding(int64_t n) const noexcept;
  /// Most pages a sequence of the store holds over its life, at most `n_ctx` positions,
  /// written at most `max_step` positions per step (its largest prefill chunk): every full
  /// group's ceil(n_ctx / page_size) + 1 (a copy-on-write), each windowed group's pages
  /// spanning window - 1 + window_slack + max_step positions, + 2 (or the full count, when
  /// smaller).
  int64_t sequence_pages(int64_t n_ctx, int64_t max_step) const noexcept;

  /// The layout of a model's KV. Throws Error(kInvalidArgument) for q8_0 when
  /// n_head_kv * head_dim is not a multiple of 32 (Q8_0 blocks must tile the row).
  static KvLayout for_model(const HParams& hp, int32_t page_size = 16, KvDtype dtype = KvDtype::kF16);
  /// Bytes per element for f32 / f16; 0 for q8_0 (a block format: use row_bytes()).
  size_t elem_bytes() const noexcept { return dtype == KvDtype::kF16 ? 2 : dtype == KvDtype::kF32 ? 4 : 0; }
  /// Elements of one K (or V) row of one token in one layer: n_head_kv * head_dim.
  size_t row_elems() const noexcept { return size_t(n_head_kv) * size_t(head_dim); }
  /// Bytes of one such row (kv_row_bytes; 0 for an invalid q8_0 row, which KvStore refuses).
  size_t row_bytes() const noexcept { return size_t(kv_row_bytes(dtype, row_elems())); }
  size_t page_bytes() const noexcept { return size_t(page_layers()) * 2 * size_t(page_size) * row_bytes(); }
  /// Byte offset inside a page of the K (kind 0) or V (kind 1) row of the token in page
  /// position `pos` of the layer in `slot` (place(il).slot).
  size_t row_offset(int32_t slot, int kind, int32_t pos) const noexcept {
    return ((size_t(slot) * 2 + size_t(kind)) * size_t(page_size) + size_t(pos)) * row_bytes();
  }
  bool operator==(const KvLayout&) const = default;
};

/// GPU memory for the Device tier, implemented by the GPU executor. Pages are slots of
/// page_bytes in one device allocation. Copies are ordered on the backend's stream and
/// complete before the call returns unless stated otherwise by the implementation.
class KvDeviceBackend {
 public:
  virtual ~KvDeviceBackend() = default;
  virtual int32_t capacity_pages() const noexcept = 0;
  virtual void copy_to_device(int32_t slot, const std::byte* src, size_t bytes) = 0;
  virtual void copy_to_host(int32_t slot, std::byte* dst, size_t bytes) = 0;
  virtual void copy_device_to_device(int32_t dst_slot, int32_t src_slot, size_t bytes) = 0;
};

struct KvStoreOptions {
  KvLayout layout;
  int32_t host_pages = 0;  ///< capacity of the Host tier, in pages
  int32_t file_pages = 0;  ///< capacity of the File tier, in pages (0 = no File tier)
  /// Directory of the File tier ("" = $TMPDIR, else /tmp). The page file is unlinked as
  /// soon as it is created, so no exit path leaves it behind; stale page files of dead
  /// processes found there are removed (lib/kv/kv_page_file.hpp).
  std::filesystem::path file_dir;
  int32_t file_chunk_pages = 256;           ///< the file grows by this many pages at a time
  std::unique_ptr<KvDeviceBackend> device;  ///< Device tier (null = none)
};

struct KvTierUsage {
  int32_t capacity = 0;  ///< pages
  int32_t used = 0;      ///< pages holding data (referenced)
  int32_t reserved = 0;  ///< pages promised to reservations, not yet used
  int32_t free() const noexcept { return capacity - used - reserved; }
  uint64_t used_bytes = 0;
};

using PageId = int32_t;
/// A block-table entry without a page: a windowed group's page that fell out of the window.
inline constexpr PageId kNoPage = -1;

/// What a move cost.
struct KvMoveStats {
  int32_t pages = 0;
  uint64_t bytes = 0;
  double seconds = 0.0;
};

class KvSequence;

class KvStore {
 public:
  /// Throws Error(kInvalidArgument) for an empty layout or negative capacities,
  /// kOutOfMemory when Host memory cannot be allocated, kIo when the File tier's
  /// directory is unusable (missing, not a directory, not writable).
  explicit KvStore(KvStoreOptions options);
  ~KvStore();
  KvStore(const KvStore&) = delete;
  KvStore& operator=(const KvStore&) = delete;

  const KvLayout& layout() const noexcept { return layout_; }
  KvTierUsage usage(KvTier tier) const;
  /// Pages used in all tiers together.
  int32_t used_pages() const;
  /// True when the tier exists (capacity > 0).
  bool has_tier(KvTier tier) const noexcept;
  /// The name the File tier's file had when it was created ("" when there is none); the
  /// file is unlinked right after creation, so the name no longer exists.
  std::filesystem::path file_path() const;

  /// A new page (refcount 1, zero-filled unless on the Device tier) in `tier`, or -1 when
  /// the tier has no free page. `from_reservation` consumes one reserved page instead.
  PageId allocate(KvTier tier, bool from_reservation = false);
  void retain(PageId page);
  void release(PageId page);
  int32_t refcount(PageId page) const;
  KvTier tier_of(PageId page) const;
  /// Bytes of a Host or File page (nullptr for a Device page). Lock-free.
  std::byte* page_data(PageId page) const noexcept;
  /// The Device tier's slot of a Device page (-1 for a page in another tier), and the
  /// Device tier's backend (null when there is none): how a GPU executor finds a page in
  /// VRAM. Lock-free, like page_data().
  int32_t device_slot(PageId page) const noexcept;
  KvDeviceBackend* device_backend() const noexcept;
  /// Copy a page's bytes out to / in from host memory of page_bytes(), any tier.
  void read_page(PageId page, std::byte* dst) const;
  void write_page(PageId page, const std::byte* src);

  /// Move `pages` to `dst` (whole-page copies; ids keep their meaning). Pages already in
  /// `dst` are skipped. Throws Error(kOutOfMemory) when `dst` lacks room — then nothing
  /// has moved.
  KvMoveStats move_pages(std::span<const PageId> pages, KvTier dst);

  /// Promise `n_pages` of `tier` to a caller (admission control). Reserved pages count
  /// as not free until used or returned. Throws Error(kOutOfMemory) when not enough free.
  void reserve(KvTier tier, int32_t n_pages);
  void unreserve(KvTier tier, int32_t n_pages);

  /// Move least-recently-used sequences that are not pinned from `from` down to `to`
  /// until `pages_needed` pages of `from` are free or no candidate is left. Returns the
  /// number of pages freed in `from`. `keep` is never evicted. Only pages a sequence
  /// holds alone move (shared ones stay for their other holders); an evicted sequence's
  /// unused reservation is returned to `from`.
  int32_t evict_lru(KvTier from, KvTier to, int32_t pages_needed, const KvSequence* keep = nullptr);

  /// Sequences currently registered (alive).
  size_t sequence_count() const;

 private:
  friend class KvSequence;
  friend class KvPlacement;
  struct Tier;
  struct Entry {
    std::atomic<std::byte*> data{nullptr};  // host address (Host/File) or null (Device)
    std::atomic<KvTier> tier{KvTier::kHost};
    std::atomic<int32_t> slot{-1};
    int32_t refs = 0;
  };
  PageId allocate_locked(KvTier tier, bool from_reservation);
  KvMoveStats move_pages_locked(std::span<const PageId> pages, KvTier dst, bool exclusive_only);
  void release_locked(PageId page);
  void copy_page_locked(int32_t src_tier, int32_t src_slot, int32_t dst_tier, int32_t dst_slot);
  void register_sequence(KvSequence* s);
  void unregister_sequence(KvSequence* s);
  uint64_t next_use();

  KvLayout layout_;
  mutable std::mutex mutex_;
  std::unique_ptr<Tier> tiers_[kKvTierCount];
  std::unique_ptr<Entry[]> entries_;
  int32_t n_entries_ = 0;
  std::vector<PageId> free_ids_;
  std::vector<KvSequence*> sequences_;
  std::atomic<uint64_t> use_clock_{0};
  std::atomic<uint64_t> next_sequence_id_{1};
};

/// One sequence's KV: a block table per layer group (KvLayout::n_groups()) in a KvStore and
/// the number of positions filled. Every group spans the same n_pages() page indices; a
/// windowed group's pages before window_live_page(n_tokens) are released (kNoPage).
/// Move-only in spirit (not copyable); the destructor releases every page it references.
class KvSequence {
 public:
  /// `max_tokens` bounds the sequence (the context size); the block table is reserved up
  /// front so growing never allocates heap memory. Pages are allocated in `tier`.
  KvSequence(KvStore& store, int32_t max_tokens, KvTier tier = KvTier::kHost);
  ~KvSequence();
  KvSequence(const KvSequence&) = delete;
  KvSequence& operator=(const KvSequence&) = delete;

  KvStore& store() const noexcept { return *store_; }
  uint64_t id() const noexcept { return id_; }
  int32_t n_tokens() const noexcept { return n_tokens_; }
  int32_t max_tokens() const noexcept { return max_tokens_; }
  /// Page indices spanned by every group: ceil(reserved positions / page_size).
  int32_t n_pages() const noexcept { return n_pages_; }
  /// The page of `group` holding positions [index * page_size, (index + 1) * page_size), or
  /// kNoPage (a windowed group's page out of the window). index < n_pages(). Lock-free.
  PageId page(int32_t group, int32_t index) const noexcept { return table_[size_t(group) * cap_ + size_t(index)]; }
  /// One group's block table: n_pages() entries.
  std::span<const PageId> block_table(int32_t group) const noexcept {
    return {table_.data() + size_t(group) * cap_, size_t(n_pages_)};
  }
  /// Pages referenced (every group, without kNoPage entries). Lock-free.
  int32_t held_pages() const noexcept;
  /// Their ids, full groups first, each group in position order (allocates: not per token).
  std::vector<PageId> held_page_ids() const;
  /// Leading page indices whose windowed-group pages are released.
  int32_t window_pages_dropped() const noexcept { return dropped_; }
  /// Whether the first n positions can be kept (truncate) or shared (share_prefix): n <=
  /// n_tokens() and every windowed row a query at position n would see is still held.
  bool holds_prefix(int32_t n) const noexcept;
  /// First position whose windowed-layer rows are held (0 without released pages).
  int32_t window_from() const noexcept { return window_from_; }
  /// The tier new pages are allocated in and where the sequence is resident.
  KvTier tier() const noexcept { return tier_.load(std::memory_order_acquire); }

  /// Make room to write positions [n_tokens, n): releases the windowed groups' pages no
  /// query from position n_tokens on can see, allocates pages in every group and copies a
  /// shared page about to be written (copy-on-write). Throws Error(kContextOverflow) when
  /// n > max_tokens, Error(kOutOfMemory) when the tier is full (nothing allocated then).
  void reserve(int32_t n);
  /// Hold pages for positions [0, n) of an empty sequence that are about to be filled by an
  /// import whose windowed rows start at position `window_from` (every full group's pages;
  /// the windowed groups' from window_live_page(n) or window_from's page, the later) and
  /// mark them filled. Errors as reserve(); kInvalidArgument when not empty or when
  /// window_from is past n - window + 1 (a query at n would miss rows).
  void reserve_filled(int32_t n, int32_t window_from = 0);
  /// Mark positions [0, n) as filled (n within reserved capacity). Called by executors.
  void set_n_tokens(int32_t n) noexcept { n_tokens_ = n; }
  /// Forget positions >= n and release pages no longer needed. Returns the positions kept:
  /// n (clamped to n_tokens()), or 0 when the windowed groups no longer hold the pages
  /// position n needs (!holds_prefix(n)): that KV must be recomputed from the tokens.
  int32_t truncate(int32_t n);

  /// Share the first `n_tokens` positions of `other` (same store): the pages are
  /// referenced, not copied. This sequence must be empty and other.holds_prefix(n_tokens)
  /// (else Error(kInvalidArgument)).
  void share_prefix(const KvSequence& other, int32_t n_tokens);

  /// Move every page to `tier` (swap out / bring back). Throws Error(kOutOfMemory) when
  /// `tier` has no room; nothing moved then. Evicts nothing (KvPlacement decides that).
  KvMoveStats move_to(KvTier tier);
  /// As move_to, but only the pages this sequence holds alone move (shared pages stay for
  /// their other holders, as evict_lru does), so it is safe while other sequences that
  /// share pages with it are being computed on. Its unused reservation is returned.
  KvMoveStats move_exclusive_to(KvTier tier);
  /// Note that another holder (a sequence or a hand-off lease) references some of these
  /// pages, so the next write into a shared page must copy it first.
  void mark_pages_shared() const noexcept { shares_pages_.store(true, std::memory_order_release); }
  /// Record a use (for LRU eviction).
  void touch() noexcept;
  /// Pages of this sequence that are not in `tier` (lock-free; call between steps).
  int32_t pages_outside(KvTier tier) const noexcept;
  /// Attach a reservation of `n_pages` made with KvStore::reserve(tier(), n): pages this
  /// sequence allocates draw from it first; what is left is returned on destruction.
  void adopt_reservation(int32_t n_pages) noexcept { reserved_ += n_pages; }
  int32_t reservation() const noexcept { return reserved_; }
  uint64_t last_use() const noexcept { return last_use_; }
  /// A pinned sequence is never evicted (admitted by a scheduler, or an executor step in
  /// progress). Pins are counted: each holder pins once and unpins once (KvPin does both),
  /// so one layer's unpin never clears another's pin.
  void pin() noexcept { pins_.fetch_add(1, std::memory_order_acq_rel); }
  void unpin() noexcept { pins_.fetch_sub(1, std::memory_order_acq_rel); }
  bool pinned() const noexcept { return pins_.load(std::memory_order_acquire) > 0; }

 private:
  /// move_to / move_exclusive_to: every page, or only the pages this sequence holds alone.
  KvMoveStats move_pages(KvTier tier, bool exclusive_only);
  /// reserve() / reserve_filled(): the store's lock held; windowed pages before `live` are
  /// released (reserve) or never allocated (an empty sequence's reserve_filled).
  void grow_locked(int32_t n, int32_t live);
  PageId& entry(int32_t group, int32_t index) noexcept { return table_[size_t(group) * cap_ + size_t(index)]; }
  friend class KvStore;
  friend class KvPlacement;
  KvStore* store_;
  uint64_t id_;
  int32_t max_tokens_;
  int32_t n_tokens_ = 0;
  std::atomic<KvTier> tier_;
  int32_t n_groups_ = 1;
  size_t cap_ = 0;  ///< page indices a group can need (ceil(max_tokens / page_size))
  int32_t n_pages_ = 0;
  int32_t dropped_ = 0;
  int32_t window_from_ = 0;
  std::vector<PageId> table_;  ///< [group][cap_]: sized up front, so growing never allocates
  std::atomic<uint64_t> last_use_{0};
  std::atomic<int32_t> pins_{0};
  int32_t reserved_ = 0;
  /// Set once pages of this sequence may be shared (share_prefix either way): only then
  /// does reserve() look for a copy-on-write under the store's lock.
  mutable std::atomic<bool> shares_pages_{false};
};

/// Where pages live: the one placement policy, and the only library code that moves a
/// sequence's pages between tiers (KvSequence::move_to / move_exclusive_to are called
/// here alone; tests and tools may call them directly). The scheduler's loops and a
/// standalone Session use it before a step, the scheduler when it preempts a sequence or
/// parks a session, Session::migrate and the scheduler's session restore to pick the tier
/// an import lands in; executors never evict or move pages (Executor::step only allocates
/// the positions it writes in the sequence's tier and refuses a page it cannot read).
/// Rule: a sequence about to run is brought into the compute tier and the pages it
/// writes are made free there; when the tier is short, the least recently used sequences
/// of the store that are not pinned (other than the one about to run) move to the File
/// tier, when the store has one. A preempted sequence and an explicitly parked one go to
/// the File tier too. A small value (a pointer to the store): make one where needed.
/// Thread-safety: as KvStore and KvSequence (one thread per sequence).
class KvPlacement {
 public:
  explicit KvPlacement(KvStore& store) noexcept : store_(&store) {}

  /// Pages `seq` must still obtain to hold `end` positions: those beyond the pages it
  /// holds and its reservation (every group), plus one per group whose partly written last
  /// page is shared (copy-on-write before the write).
  int32_t pages_to_grow(const KvSequence& seq, int64_t end) const;
  /// Make `pages` pages free in `tier` by moving LRU unpinned sequences other than `keep`
  /// to File. True when that many are free afterwards.
  bool free_pages(KvTier tier, int32_t pages, const KvSequence* keep);
  /// Bring every page of `seq` into `tier` (freeing room as above) and mark it used.
  /// Throws Error(kOutOfMemory) when they do not fit; nothing moved then.
  KvMoveStats make_resident(KvSequence& seq, KvTier tier);
  /// Before a step that writes positions up to `end` on an executor computing in `tier`:
  /// resident there (when the store has that tier) with the pages it writes free. A tier
  /// still short after eviction is left to the step, which refuses it (kOutOfMemory).
  void prepare_step(KvSequence& seq, KvTier tier, int32_t end);

  /// A preempted sequence (unpinned): every page to the File tier, its unused reservation
  /// returned. False, nothing moved, when the store has no File tier or it lacks room: the
  /// caller then drops the KV (recomputed from the tokens).
  bool spill(KvSequence& seq);
  /// Park an idle sequence (a scheduler session between requests): the pages it holds
  /// alone go to the File tier (shared ones stay for their other holders), its unused
  /// reservation is returned. Throws Error(kInvalidArgument) when the store has no File
  /// tier, Error(kOutOfMemory) when the File tier lacks room (nothing moved then).
  KvMoveStats park(KvSequence& seq);
  /// Bring a parked sequence's pages it holds alone back to `tier` ahead of its next use
  /// (a prefetch) and mark it used. Errors as KvSequence::move_exclusive_to.
  KvMoveStats unpark(KvSequence& seq, KvTier tier);
  /// The tier `pages` arriving pages (an import: Session::migrate, a restored session
  /// file) are allocated in: the first of `candidates` (in order of preference) that the
  /// store has with `pages` free pages, evicting nothing; when none has room, the first
  /// the store has (the import then fails with kOutOfMemory, nothing allocated). Throws
  /// Error(kInvalidArgument) when the store has none of them.
  KvTier import_tier(std::span<const KvTier> candidates, int32_t pages) const;

 private:
  KvStore* store_;
};

/// Holds one pin on a sequence for its lifetime (RAII).
class KvPin {
 public:
  explicit KvPin(KvSequence& seq) noexcept : seq_(&seq) { seq_->pin(); }
  ~KvPin() { seq_->unpin(); }
  KvPin(const KvPin&) = delete;
  KvPin& operator=(const KvPin&) = delete;

 private:
  KvSequence* seq_;
};

}  // namespace tandem
