// The prefix cache: each loop keeps the KV of a few recently finished prompts (whole
// pages, never written again) so later requests sharing the prefix reuse the pages
// (KvSequence::share_prefix, copy-on-write) instead of recomputing them. Running
// sequences' prompts are shared the same way. The routing index (page-boundary hashes
// per cached or running prompt) lets submitters see which loop holds how much of a prompt.
#include <algorithm>
#include <unordered_map>

#include "sched/scheduler_internal.hpp"

namespace tandem {

namespace {

uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h;
}

}  // namespace

void boundary_hashes(std::span<const int32_t> tokens, int32_t ps, std::vector<uint64_t>& out) {
  out.clear();
  uint64_t h = 0x12345;
  for (size_t i = 0; i < tokens.size(); ++i) {
    h = mix(h, uint64_t(uint32_t(tokens[i])));
    if ((i + 1) % size_t(ps) == 0) out.push_back(h);
  }
}

using Loop = Scheduler::Impl::Loop;

bool Loop::awaits_sibling_prefill(const Seq& s) const {
  if (s.group == 0 || s.kv || s.session || s.handoff) return false;
  const int32_t want = s.n_prompt_end - 1;  // what share_cached_prefix takes from a sibling
  for (const auto& r : running) {
    if (r && r->group == s.group && r->kv && r->kv->n_tokens() < want) return true;
  }
  return false;
}

int32_t Loop::prefix_tokens_for(std::span<const uint64_t> hashes) {
  std::lock_guard<std::mutex> lk(idx_mu);
  size_t best = 0;
  for (const auto& [k, hs] : prefix_index) {
    size_t n = 0;
    while (n < hs.size() && n < hashes.size() && hs[n] == hashes[n]) ++n;
    best = std::max(best, n);
  }
  return int32_t(best) * ps;
}

void Loop::index_add(uint64_t key, const std::vector<uint64_t>& hashes) {
  if (hashes.empty()) return;
  std::lock_guard<std::mutex> lk(idx_mu);
  prefix_index[key] = hashes;
}

void Loop::index_remove(uint64_t key) {
  std::lock_guard<std::mutex> lk(idx_mu);
  prefix_index.erase(key);
}

void Loop::drop_cache_entry(size_t i) {
  index_remove(cache[i].key);
  cache.erase(cache.begin() + std::ptrdiff_t(i));
}

void Loop::drop_cache() {
  while (!cache.empty()) drop_cache_entry(cache.size() - 1);
}

void Loop::park_prefix(Seq& s) {
  const int32_t keep = std::min(s.n_prompt_end, s.kv->n_tokens()) / ps * ps;
  if (keep < ps || s.kv->tier() != tier || !s.kv->holds_prefix(keep)) return;
  for (const auto& e : cache) {  // already cached (a shared prefix): nothing new to keep
    if (int32_t(e.tokens.size()) >= keep && std::equal(s.tokens.begin(), s.tokens.begin() + keep, e.tokens.begin()))
      return;
  }
  release_reservation(*s.kv);
  s.kv->truncate(keep);
  unpin_kv(s);
  PrefixEntry e;
  e.kv = std::move(s.kv);
  e.tokens.assign(s.tokens.begin(), s.tokens.begin() + keep);
  e.key = (uint64_t(1) << 63) | s.rs->id;
  std::vector<uint64_t> h;
  boundary_hashes(e.tokens, ps, h);
  index_add(e.key, h);
  cache.push_back(std::move(e));
  while (int32_t(cache.size()) > sc->opt.prefix_cache_entries) drop_cache_entry(0);
}

void Loop::count_cache_only_pages() {
  int32_t n = 0;
  if (!cache.empty()) {
    std::unordered_map<PageId, int32_t> refs;  // references held by cache entries
    for (const auto& e : cache) {
      for (const PageId p : e.kv->held_page_ids()) ++refs[p];
    }
    for (const auto& [page, k] : refs) {
      if (store->refcount(page) <= k) ++n;
    }
  }
  cache_only_pages.store(n, std::memory_order_relaxed);
}

int32_t Loop::share_cached_prefix(Seq& s) {
  const int32_t limit = int32_t(s.tokens.size()) - 1;  // the last token must be computed
  const KvSequence* best = nullptr;
  int32_t best_n = 0;
  bool best_sibling = false;
  auto consider = [&](const KvSequence& kv, std::span<const int32_t> toks, bool sibling) {
    if (kv.tier() != tier || kv.pages_outside(tier) > 0) return;
    const int32_t n = std::min({kv.n_tokens(), int32_t(toks.size()), limit});
    int32_t i = 0;
    while (i < n && toks[size_t(i)] == s.tokens[size_t(i)]) ++i;
    // Whole pages only (nobody writes a shared page), except from another choice of the
    // same submit_n: it shares the partly filled last page too, and whichever of the two
    // writes into that page first copies it (KvSequence::reserve, copy-on-write).
    if (!sibling) i = i / ps * ps;
    if (i > best_n && kv.holds_prefix(i)) {
      best_n = i;
      best = &kv;
      best_sibling = sibling;
    }
  };
  for (const auto& e : cache) consider(*e.kv, e.tokens, false);
  for (const auto& r : running) {
    if (r && r->kv) consider(*r->kv, r->tokens, s.group != 0 && r->group == s.group);
  }
  if (!best || best_n == 0 || (best_n < ps && !best_sibling)) return 0;
  s.kv->share_prefix(*best, best_n);
  return best_n;
}

}  // namespace tandem
