#include "tandem/kv/kv_contract.hpp"

#include <fmt/format.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "cpu/cpu_kernels.hpp"

namespace tandem {

KvLayout KvLayout::for_model(const HParams& hp, int32_t page_size, KvDtype dtype) {
  KvLayout l;
  l.n_layer = hp.n_layer;
  l.layer_begin = 0;
  l.n_head_kv = hp.n_head_kv;
  l.head_dim = hp.head_dim;
  l.page_size = page_size;
  l.dtype = dtype;
  l.window = hp.n_swa;
  l.window_pattern = hp.swa_pattern;
  l.window_slack = std::min(256, hp.n_swa / 2);
  if (dtype == KvDtype::kQ8_0 && l.row_elems() % kKvQ8Block != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("KV layout: a q8_0 KV cache needs n_head_kv x head_dim ({} x {} = {}) to be a multiple of "
                            "32 (one Q8_0 block); use f16",
                            l.n_head_kv, l.head_dim, l.row_elems()));
  }
  return l;
}

bool KvDescriptor::carries(int32_t page, int32_t layer) const noexcept {
  const bool windowed = window > 0 && window_pattern > 0 && layer % window_pattern < window_pattern - 1;
  return !windowed || page >= window_begin / page_size;
}

uint64_t KvDescriptor::payload_layer_offset(int32_t page, int32_t layer) const noexcept {
  uint64_t layers = 0;
  for (int32_t il = layer_begin; il < layer; ++il) layers += carries(page, il) ? 1 : 0;
  return layers * 2 * uint64_t(page_size) * row_bytes;
}

uint64_t KvDescriptor::page_payload_bytes(int32_t page) const noexcept {
  return payload_layer_offset(page, layer_end);
}

uint64_t KvDescriptor::payload_bytes() const noexcept {
  uint64_t n = 0;
  for (int32_t i = 0; i < n_pages(); ++i) n += page_payload_bytes(i);
  return n;
}

std::string_view kv_lease_state_name(KvLeaseState s) noexcept {
  switch (s) {
    case KvLeaseState::kPending:
      return "pending";
    case KvLeaseState::kReading:
      return "reading";
    case KvLeaseState::kConfirmed:
      return "confirmed";
    case KvLeaseState::kFailed:
      return "failed";
    case KvLeaseState::kExpired:
      return "expired";
  }
  return "?";
}

// ------------------------------------------------------------------------------ lease

KvLease::KvLease(KvStore& store, std::vector<PageId> pages, std::chrono::steady_clock::time_point deadline)
    : store_(&store), pages_(std::move(pages)), deadline_(deadline) {}

KvLease::~KvLease() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ == KvLeaseState::kPending || state_ == KvLeaseState::kReading) {
    finish_locked(KvLeaseState::kExpired, "the lease was dropped before it was confirmed");
  }
}

void KvLease::finish_locked(KvLeaseState s, const std::string& why) {
  state_ = s;
  failure_ = why;
  for (PageId p : pages_) {
    if (p != kNoPage) store_->release(p);
  }
  pages_.clear();
}

KvLeaseState KvLease::state() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ == KvLeaseState::kPending && std::chrono::steady_clock::now() > deadline_) {
    finish_locked(KvLeaseState::kExpired, "the deadline passed before the receiver read the pages");
  }
  return state_;
}

std::string KvLease::failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

void KvLease::begin_read() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ == KvLeaseState::kPending && std::chrono::steady_clock::now() > deadline_) {
    finish_locked(KvLeaseState::kExpired, "the deadline passed before the receiver read the pages");
  }
  if (state_ == KvLeaseState::kExpired) {
    throw Error(ErrorCode::kKvLeaseExpired, "KV hand-off: the lease expired: " + failure_);
  }
  if (state_ != KvLeaseState::kPending) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("KV hand-off: the lease is {}, not pending", kv_lease_state_name(state_)));
  }
  state_ = KvLeaseState::kReading;
}

