// The KV contract: what travels with every hand-off of KV pages between executors,
// stores or tiers, and the checks made on arrival (../shared/docs/brief.md, "The KV
// contract").
//
// Invariants (a mismatch is refused with kKvMismatch / kKvTokenRange, nothing is
// reinterpreted): model identity (hash of the weights and hyper-parameters), tokenizer
// identity, n_layer, n_head_kv, head_dim, RoPE type/base/scale/dims, a token range that
// starts at position 0 and whose ids equal what the receiver expects (byte-verified, not
// a hash alone). Convertible differences (dtype among f16, f32 and q8_0; page size; a
// split into layer ranges) are converted explicitly into the receiving store's layout and
// the converted rows are compared with an independent conversion of the source before the
// import is accepted. f16/f32 -> q8_0 is lossy (Q8_0 rounding), so it happens only when
// the receiver's store is q8_0; q8_0 -> f32 is exact. The descriptor's dtype and row_bytes
// must agree (kv_row_bytes), so q8_0 bytes are never read as f16 or f32. Every page
// carries an xxHash3-64 checksum; a mismatch is kKvChecksum naming the page index. Bytes
// arriving is not success.
//
// Sliding windows (Gemma 3): the descriptor names the model's window and layer pattern
// (checked like the other invariants) and window_begin, the first position whose windowed
// rows travel: pages before its page carry the full-attention layers only (no later query
// sees those windowed positions, and the sender may have released them); the receiver holds
// windowed rows from window_begin on (KvSequence::window_from) and writes none before.
//
// Leases: export does not copy. It hands the receiver a lease holding references to the
// sender's pages (so the sender may free its sequence at once: the pages stay until the
// lease ends). The receiver marks the lease as being read, verifies and copies, then
// confirms it; failure or expiry (the deadline passing before the receiver started) is
// recorded in the lease, which both sides can query, and the pages are released exactly
// once. No side reads pages after their release.
//
// Thread-safety: a lease is internally synchronised; sender and receiver may run on
// different threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "tandem/kv/kv_store.hpp"
#include "tandem/model/model.hpp"

namespace tandem {

inline constexpr uint32_t kKvContractVersion = 2;

struct KvDescriptor {
  uint32_t contract_version = kKvContractVersion;
  uint64_t model_identity = 0;      ///< Model::identity_hash()
  uint64_t tokenizer_identity = 0;  ///< Tokenizer::identity_hash()
  int32_t n_layer = 0;              ///< layers of the model
  int32_t n_head_kv = 0;
  int32_t head_dim = 0;
  uint64_t row_bytes = 0;  ///< bytes of one K (or V) row of one token in one layer
  RopeType rope_type = RopeType::kNormal;
  float rope_freq_base = 0.0f;
  float rope_freq_scale = 0.0f;
  int32_t n_rot = 0;
  int32_t n_ctx = 0;  ///< the sender's context size
  KvDtype dtype = KvDtype::kF16;
  int32_t page_size = 0;    ///< tokens per page
  int32_t layer_begin = 0;  ///< layers [layer_begin, layer_end) are in this hand-off
  int32_t layer_end = 0;
  int32_t window = 0;          ///< the model's sliding window (HParams::n_swa; 0: none)
  int32_t window_pattern = 0;  ///< its layer pattern (HParams::swa_pattern)
  int32_t window_begin = 0;    ///< first position with windowed-layer rows (<= token_end - window + 1)
  int32_t token_begin = 0;     ///< positions [token_begin, token_end)
  int32_t token_end = 0;
  std::vector<int32_t> tokens;           ///< the ids at those positions
  uint64_t sequence_id = 0;              ///< the sender's KvSequence::id()
  std::vector<uint64_t> page_checksums;  ///< xxHash3-64 of each page's payload, in order

  int32_t n_pages() const noexcept { return static_cast<int32_t>(page_checksums.size()); }
  /// Whether page `page` carries layer `layer`'s rows (a windowed layer's from the page of
  /// window_begin on, the others always).
  bool carries(int32_t page, int32_t layer) const noexcept;
  /// Bytes of page `page`'s payload: for each carried layer of [layer_begin, layer_end) in
  /// order, its K rows then its V rows of page_size positions (row_bytes each).
  uint64_t page_payload_bytes(int32_t page) const noexcept;
  /// Byte offset of layer `layer`'s K rows in page `page`'s payload (layer carried there).
  uint64_t payload_layer_offset(int32_t page, int32_t layer) const noexcept;
  /// Bytes of all pages' payloads.
  uint64_t payload_bytes() const noexcept;
};

enum class KvLeaseState { kPending, kReading, kConfirmed, kFailed, kExpired };
std::string_view kv_lease_state_name(KvLeaseState s) noexcept;

class KvLease {
 public:
  KvLease(KvStore& store, std::vector<PageId> pages, std::chrono::steady_clock::time_point deadline);
  ~KvLease();  ///< an unfinished lease expires on destruction (pages released once)
  KvLease(const KvLease&) = delete;
  KvLease& operator=(const KvLease&) = delete;

