// Session files: the one format of Session::save / Session::restore and of
// Scheduler::save_session / restore_session (session_file.hpp).
//
// Layout (little-endian):
//   header  "TANDEMSS" | u32 version (2) | u32 flags (0) | u64 body_bytes
//   body    the KV descriptor in its one byte form (kv_descriptor_append,
//           include/tandem/kv/kv_contract.hpp)
//           i32 pending (-1: none) | u32 n_logits (0: none) | f32 logits[n_logits]
//           u64 rng_len (0: none, a scheduler session's) | rng state text
//           (std::mt19937_64 operator<<)
//           page payloads, page i: descriptor.page_payload_bytes(i) bytes (a page before
//           the sliding window carries the full-attention layers only)
//   trailer u64 xxHash3-64 of header and body
// Every length is checked against the bytes left before anything is allocated.
#include <fmt/format.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "session/generation.hpp"
#include "session/session_file.hpp"
#include "tandem/core/atomic_file.hpp"
#include "tandem/kv/kv_contract.hpp"
#include "tandem/session/session.hpp"

namespace tandem {

namespace {

constexpr char kMagic[8] = {'T', 'A', 'N', 'D', 'E', 'M', 'S', 'S'};
constexpr uint32_t kVersion = 2;  // 2: the KV contract v2 descriptor (sliding windows)
constexpr size_t kHeaderBytes = 8 + 4 + 4 + 8;

class Writer {
 public:
  template <class T>
  void put(const T& v) {
    bytes(&v, sizeof(T));
  }
  void bytes(const void* p, size_t n) {
    if (n == 0) return;
    const size_t at = out.size();
    out.resize(at + n);  // (resize + memcpy: GCC 12 misreads vector::insert here, -Wstringop-overflow)
    std::memcpy(out.data() + at, p, n);
  }
  std::vector<std::byte> out;
};

class Reader {
 public:
  Reader(const std::byte* p, size_t n) : p_(p), n_(n) {}
  template <class T>
  T get(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, p_ + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }
  const std::byte* take(uint64_t n, const char* what) {
    need(n, what);
    const std::byte* r = p_ + at_;
    at_ += size_t(n);
    return r;
  }
  /// A count of items of `item_bytes` each, checked against the bytes left.
  uint64_t count(uint64_t item_bytes, const char* what) {
    const auto n = get<uint64_t>(what);
    if (item_bytes != 0 && n > (n_ - at_) / item_bytes) {
      throw Error(ErrorCode::kSessionCorrupt,
                  fmt::format("session file: {} count {} at offset {} exceeds the {} bytes left", what, n,
                              kHeaderBytes + at_ - 8, n_ - at_));
    }
    return n;
  }
  size_t left() const noexcept { return n_ - at_; }
  std::span<const std::byte> rest() const noexcept { return {p_ + at_, n_ - at_}; }
  void skip(size_t n) { take(n, "descriptor"); }