void KvLease::confirm() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ == KvLeaseState::kReading) finish_locked(KvLeaseState::kConfirmed, "");
}

void KvLease::fail(const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ == KvLeaseState::kReading || state_ == KvLeaseState::kPending) finish_locked(KvLeaseState::kFailed, why);
}

// ----------------------------------------------------------------------------- export

namespace {

uint64_t checksum(const std::byte* p, uint64_t n) {
  return XXH3_64bits(p, size_t(n));
}

[[noreturn]] void mismatch(const std::string& what) {
  throw Error(ErrorCode::kKvMismatch, "KV contract: " + what);
}

}  // namespace

namespace {

// Page `page`'s payload from `group_pages` (the page of each group of `store`'s layout,
// kNoPage where not carried): each carried layer's K and V rows, copied out of its group's
// page (read once per group, under the store's lock).
void gather_payload(const KvStore& store, std::span<const PageId> group_pages, const KvDescriptor& d, int32_t page,
                    std::vector<std::byte>& out) {
  const KvLayout& l = store.layout();
  out.resize(size_t(d.page_payload_bytes(page)));
  const size_t slice = 2 * size_t(d.page_size) * size_t(d.row_bytes);
  std::vector<std::vector<std::byte>> read(group_pages.size());
  size_t at = 0;
  for (int32_t layer = d.layer_begin; layer < d.layer_end; ++layer) {
    if (!d.carries(page, layer)) continue;
    const KvLayout::Place pl = l.place(layer);
    std::vector<std::byte>& bytes = read[size_t(pl.group)];
    if (bytes.empty()) {
      bytes.resize(l.page_bytes());
      store.read_page(group_pages[size_t(pl.group)], bytes.data());
    }
    std::memcpy(out.data() + at, bytes.data() + l.row_offset(pl.slot, 0, 0), slice);
    at += slice;
  }
}

}  // namespace

KvHandoff kv_export(const KvSequence& seq, const Model& model, std::span<const int32_t> tokens,
                    std::chrono::milliseconds ttl, int32_t layer_begin, int32_t layer_end) {
  const KvStore& store = seq.store();
  const KvLayout& l = store.layout();
  const HParams& hp = model.hparams();
  if (layer_end < 0) layer_end = l.layer_begin + l.n_layer;
  if (static_cast<int64_t>(tokens.size()) != seq.n_tokens()) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("KV export: {} token ids given for a sequence of {} positions",
                                                         tokens.size(), seq.n_tokens()));
  }
  if (layer_begin < l.layer_begin || layer_end > l.layer_begin + l.n_layer || layer_begin >= layer_end) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("KV export: layers [{}, {}) are not inside the pages' layers [{}, {})", layer_begin,
                            layer_end, l.layer_begin, l.layer_begin + l.n_layer));
  }
  KvDescriptor d;
  d.model_identity = model.identity_hash();
  d.tokenizer_identity = model.tokenizer().identity_hash();
  d.n_layer = hp.n_layer;
  d.n_head_kv = l.n_head_kv;
  d.head_dim = l.head_dim;
  d.row_bytes = l.row_bytes();
  d.rope_type = hp.rope_type;
  d.rope_freq_base = hp.rope_freq_base;
  d.rope_freq_scale = hp.rope_freq_scale;
  d.n_rot = hp.n_rot;
  d.n_ctx = seq.max_tokens();
  d.dtype = l.dtype;
  d.page_size = l.page_size;
  d.layer_begin = layer_begin;
  d.layer_end = layer_end;
  d.window = hp.n_swa;
  d.window_pattern = hp.swa_pattern;
  // The windowed layers' rows travel from the window (and its slack) of a query at n_tokens,
  // as far back as the sender holds them.
  d.window_begin = std::max(seq.window_from(), l.window_live_page(seq.n_tokens()) * l.page_size);
  d.token_begin = 0;
  d.token_end = seq.n_tokens();
  d.tokens.assign(tokens.begin(), tokens.end());
  d.sequence_id = seq.id();
  const int32_t n_pages = (seq.n_tokens() + l.page_size - 1) / l.page_size;
  const int32_t n_groups = l.n_groups();
  std::vector<PageId> pages(size_t(n_pages) * size_t(n_groups), kNoPage);
  for (int32_t i = 0; i < n_pages; ++i) {
    for (int32_t layer = layer_begin; layer < layer_end; ++layer) {
      if (!d.carries(i, layer)) continue;
      const int32_t g = l.place(layer).group;
      const PageId p = seq.page(g, i);
      if (p == kNoPage) {
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("KV export: page {} of layer {} was released (outside the window)", i, layer));
      }
      pages[size_t(i) * size_t(n_groups) + size_t(g)] = p;
    }
  }
  KvStore& mstore = seq.store();
  for (PageId p : pages) {
    if (p != kNoPage) mstore.retain(p);
  }
  seq.mark_pages_shared();  // a sender that keeps writing copies its tail page first
  KvHandoff h;
  h.lease = std::make_shared<KvLease>(mstore, std::move(pages), std::chrono::steady_clock::now() + ttl);
  std::vector<std::byte> buf;
  for (int32_t i = 0; i < n_pages; ++i) {
    kv_lease_payload(*h.lease, d, i, buf);
    d.page_checksums.push_back(checksum(buf.data(), buf.size()));
  }
  h.descriptor = std::move(d);
  return h;
}