  /// Current state; a pending lease past its deadline becomes kExpired here.
  KvLeaseState state();
  /// Why the lease failed or expired ("" otherwise).
  std::string failure() const;

  // Receiver side.
  /// Pending -> reading. Throws Error(kKvLeaseExpired) when expired, kInvalidArgument when
  /// already read, confirmed or failed.
  void begin_read();
  void confirm();                     ///< reading -> confirmed; releases the pages
  void fail(const std::string& why);  ///< reading -> failed; releases the pages
  KvStore& store() const noexcept { return *store_; }
  /// The leased pages, [page][group] of the store's layout (kNoPage where a group's page
  /// is not carried); empty once released.
  const std::vector<PageId>& pages() const noexcept { return pages_; }

 private:
  void finish_locked(KvLeaseState s, const std::string& why);
  mutable std::mutex mutex_;
  KvStore* store_;
  std::vector<PageId> pages_;
  std::chrono::steady_clock::time_point deadline_;
  KvLeaseState state_ = KvLeaseState::kPending;
  std::string failure_;
};

/// A hand-off: the descriptor and the lease on the sender's pages.
struct KvHandoff {
  KvDescriptor descriptor;
  std::shared_ptr<KvLease> lease;
};

/// Describe and lease the first `tokens.size()` positions of `seq` (layers
/// [layer_begin, layer_end), default all). The pages are referenced by the lease until
/// it is confirmed, fails or expires after `ttl`. Errors: kInvalidArgument when
/// tokens.size() != seq.n_tokens() or the layer range is outside the pages.
KvHandoff kv_export(const KvSequence& seq, const Model& model, std::span<const int32_t> tokens,
                    std::chrono::milliseconds ttl = std::chrono::seconds(30), int32_t layer_begin = 0,
                    int32_t layer_end = -1);

/// Import one or more hand-offs (layer ranges of the same tokens that together cover
/// every layer exactly once) into a new sequence of `dst` in `tier`, converting dtype and
/// page size to dst's layout, verifying checksums and conversions. `expected_tokens`,
/// when given, must equal the hand-off's tokens. On success every lease is confirmed; on
/// any error every lease is failed, nothing is left allocated in `dst`, and the error is
/// thrown (kKvMismatch, kKvTokenRange, kKvChecksum with the page index,
/// kKvLeaseExpired, kOutOfMemory).
std::unique_ptr<KvSequence> kv_import(std::span<const KvHandoff> parts, const Model& model, KvStore& dst, KvTier tier,
                                      int32_t max_tokens, std::span<const int32_t> expected_tokens = {});

/// Page `page`'s payload (d.page_payload_bytes(page) bytes) gathered from the pages `lease`
/// holds (read under the store's lock, any tier) into `out`. Throws Error(kKvLeaseExpired)
/// when the lease no longer holds them.
void kv_lease_payload(const KvLease& lease, const KvDescriptor& d, int32_t page, std::vector<std::byte>& out);

/// The invariant checks of kv_import on a descriptor alone (used by session restore).
void kv_check_invariants(const KvDescriptor& d, const Model& model);

/// The one byte form of a descriptor (session files store it; a wire format would too),
/// little-endian, fields in declaration order: u32 contract_version, u64 model_identity,
/// u64 tokenizer_identity, i32 n_layer, n_head_kv, head_dim, u64 row_bytes, u32 rope_type,
/// f32 rope_freq_base, rope_freq_scale, i32 n_rot, n_ctx, u32 dtype, i32 page_size,
/// layer_begin, layer_end, window, window_pattern, window_begin, token_begin,
/// token_end, u64 sequence_id, u64 n_tokens,
/// i32 tokens[n_tokens], u64 n_pages, u64 page_checksums[n_pages]. Appended to `out`.
void kv_descriptor_append(const KvDescriptor& d, std::vector<std::byte>& out);

/// Parse the byte form from the front of `bytes` into `d`; returns the bytes consumed.
/// Counts are checked against the bytes left before anything is allocated. Throws
/// Error(kInvalidArgument) naming the field and offset when `bytes` ends too early. The
/// values are not checked (kv_check_invariants does that against a model).
size_t kv_descriptor_parse(std::span<const std::byte> bytes, KvDescriptor& d);

/// Copy pages described by `d` from `page_payload(i)` (payload bytes of page i, already
/// checksum-verified by the caller or not: this verifies them) into a new sequence of
/// `dst`. The building block of kv_import and session restore.
std::unique_ptr<KvSequence> kv_import_payloads(
    std::span<const KvDescriptor* const> parts,
    const std::function<const std::byte*(size_t part, int32_t page)>& payload, KvStore& dst, KvTier tier,
    int32_t max_tokens);

}  // namespace tandem