 private:
  void need(uint64_t n, const char* what) const {
    if (n > n_ - at_) {
      throw Error(ErrorCode::kSessionCorrupt,
                  fmt::format("session file: truncated reading {} at body offset {}", what, at_));
    }
  }
  const std::byte* p_;
  size_t n_;
  size_t at_ = 0;
};

}  // namespace

void session_file_write(const std::filesystem::path& path, const KvSequence& kv, const Model& model,
                        std::span<const int32_t> tokens, int32_t pending, std::span<const float> logits,
                        const std::mt19937_64* rng) {
  const KvHandoff h = kv_export(kv, model, tokens, std::chrono::seconds(60));
  const KvDescriptor& d = h.descriptor;
  Writer w;
  w.bytes(kMagic, sizeof(kMagic));
  w.put(kVersion);
  w.put(uint32_t{0});
  w.put(uint64_t{0});  // body size, patched below
  kv_descriptor_append(d, w.out);
  w.put(pending);
  w.put(static_cast<uint32_t>(logits.size()));
  w.bytes(logits.data(), logits.size() * sizeof(float));
  std::string rs;
  if (rng != nullptr) {
    std::ostringstream text;
    text << *rng;
    rs = text.str();
  }
  w.put(uint64_t(rs.size()));
  w.bytes(rs.data(), rs.size());
  std::vector<std::byte> page;
  for (int32_t i = 0; i < d.n_pages(); ++i) {
    // Copied under the store's lock (any tier): a scheduler loop may move a page this
    // sequence shares meanwhile; the bytes are the same wherever the page lives.
    kv_lease_payload(*h.lease, d, i, page);
    w.bytes(page.data(), page.size());
  }
  h.lease->begin_read();
  h.lease->confirm();
  const uint64_t body = w.out.size() - kHeaderBytes;
  std::memcpy(w.out.data() + 16, &body, sizeof(body));
  w.put(uint64_t(XXH3_64bits(w.out.data(), w.out.size())));
  write_file_atomic(path, w.out);
}

void Session::save(const std::filesystem::path& path) const {
  const std::span<const float> logits = have_logits_ ? std::span<const float>(logits_) : std::span<const float>();
  session_file_write(path, *kv_, *model_, tokens_, pending_ ? *pending_ : -1, logits, &rng_);
}

namespace {

/// The file's bytes, after the header, size and whole-file checksum are verified.
std::vector<std::byte> read_verified(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f || std::filesystem::is_directory(path)) {
    throw Error(ErrorCode::kIo, fmt::format("session file: cannot open '{}'", path.string()));
  }
  const auto size = static_cast<uint64_t>(f.tellg());
  if (size < kHeaderBytes + 8) {
    throw Error(ErrorCode::kSessionCorrupt,
                fmt::format("session file '{}': {} bytes is too short for a session file", path.string(), size));
  }
  std::vector<std::byte> data(size);
  f.seekg(0);
  f.read(reinterpret_cast<char*>(data.data()), static_cast<std::streamsize>(size));
  if (!f) throw Error(ErrorCode::kIo, fmt::format("session file: cannot read '{}'", path.string()));

  if (std::memcmp(data.data(), kMagic, sizeof(kMagic)) != 0) {
    throw Error(ErrorCode::kSessionCorrupt,
                fmt::format("session file '{}': bad magic (not a Tandem session)", path.string()));
  }
  uint32_t version = 0;
  std::memcpy(&version, data.data() + 8, 4);
  if (version > kVersion) {
    throw Error(ErrorCode::kSessionVersion,
                fmt::format("session file '{}': format version {} is newer than this build's {}", path.string(),
                            version, kVersion));
  }
  if (version == 0) {
    throw Error(ErrorCode::kSessionCorrupt, fmt::format("session file '{}': format version 0", path.string()));
  }
  if (version < kVersion) {
    throw Error(ErrorCode::kSessionVersion,
                fmt::format("session file '{}': format version {} is older than this build's {} (its KV descriptor "
                            "predates sliding windows); evaluate the conversation again",
                            path.string(), version, kVersion));
  }
  uint64_t body = 0;
  std::memcpy(&body, data.data() + 16, 8);
  if (body != size - kHeaderBytes - 8) {
    throw Error(ErrorCode::kSessionCorrupt,
                fmt::format("session file '{}': body of {} bytes declared, {} present (truncated or padded)",
                            path.string(), body, size - kHeaderBytes - 8));
  }
  uint64_t stored = 0;
  std::memcpy(&stored, data.data() + size - 8, 8);
  if (stored != XXH3_64bits(data.data(), size_t(size - 8))) {
    throw Error(ErrorCode::kSessionCorrupt,
                fmt::format("session file '{}': checksum mismatch (damaged)", path.string()));
  }
  return data;
}

/// The KV descriptor at the front of the body, checked against `model`.
KvDescriptor read_descriptor(Reader& r, const Model& model, const std::filesystem::path& path) {
  KvDescriptor d;
  try {
    r.skip(kv_descriptor_parse(r.rest(), d));
  } catch (const Error& e) {
    throw Error(ErrorCode::kSessionCorrupt, fmt::format("session file '{}': {}", path.string(), e.what()));
  }
  if (d.model_identity != model.identity_hash() || d.tokenizer_identity != model.tokenizer().identity_hash()) {
    throw Error(ErrorCode::kSessionModelMismatch,
                fmt::format("session file '{}': saved with model {:016x} / tokenizer {:016x}, this session runs "
                            "{:016x} / {:016x}",
                            path.string(), d.model_identity, d.tokenizer_identity, model.identity_hash(),
                            model.tokenizer().identity_hash()));
  }
  try {
    kv_check_invariants(d, model);
  } catch (const Error& e) {
    throw Error(e.code() == ErrorCode::kKvMismatch ? ErrorCode::kSessionModelMismatch : ErrorCode::kSessionCorrupt,
                fmt::format("session file '{}': {}", path.string(), e.what()));
  }
  return d;
}

}  // namespace