void kv_lease_payload(const KvLease& lease, const KvDescriptor& d, int32_t page, std::vector<std::byte>& out) {
  const KvStore& store = lease.store();
  const auto n_groups = size_t(store.layout().n_groups());
  const std::vector<PageId>& pages = lease.pages();
  if (page < 0 || (size_t(page) + 1) * n_groups > pages.size()) {
    throw Error(ErrorCode::kKvLeaseExpired,
                fmt::format("KV hand-off: the lease holds no page {} (released or never leased)", page));
  }
  gather_payload(store, std::span<const PageId>(pages).subspan(size_t(page) * n_groups, n_groups), d, page, out);
}

// ----------------------------------------------------------------------------- import

void kv_check_invariants(const KvDescriptor& d, const Model& model) {
  const HParams& hp = model.hparams();
  if (d.contract_version != kKvContractVersion) {
    mismatch(fmt::format("contract version {} (this build speaks {})", d.contract_version, kKvContractVersion));
  }
  if (d.model_identity != model.identity_hash()) {
    mismatch(fmt::format("model identity {:016x} differs from the receiver's {:016x} (other weights)", d.model_identity,
                         model.identity_hash()));
  }
  if (d.tokenizer_identity != model.tokenizer().identity_hash()) {
    mismatch(fmt::format("tokenizer identity {:016x} differs from the receiver's {:016x}", d.tokenizer_identity,
                         model.tokenizer().identity_hash()));
  }
  if (d.n_layer != hp.n_layer || d.n_head_kv != hp.n_head_kv || d.head_dim != hp.head_dim) {
    mismatch(fmt::format("attention layout {} layers x {} KV heads x {} dims, receiver {} x {} x {}", d.n_layer,
                         d.n_head_kv, d.head_dim, hp.n_layer, hp.n_head_kv, hp.head_dim));
  }
  if (d.rope_type != hp.rope_type || d.rope_freq_base != hp.rope_freq_base || d.rope_freq_scale != hp.rope_freq_scale ||
      d.n_rot != hp.n_rot) {
    mismatch(fmt::format("RoPE (type {}, base {}, scale {}, dims {}) differs from the receiver's ({}, {}, {}, {})",
                         int(d.rope_type), d.rope_freq_base, d.rope_freq_scale, d.n_rot, int(hp.rope_type),
                         hp.rope_freq_base, hp.rope_freq_scale, hp.n_rot));
  }
  // The dtype and the row size must agree (a q8_0 row is never taken for f16 or f32 bytes).
  const uint64_t row = kv_row_bytes(d.dtype, uint64_t(d.n_head_kv) * uint64_t(d.head_dim));
  if (row == 0 || d.row_bytes != row) {
    mismatch(fmt::format("row size {} bytes does not fit dtype {} ({}) x {} KV heads x {} dims", d.row_bytes,
                         static_cast<uint32_t>(d.dtype), kv_dtype_name(d.dtype), d.n_head_kv, d.head_dim));
  }
  if (d.page_size <= 0 || d.layer_begin < 0 || d.layer_end > d.n_layer || d.layer_begin >= d.layer_end) {
    mismatch(fmt::format("page size {} or layer range [{}, {}) is invalid", d.page_size, d.layer_begin, d.layer_end));
  }
  if (d.window != hp.n_swa || d.window_pattern != hp.swa_pattern) {
    mismatch(fmt::format("sliding window {} (pattern {}) differs from the receiver's {} ({})", d.window,
                         d.window_pattern, hp.n_swa, hp.swa_pattern));
  }
  if (d.token_begin != 0 || d.token_end < 0 || static_cast<size_t>(d.token_end) != d.tokens.size()) {
    throw Error(ErrorCode::kKvTokenRange,
                fmt::format("KV contract: token range [{}, {}) with {} ids does not start at position 0 or has a gap",
                            d.token_begin, d.token_end, d.tokens.size()));
  }
  for (size_t i = 0; i < d.tokens.size(); ++i) {
    if (d.tokens[i] < 0 || d.tokens[i] >= hp.n_vocab) {
      throw Error(ErrorCode::kKvTokenRange,
                  fmt::format("KV contract: token id {} at position {} is outside the vocabulary", d.tokens[i], i));
    }
  }
  const int64_t pages = (int64_t(d.token_end) + d.page_size - 1) / d.page_size;
  if (pages != d.n_pages()) {
    mismatch(fmt::format("{} page checksums for {} positions in pages of {}", d.n_pages(), d.token_end, d.page_size));
  }
  // The windowed rows must reach back to the first position a query at token_end sees.
  const int64_t needed = d.window > 0 ? std::max<int64_t>(0, int64_t(d.token_end) - d.window + 1) : 0;
  if (d.window_begin < 0 || d.window_begin > needed) {
    mismatch(fmt::format("the windowed layers' rows start at position {}, a query at position {} needs {} on",
                         d.window_begin, d.token_end, needed));
  }
}

