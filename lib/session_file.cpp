// Session files: Session::save / Session::restore.
//
// Layout (little-endian):
//   header  "TANDEMSS" | u32 version (1) | u32 flags (0) | u64 body_bytes
//   body    descriptor: u32 contract_version, u64 model_identity, u64 tokenizer_identity,
//                       i32 n_layer, n_head_kv, head_dim, u64 row_bytes, u32 rope_type,
//                       f32 rope_freq_base, rope_freq_scale, i32 n_rot, n_ctx,
//                       u32 dtype, i32 page_size, layer_begin, layer_end, token_begin,
//                       token_end, u64 sequence_id, u64 n_tokens, i32 tokens[n_tokens],
//                       u64 n_pages, u64 checksums[n_pages]
//           i32 pending (-1: none) | u32 n_logits | f32 logits[n_logits]
//           u64 rng_len | rng state text (std::mt19937_64 operator<<)
//           page payloads, n_pages x descriptor.page_payload_bytes()
//   trailer u64 xxHash3-64 of header and body
// Every length is checked against the bytes left before anything is allocated.
#include <fmt/format.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "tandem/atomic_file.hpp"
#include "tandem/kv_contract.hpp"
#include "tandem/session.hpp"

namespace tandem {

namespace {

constexpr char kMagic[8] = {'T', 'A', 'N', 'D', 'E', 'M', 'S', 'S'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 8 + 4 + 4 + 8;

class Writer {
 public:
  template <class T>
  void put(const T& v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out.insert(out.end(), p, p + sizeof(T));
  }
  void bytes(const void* p, size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    out.insert(out.end(), b, b + n);
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

void Session::save(const std::filesystem::path& path) const {
  const KvHandoff h = kv_export(*kv_, *model_, tokens_, std::chrono::seconds(60));
  const KvDescriptor& d = h.descriptor;
  Writer w;
  w.bytes(kMagic, sizeof(kMagic));
  w.put(kVersion);
  w.put(uint32_t{0});
  w.put(uint64_t{0});  // body size, patched below
  w.put(d.contract_version);
  w.put(d.model_identity);
  w.put(d.tokenizer_identity);
  w.put(d.n_layer);
  w.put(d.n_head_kv);
  w.put(d.head_dim);
  w.put(d.row_bytes);
  w.put(static_cast<uint32_t>(d.rope_type));
  w.put(d.rope_freq_base);
  w.put(d.rope_freq_scale);
  w.put(d.n_rot);
  w.put(d.n_ctx);
  w.put(static_cast<uint32_t>(d.dtype));
  w.put(d.page_size);
  w.put(d.layer_begin);
  w.put(d.layer_end);
  w.put(d.token_begin);
  w.put(d.token_end);
  w.put(d.sequence_id);
  w.put(uint64_t(d.tokens.size()));
  w.bytes(d.tokens.data(), d.tokens.size() * sizeof(int32_t));
  w.put(uint64_t(d.page_checksums.size()));
  w.bytes(d.page_checksums.data(), d.page_checksums.size() * sizeof(uint64_t));
  w.put(pending_ ? *pending_ : int32_t{-1});
  const uint32_t n_logits = have_logits_ ? static_cast<uint32_t>(logits_.size()) : 0;
  w.put(n_logits);
  w.bytes(logits_.data(), size_t(n_logits) * sizeof(float));
  std::ostringstream rng;
  rng << rng_;
  const std::string rs = rng.str();
  w.put(uint64_t(rs.size()));
  w.bytes(rs.data(), rs.size());
  const KvStore& src = h.lease->store();
  const size_t off = src.layout().row_offset(0, 0, 0);
  std::vector<std::byte> page(src.layout().page_bytes());
  for (PageId p : h.lease->pages()) {
    const std::byte* b = src.page_data(p);
    if (!b) {
      src.read_page(p, page.data());
      b = page.data();
    }
    w.bytes(b + off, size_t(d.page_payload_bytes()));
  }
  h.lease->begin_read();
  h.lease->confirm();
  const uint64_t body = w.out.size() - kHeaderBytes;
  std::memcpy(w.out.data() + 16, &body, sizeof(body));
  w.put(uint64_t(XXH3_64bits(w.out.data(), w.out.size())));
  write_file_atomic(path, w.out);
}

void Session::restore(const std::filesystem::path& path) {
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

  Reader r(data.data() + kHeaderBytes, size_t(body));
  KvDescriptor d;
  d.contract_version = r.get<uint32_t>("contract version");
  d.model_identity = r.get<uint64_t>("model identity");
  d.tokenizer_identity = r.get<uint64_t>("tokenizer identity");
  if (d.model_identity != model_->identity_hash() || d.tokenizer_identity != model_->tokenizer().identity_hash()) {
    throw Error(ErrorCode::kSessionModelMismatch,
                fmt::format("session file '{}': saved with model {:016x} / tokenizer {:016x}, this session runs "
                            "{:016x} / {:016x}",
                            path.string(), d.model_identity, d.tokenizer_identity, model_->identity_hash(),
                            model_->tokenizer().identity_hash()));
  }
  d.n_layer = r.get<int32_t>("n_layer");
  d.n_head_kv = r.get<int32_t>("n_head_kv");
  d.head_dim = r.get<int32_t>("head_dim");
  d.row_bytes = r.get<uint64_t>("row_bytes");
  d.rope_type = static_cast<RopeType>(r.get<uint32_t>("rope_type"));
  d.rope_freq_base = r.get<float>("rope_freq_base");
  d.rope_freq_scale = r.get<float>("rope_freq_scale");
  d.n_rot = r.get<int32_t>("n_rot");
  d.n_ctx = r.get<int32_t>("n_ctx");
  d.dtype = static_cast<KvDtype>(r.get<uint32_t>("dtype"));
  d.page_size = r.get<int32_t>("page_size");
  d.layer_begin = r.get<int32_t>("layer_begin");
  d.layer_end = r.get<int32_t>("layer_end");
  d.token_begin = r.get<int32_t>("token_begin");
  d.token_end = r.get<int32_t>("token_end");
  d.sequence_id = r.get<uint64_t>("sequence_id");
  const uint64_t n_tokens = r.count(sizeof(int32_t), "token");
  d.tokens.resize(size_t(n_tokens));
  std::memcpy(d.tokens.data(), r.take(n_tokens * sizeof(int32_t), "tokens"), size_t(n_tokens) * sizeof(int32_t));
  const uint64_t n_pages = r.count(sizeof(uint64_t), "page checksum");
  d.page_checksums.resize(size_t(n_pages));
  std::memcpy(d.page_checksums.data(), r.take(n_pages * sizeof(uint64_t), "checksums"), size_t(n_pages) * 8);
  try {
    kv_check_invariants(d, *model_);
  } catch (const Error& e) {
    throw Error(e.code() == ErrorCode::kKvMismatch ? ErrorCode::kSessionModelMismatch : ErrorCode::kSessionCorrupt,
                fmt::format("session file '{}': {}", path.string(), e.what()));
  }
  const int32_t pending = r.get<int32_t>("pending token");
  if (pending < -1 || pending >= model_->hparams().n_vocab) {
    throw Error(ErrorCode::kSessionCorrupt,
                fmt::format("session file '{}': pending token {} is invalid", path.string(), pending));
  }
  const auto n_logits = r.get<uint32_t>("logits count");
  if (n_logits != 0 && n_logits != uint32_t(model_->hparams().n_vocab)) {
    throw Error(ErrorCode::kSessionCorrupt, fmt::format("session file '{}': {} logits for a vocabulary of {}",
                                                        path.string(), n_logits, model_->hparams().n_vocab));
  }
  const std::byte* logits = r.take(uint64_t(n_logits) * sizeof(float), "logits");
  const uint64_t rng_len = r.count(1, "random state byte");
  const auto* rng_text = reinterpret_cast<const char*>(r.take(rng_len, "random state"));
  std::mt19937_64 rng;
  {
    std::istringstream in(std::string(rng_text, size_t(rng_len)));
    in >> rng;
    if (!in) throw Error(ErrorCode::kSessionCorrupt, fmt::format("session file '{}': bad random state", path.string()));
  }
  const int64_t need = int64_t(d.token_end) + (pending >= 0 ? 1 : 0);
  if (need > n_ctx_) {
    throw Error(ErrorCode::kContextOverflow,
                fmt::format("session file '{}': {} positions do not fit n_ctx {}", path.string(), need, n_ctx_));
  }
  if (uint64_t(d.n_pages()) * d.page_payload_bytes() != r.left()) {
    throw Error(ErrorCode::kSessionCorrupt,
                fmt::format("session file '{}': {} bytes of KV pages present, {} expected", path.string(), r.left(),
                            uint64_t(d.n_pages()) * d.page_payload_bytes()));
  }
  const std::byte* pages = r.take(r.left(), "pages");
  const KvDescriptor* parts[1] = {&d};
  auto payload = [&](size_t, int32_t i) { return pages + uint64_t(i) * d.page_payload_bytes(); };
  std::unique_ptr<KvSequence> seq;
  try {
    seq = kv_import_payloads(parts, payload, *store_, kv_->tier(), n_ctx_);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kKvChecksum || e.code() == ErrorCode::kKvMismatch) {
      throw Error(ErrorCode::kSessionCorrupt, fmt::format("session file '{}': {}", path.string(), e.what()));
    }
    throw;
  }
  // Everything verified: replace the state (nothing below can fail).
  kv_ = std::move(seq);
  tokens_ = std::move(d.tokens);
  tokens_.reserve(size_t(n_ctx_));
  pending_ = pending >= 0 ? std::optional<int32_t>(pending) : std::nullopt;
  have_logits_ = n_logits != 0;
  if (have_logits_) std::memcpy(logits_.data(), logits, size_t(n_logits) * sizeof(float));
  rng_ = rng;
  detok_.finish();  // text held back from before the restore belongs to the old conversation
}

}  // namespace tandem