SessionFile::SessionFile(const std::filesystem::path& path, const Model& model, int32_t n_ctx)
    : path_(path), data_(read_verified(path)) {
  Reader r(data_.data() + kHeaderBytes, data_.size() - kHeaderBytes - 8);
  d_ = read_descriptor(r, model, path);
  // What follows the descriptor: the pending token, the last logits, the random state.
  const HParams& hp = model.hparams();
  const auto pending = r.get<int32_t>("pending token");
  if (pending < -1 || pending >= hp.n_vocab) {
    throw Error(ErrorCode::kSessionCorrupt,
                fmt::format("session file '{}': pending token {} is invalid", path.string(), pending));
  }
  if (pending >= 0) pending_ = pending;
  const auto n_logits = r.get<uint32_t>("logits count");
  if (n_logits != 0 && n_logits != uint32_t(hp.n_vocab)) {
    throw Error(ErrorCode::kSessionCorrupt, fmt::format("session file '{}': {} logits for a vocabulary of {}",
                                                        path.string(), n_logits, hp.n_vocab));
  }
  const std::byte* logits = r.take(uint64_t(n_logits) * sizeof(float), "logits");
  logits_.resize(n_logits);
  if (n_logits != 0) std::memcpy(logits_.data(), logits, size_t(n_logits) * sizeof(float));
  const uint64_t rng_len = r.count(1, "random state byte");
  const auto* rng_text = reinterpret_cast<const char*>(r.take(rng_len, "random state"));
  if (rng_len != 0) {
    std::istringstream in(std::string(rng_text, size_t(rng_len)));
    rng_.emplace();
    in >> *rng_;
    if (!in) throw Error(ErrorCode::kSessionCorrupt, fmt::format("session file '{}': bad random state", path.string()));
  }
  // Only the evaluated tokens hold KV positions. A pending token with no position left
  // (saved when the context was full) is kept as saved: the overflow surfaces when
  // something needs that position, as in the live session.
  if (int64_t(d_.token_end) > n_ctx) {
    throw Error(ErrorCode::kContextOverflow,
                fmt::format("session file '{}': {} positions do not fit n_ctx {}", path.string(), d_.token_end, n_ctx));
  }
  if (d_.payload_bytes() != r.left()) {
    throw Error(ErrorCode::kSessionCorrupt, fmt::format("session file '{}': {} bytes of KV pages present, {} expected",
                                                        path.string(), r.left(), d_.payload_bytes()));
  }
  pages_at_ = size_t(r.take(r.left(), "pages") - data_.data());
}

std::unique_ptr<KvSequence> SessionFile::import_kv(KvStore& store, KvTier tier, int32_t max_tokens) const {
  const KvDescriptor* parts[1] = {&d_};
  const std::byte* pages = data_.data() + pages_at_;
  std::vector<uint64_t> at(size_t(d_.n_pages()) + 1, 0);  // page i's payload: [at[i], at[i + 1])
  for (int32_t i = 0; i < d_.n_pages(); ++i) at[size_t(i) + 1] = at[size_t(i)] + d_.page_payload_bytes(i);
  auto payload = [&](size_t, int32_t i) { return pages + at[size_t(i)]; };
  try {
    return kv_import_payloads(parts, payload, store, tier, max_tokens);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kKvChecksum || e.code() == ErrorCode::kKvMismatch) {
      throw Error(ErrorCode::kSessionCorrupt, fmt::format("session file '{}': {}", path_.string(), e.what()));
    }
    throw;
  }
}

Session::RestoreReport Session::restore(const std::filesystem::path& path) {
  SessionFile f(path, *model_, n_ctx_);
  std::unique_ptr<KvSequence> seq = f.import_kv(*store_, kv_->tier(), n_ctx_);
  // Everything verified: replace the state (nothing below can fail).
  kv_ = std::move(seq);
  tokens_ = f.take_tokens();
  tokens_.reserve(size_t(n_ctx_));
  pending_ = f.pending();
  have_logits_ = !f.logits().empty();
  if (have_logits_) std::copy(f.logits().begin(), f.logits().end(), logits_.begin());
  if (f.rng()) rng_ = *f.rng();  // a scheduler session's file has none: the engine is kept
  gen_->discard_held();          // text held back from before the restore belongs to the old conversation
  return {f.descriptor().dtype, store_->layout().dtype};
}

}  // namespace tandem