std::unique_ptr<KvSequence> kv_import_payloads(std::span<const KvDescriptor* const> parts,
                                               const std::function<const std::byte*(size_t, int32_t)>& payload,
                                               KvStore& dst, KvTier tier, int32_t max_tokens) {
  if (parts.empty()) throw Error(ErrorCode::kInvalidArgument, "KV import: no hand-off given");
  const KvDescriptor& first = *parts[0];
  // The parts must be the same tokens and cover every layer exactly once.
  std::vector<const KvDescriptor*> sorted(parts.begin(), parts.end());
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->layer_begin < b->layer_begin; });
  int32_t next_layer = 0;
  for (const KvDescriptor* d : sorted) {
    if (d->tokens != first.tokens || d->dtype != first.dtype || d->page_size != first.page_size ||
        d->sequence_id != first.sequence_id || d->window_begin != first.window_begin) {
      mismatch("the layer ranges of one hand-off describe different tokens, dtypes, page sizes or sequences");
    }
    if (d->layer_begin != next_layer) {
      mismatch(fmt::format("layer ranges leave a gap or overlap at layer {} (next range starts at {})", next_layer,
                           d->layer_begin));
    }
    next_layer = d->layer_end;
  }
  if (next_layer != first.n_layer)
    mismatch(fmt::format("layer ranges end at {} of {} layers", next_layer, first.n_layer));

  const KvLayout& dl = dst.layout();
  if (dl.layer_begin != 0 || dl.n_layer != first.n_layer || dl.n_head_kv != first.n_head_kv ||
      dl.head_dim != first.head_dim || dl.window != first.window || dl.window_pattern != first.window_pattern) {
    mismatch(fmt::format(
        "the receiving store holds {} layers from {} x {} KV heads x {} dims (window {}, pattern {}), the hand-off "
        "{} x {} x {} (window {}, pattern {})",
        dl.n_layer, dl.layer_begin, dl.n_head_kv, dl.head_dim, dl.window, dl.window_pattern, first.n_layer,
        first.n_head_kv, first.head_dim, first.window, first.window_pattern));
  }
  if (first.token_end > max_tokens) {
    throw Error(ErrorCode::kKvTokenRange, fmt::format("KV import: {} positions do not fit the receiver's context of {}",
                                                      first.token_end, max_tokens));
  }
  // Checksums first: nothing is allocated for a damaged hand-off.
  for (size_t pi = 0; pi < parts.size(); ++pi) {
    const KvDescriptor& d = *parts[pi];
    for (int32_t i = 0; i < d.n_pages(); ++i) {
      const std::byte* b = payload(pi, i);
      if (checksum(b, d.page_payload_bytes(i)) != d.page_checksums[size_t(i)]) {
        throw Error(ErrorCode::kKvChecksum, fmt::format("KV import: page {} (layers [{}, {})) fails its checksum", i,
                                                        d.layer_begin, d.layer_end));
      }
    }
  }

  auto seq = std::make_unique<KvSequence>(dst, max_tokens, tier);
  seq->reserve_filled(first.token_end, first.window_begin);  // windowed pages from window_begin's on
  const size_t n_elem = size_t(first.n_head_kv) * size_t(first.head_dim);
  const int32_t sp = first.page_size;
  const int32_t dp = dl.page_size;
  std::vector<std::byte> page(dl.page_bytes());
  std::vector<std::byte> back(dl.page_bytes());
  auto src_row = [&](size_t pi, int32_t layer, int kind, int32_t pos) {
    const KvDescriptor& d = *parts[pi];
    const std::byte* b = payload(pi, pos / sp) + d.payload_layer_offset(pos / sp, layer);
    return b + (size_t(kind) * size_t(sp) + size_t(pos % sp)) * d.row_bytes;
  };
  // One row from the hand-off's dtype to the store's: the same dtype is copied byte for
  // byte; otherwise through f32 (exact from f16 and q8_0), then rounded to f16 (nearest
  // even) or quantised to Q8_0 (kernels::quantize_row_q8_0) — lossy, so only when the
  // receiving store's layout asks for another dtype.
  std::vector<float> wide(n_elem);
  // A payload may sit at any byte offset (a session file's pages follow its header), so a
  // row is staged in an aligned buffer before it is read as uint16_t / BlockQ8_0 / float.
  std::vector<std::byte> staged(size_t(first.row_bytes));
  auto convert = [&](const std::byte* row, std::byte* out) {
    if (first.dtype == dl.dtype) {
      std::memcpy(out, row, size_t(first.row_bytes));
      return;
    }
    std::memcpy(staged.data(), row, staged.size());
    const std::byte* src = staged.data();
    float* f = dl.dtype == KvDtype::kF32 ? reinterpret_cast<float*>(out) : wide.data();
    switch (first.dtype) {
      case KvDtype::kF16:
        kernels::fp16_to_fp32_row(reinterpret_cast<const uint16_t*>(src), f, int64_t(n_elem));
        break;
      case KvDtype::kF32:
        std::memcpy(f, src, n_elem * sizeof(float));
        break;
      case KvDtype::kQ8_0:
        kernels::dequantize_row_q8_0(reinterpret_cast<const kernels::BlockQ8_0*>(src), f, int64_t(n_elem));
        break;
    }
    if (dl.dtype == KvDtype::kF16) {
      kernels::fp32_to_fp16_row(f, reinterpret_cast<uint16_t*>(out), int64_t(n_elem));
    } else if (dl.dtype == KvDtype::kQ8_0) {
      kernels::quantize_row_q8_0(f, reinterpret_cast<kernels::BlockQ8_0*>(out), int64_t(n_elem));
    }
  };
  std::vector<std::byte> expect(dl.row_bytes());
  const int32_t n_dst_pages = (first.token_end + dp - 1) / dp;
  // Each page of each group: its layers' rows the hand-off carries (a windowed row before
  // the hand-off's window is seen by no query: it stays zero), written, read back, verified.
  auto each_row = [&](int32_t group, int32_t p0, int32_t p1, auto&& f) {
    for (size_t pi = 0; pi < parts.size(); ++pi) {
      for (int32_t layer = parts[pi]->layer_begin; layer < parts[pi]->layer_end; ++layer) {
        const KvLayout::Place pl = dl.place(layer);
        if (pl.group != group) continue;
        for (int kind = 0; kind < 2; ++kind) {
          for (int32_t pos = p0; pos < p1; ++pos) {
            if (parts[pi]->carries(pos / sp, layer))
              f(src_row(pi, layer, kind, pos), dl.row_offset(pl.slot, kind, pos - p0), layer, pos);
          }
        }
      }
    }
  };
  for (int32_t pg = 0; pg < n_dst_pages; ++pg) {
    const int32_t p0 = pg * dp, p1 = std::min(first.token_end, p0 + dp);
    for (int32_t g = 0; g < dl.n_groups(); ++g) {
      const PageId id = seq->page(g, pg);
      if (id == kNoPage) continue;
      std::fill(page.begin(), page.end(), std::byte{0});
      each_row(g, p0, p1, [&](const std::byte* src, size_t off, int32_t, int32_t) { convert(src, page.data() + off); });
      dst.write_page(id, page.data());
      // Verify what landed: each row read back equals an independent conversion of the source.
      dst.read_page(id, back.data());
      each_row(g, p0, p1, [&](const std::byte* src, size_t off, int32_t layer, int32_t pos) {
        convert(src, expect.data());
        if (std::memcmp(expect.data(), back.data() + off, expect.size()) != 0) {
          throw Error(ErrorCode::kKvChecksum,
                      fmt::format("KV import: converted row (layer {}, position {}) differs after writing page {}",
                                  layer, pos, pg));
        }
      });
    }
  }
  return seq;
}

std::unique_ptr<KvSequence> kv_import(std::span<const KvHandoff> parts, const Model& model, KvStore& dst, KvTier tier,
                                      int32_t max_tokens, std::span<const int32_t> expected_tokens) {
  size_t begun = 0;
  try {
    for (const auto& h : parts) {
      if (!h.lease) throw Error(ErrorCode::kInvalidArgument, "KV import: a hand-off has no lease");
      h.lease->begin_read();
      ++begun;
    }
    std::vector<const KvDescriptor*> descs;
    for (const auto& h : parts) {
      kv_check_invariants(h.descriptor, model);
      descs.push_back(&h.descriptor);
    }
    if (!expected_tokens.empty() && !std::equal(expected_tokens.begin(), expected_tokens.end(),
                                                parts[0].descriptor.tokens.begin(), parts[0].descriptor.tokens.end())) {
      throw Error(ErrorCode::kKvTokenRange, "KV import: the hand-off's token ids differ from the expected ones");
    }
    // Payloads gathered from the sender's pages (held by the leases), once per page.
    std::vector<std::vector<std::vector<std::byte>>> staged(parts.size());
    auto payload = [&](size_t pi, int32_t page) -> const std::byte* {
      auto& st = staged[pi];
      if (st.empty()) st.resize(size_t(parts[pi].descriptor.n_pages()));
      if (st[size_t(page)].empty()) kv_lease_payload(*parts[pi].lease, parts[pi].descriptor, page, st[size_t(page)]);
      return st[size_t(page)].data();
    };
    auto seq = kv_import_payloads(descs, payload, dst, tier, max_tokens);
    for (const auto& h : parts) h.lease->confirm();
    return seq;
  } catch (const std::exception& e) {
    for (size_t i = 0; i < begun; ++i) parts[i].lease->fail(e.what());
    throw;
  }
}

// ----------------------------------------------------------------------------- bytes

namespace {

/// The byte form's one field list, in order; `f(field, name)` for each (the writer and
/// the reader both walk it, so they cannot disagree).
template <class D, class F>
void descriptor_fields(D& d, F&& f) {
  f(d.contract_version, "contract version");
  f(d.model_identity, "model identity");
  f(d.tokenizer_identity, "tokenizer identity");
  f(d.n_layer, "n_layer");
  f(d.n_head_kv, "n_head_kv");
  f(d.head_dim, "head_dim");
  f(d.row_bytes, "row_bytes");
  f(d.rope_type, "rope_type");
  f(d.rope_freq_base, "rope_freq_base");
  f(d.rope_freq_scale, "rope_freq_scale");
  f(d.n_rot, "n_rot");
  f(d.n_ctx, "n_ctx");
  f(d.dtype, "dtype");
  f(d.page_size, "page_size");
  f(d.layer_begin, "layer_begin");
  f(d.layer_end, "layer_end");
  f(d.window, "window");
  f(d.window_pattern, "window_pattern");
  f(d.window_begin, "window_begin");
  f(d.token_begin, "token_begin");
  f(d.token_end, "token_end");
  f(d.sequence_id, "sequence_id");
  f(d.tokens, "token");
  f(d.page_checksums, "page checksum");
}

template <class T>
struct IsVector : std::false_type {};
template <class T>
struct IsVector<std::vector<T>> : std::true_type {};

void append_bytes(std::vector<std::byte>& out, const void* p, size_t n) {
  if (n == 0) return;
  const size_t at = out.size();
  out.resize(at + n);
  std::memcpy(out.data() + at, p, n);
}

}  // namespace

void kv_descriptor_append(const KvDescriptor& d, std::vector<std::byte>& out) {
  descriptor_fields(d, [&](const auto& v, const char*) {
    using T = std::remove_cvref_t<decltype(v)>;
    if constexpr (IsVector<T>::value) {  // u64 count, then the items
      const uint64_t n = v.size();
      append_bytes(out, &n, sizeof(n));
      append_bytes(out, v.data(), v.size() * sizeof(typename T::value_type));
    } else if constexpr (std::is_enum_v<T>) {  // enums are u32
      const auto u = static_cast<uint32_t>(v);
      append_bytes(out, &u, sizeof(u));
    } else {
      append_bytes(out, &v, sizeof(v));
    }
  });
}

size_t kv_descriptor_parse(std::span<const std::byte> bytes, KvDescriptor& d) {
  size_t at = 0;
  auto take = [&](void* p, size_t n, const char* what) {
    if (n > bytes.size() - at) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("KV descriptor: truncated reading {} at offset {}", what, at));
    }
    if (n > 0) std::memcpy(p, bytes.data() + at, n);  // an empty vector's data() may be null
    at += n;
  };
  descriptor_fields(d, [&](auto& v, const char* what) {
    using T = std::remove_cvref_t<decltype(v)>;
    if constexpr (IsVector<T>::value) {
      uint64_t n = 0;
      take(&n, sizeof(n), what);
      constexpr size_t item = sizeof(typename T::value_type);
      if (n > (bytes.size() - at) / item) {  // checked before anything is allocated
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("KV descriptor: {} count {} at offset {} exceeds the {} bytes left", what, n, at - 8,
                                bytes.size() - at));
      }
      v.resize(size_t(n));
      take(v.data(), size_t(n) * item, what);
    } else if constexpr (std::is_enum_v<T>) {
      uint32_t u = 0;
      take(&u, sizeof(u), what);
      v = static_cast<T>(u);
    } else {
      take(&v, sizeof(v), what);
    }
  });
  return at;
}

}  // namespace tandem
