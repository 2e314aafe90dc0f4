#include "tandem/sched/routing_policy.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

namespace tandem {

std::string_view sla_class_name(SlaClass c) noexcept {
  switch (c) {
    case SlaClass::kInteractive:
      return "interactive";
    case SlaClass::kStandard:
      return "standard";
    case SlaClass::kBatch:
      return "batch";
  }
  return "?";
}

std::optional<SlaClass> parse_sla_class(std::string_view s) noexcept {
  if (s == "interactive") return SlaClass::kInteractive;
  if (s == "standard") return SlaClass::kStandard;
  if (s == "batch") return SlaClass::kBatch;
  return std::nullopt;
}

double DefaultRoutingPolicy::est_prefill_s(const ExecutorView& e, int32_t prompt_tokens) noexcept {
  double tps = e.prefill_tps;
  if (e.decoding > 0 && e.token_tps > 0 && e.prefill_chunk > 0) {
    const double c = double(e.prefill_chunk);
    tps = std::min(tps, e.token_tps * c / (c + double(e.decoding)));
  }
  tps = std::max(tps, 1e-6);
  const double fresh = double(std::max<int64_t>(0, int64_t{prompt_tokens} - e.prefix_tokens));
  const double ahead =
      double(std::max<int64_t>(0, e.queued_tokens)) + double(std::max<int64_t>(0, e.running_prompt_tokens));
  return (ahead + fresh) / tps;
}

double DefaultRoutingPolicy::est_decode_s(const ExecutorView& e, int32_t n) noexcept {
  const double tps = std::max(e.decode_tps, 1e-6);
  // A full batch slows each sequence; waiting for a slot costs about one more run.
  const double load = 1.0 + double(e.running + e.queued) / double(std::max(e.max_running, 1));
  return double(n) / tps * load;
}

namespace {

std::string view_numbers(const ExecutorView& e, int32_t prompt, int32_t out) {
  return fmt::format(
      "{}[pf {:.0f} t/s, dec {:.0f} t/s, queued {} ({} tok), running {}/{} ({} prompt tok, {} decoding), kv free {}, "
      "prefix {}, "
      "est prefill {:.3f}s decode {:.3f}s{}]",
      e.name, e.prefill_tps, e.decode_tps, e.queued, e.queued_tokens, e.running, e.max_running, e.running_prompt_tokens,
      e.decoding, e.kv_free_pages, e.prefix_tokens, DefaultRoutingPolicy::est_prefill_s(e, prompt),
      DefaultRoutingPolicy::est_decode_s(e, out),
      e.model_tpot_s > 0 ? fmt::format(", model TPOT {:.4f}s", e.model_tpot_s) : std::string());
}

template <class Pred, class Key>
int best_of(std::span<const ExecutorView> ex, Pred pred, Key key) {
  int best = -1;
  double best_key = std::numeric_limits<double>::infinity();
  for (const auto& e : ex) {
    if (!pred(e)) continue;
    const double k = key(e);
    if (best < 0 || k < best_key) {
      best = e.index;
      best_key = k;
    }
  }
  return best;
}

}  // namespace

RouteDecision DefaultRoutingPolicy::route(const RouteInput& in, std::span<const ExecutorView> ex) {
  RouteDecision d;
  const int32_t p = in.prompt_tokens, n = in.max_tokens;
  auto total = [&](const ExecutorView& e) { return est_prefill_s(e, p) + est_decode_s(e, n); };
  auto at = [&](int idx) -> const ExecutorView& {
    for (const auto& e : ex) {
      if (e.index == idx) return e;
    }
    return ex.front();
  };
  auto numbers = [&] {
    std::string s;
    for (const auto& e : ex) {
      s += ' ';
      s += view_numbers(e, p, n);
    }
    return s;
  };
  auto whole = [&](int idx, const char* rule, std::string why) {
    d.prefill = d.decode = idx;
    d.rule = rule;
    d.reason =
        fmt::format("{}: {} (sla {}, prompt {}, out {}) ->{}", rule, why, sla_class_name(in.sla), p, n, numbers());
    return d;
  };
  const bool any_accel = std::any_of(ex.begin(), ex.end(), [](const ExecutorView& e) { return e.accelerator; });
  const bool any_host = std::any_of(ex.begin(), ex.end(), [](const ExecutorView& e) { return !e.accelerator; });
  auto is_accel = [](const ExecutorView& e) { return e.accelerator; };
  auto is_host = [](const ExecutorView& e) { return !e.accelerator; };
  auto all = [](const ExecutorView&) { return true; };

  // R1: one executor.
  if (ex.size() == 1) return whole(ex.front().index, "R1", "single executor");

  // R2: a continued session stays where its KV is, unless an interactive request finds it
  // on a non-accelerator while an accelerator exists (SLA upgrade: migrate once).
  if (in.session_executor >= 0) {
    const ExecutorView& s = at(in.session_executor);
    if (in.sla == SlaClass::kInteractive && !s.accelerator && any_accel) {
      const int a = best_of(ex, is_accel, total);
      return whole(a, "R2",
                   fmt::format("SLA upgrade: session on {} (not an accelerator) migrates to {}", s.name, at(a).name));
    }
    return whole(s.index, "R2", fmt::format("session affinity: its KV is on {}", s.name));
  }

  // R3: prefix holder, when it holds enough of the prompt and is not much slower.
  {
    const ExecutorView* holder = nullptr;
    for (const auto& e : ex) {
      if (e.prefix_tokens > 0 && (!holder || e.prefix_tokens > holder->prefix_tokens)) holder = &e;
    }
    if (holder && double(holder->prefix_tokens) >= o_.prefix_fraction * double(p)) {
      const int b = best_of(ex, all, total);
      const double hb = total(*holder), bb = total(at(b));
      if (hb <= o_.prefix_slack * bb + 1e-12) {
        return whole(holder->index, "R3",
                     fmt::format("prefix: {} holds {} of {} prompt tokens, est {:.3f}s <= {:.1f} x best {:.3f}s",
                                 holder->name, holder->prefix_tokens, p, hb, o_.prefix_slack, bb));
      }
    }
  }

  if (!any_accel || !any_host) {
    // R8 (homogeneous executors): least estimated completion time.
    const int b = best_of(ex, all, total);
    return whole(b, "R8", fmt::format("homogeneous executors: least estimated completion on {}", at(b).name));
  }

  // SLO guard for a non-accelerator: true when its estimates meet the class's targets
  // (or no target is set); `why` gets the numbers when they do not.
  const int cls = int(in.sla);
  auto host_meets_slo = [&](const ExecutorView& h, bool prefill_there, std::string& why) {
    const double ttft_t = o_.ttft_target_s[cls], tpot_t = o_.tpot_target_s[cls];
    const double ttft = prefill_there ? est_prefill_s(h, p) : 0.0;
    const double tpot = std::max(est_decode_s(h, 1), h.model_tpot_s);
    if ((ttft_t > 0 && ttft > ttft_t) || (tpot_t > 0 && tpot > tpot_t)) {
      why = fmt::format("host {} would miss the {} SLO (est TTFT {:.3f}s vs {:.3f}s, TPOT {:.3f}s vs {:.3f}s)", h.name,
                        sla_class_name(in.sla), ttft, ttft_t, tpot, tpot_t);
      return false;
    }
    // With a target, a request that would wait for a decode slot is a likely miss.
    if ((ttft_t > 0 || tpot_t > 0) && h.running + h.queued >= h.max_running) {
      why = fmt::format("host {} has no free decode slot ({} running + {} queued >= {})", h.name, h.running, h.queued,
                        h.max_running);
      return false;
    }
    return true;
  };
  const int a = best_of(ex, is_accel, [&](const ExecutorView& e) { return est_prefill_s(e, p); });
  const ExecutorView& av = at(a);
  const int32_t fresh = std::max(0, p - av.prefix_tokens);
  // R4/R5: long prompt -> prefill on the accelerator.
  if (fresh >= o_.long_prompt_tokens) {
    const bool slots_scarce = double(av.running + av.queued) >= o_.decode_scarce_fraction * double(av.max_running);
    const int64_t ps = std::max(av.page_size, 1);
    const int64_t need_pages = (int64_t{p} + n + ps - 1) / ps, queued_pages = (av.queued_tokens + ps - 1) / ps;
    const bool kv_short = o_.handoff_when_kv_short && need_pages + queued_pages > int64_t{av.kv_free_pages};
    // A batch decode the host can carry within its TPOT target leaves the accelerator's
    // steps (and its KV reads) to the requests that need its speed; but while the
    // accelerator has room for it, only a host with TPOT to spare takes it (the split).
    const int h = best_of(ex, is_host, [&](const ExecutorView& e) { return est_decode_s(e, n); });
    const double tpot_t = o_.tpot_target_s[cls];
    const bool accel_room =
        !kv_short && 2 * need_pages + queued_pages <= int64_t{av.kv_free_pages} && av.model_tpot_s <= tpot_t;
    const double host_tpot = std::max(est_decode_s(at(h), 1), at(h).model_tpot_s);
    const int32_t host_load = at(h).running + at(h).queued, accel_load = av.running + av.queued;
    const bool host_spare =
        host_tpot <= o_.batch_host_tpot_fraction * tpot_t && (!o_.batch_host_balance || host_load < accel_load);
    const bool batch_off =
        o_.handoff_batch_decode && in.sla == SlaClass::kBatch && tpot_t > 0 && (!accel_room || host_spare);
    const bool scarce = slots_scarce || kv_short || batch_off;
    std::string short_of;
    if (slots_scarce) {
      short_of = fmt::format("decode slots are scarce ({}+{} queued >= {:.2f} x {})", av.running, av.queued,
                             o_.decode_scarce_fraction, av.max_running);
    } else if (kv_short) {
      short_of = fmt::format("KV is short ({} pages needed + {} queued > {} free)", need_pages, queued_pages,
                             av.kv_free_pages);
    } else if (batch_off && !accel_room) {
      short_of = fmt::format(
          "accelerator has no room to spare for a batch decode (2 x {} pages needed + {} queued vs {} free, model "
          "TPOT {:.3f}s vs {:.3f}s)",
          need_pages, queued_pages, av.kv_free_pages, av.model_tpot_s, tpot_t);
    } else if (batch_off) {
      short_of = fmt::format(
          "batch decode fits the host with TPOT to spare ({:.3f}s <= {:.2f} x {:.3f}s; host {} < accelerator {} "
          "sequences)",
          host_tpot, o_.batch_host_tpot_fraction, tpot_t, host_load, accel_load);
    }
    std::string miss;
    if (in.sla != SlaClass::kInteractive && scarce && !host_meets_slo(at(h), false, miss)) {
      return whole(a, "R4",
                   fmt::format("long prompt ({} >= {}) prefills and decodes on {}: its {} but {}", fresh,
                               o_.long_prompt_tokens, av.name, short_of, miss));
    }
    if (in.sla != SlaClass::kInteractive && scarce) {
      d.prefill = a;
      d.decode = h;
      d.rule = "R5";
      d.reason = fmt::format(
          "R5: long prompt ({} >= {}) prefills on {}; its {} so {} decode goes to {} after one KV move (sla {}, "
          "prompt {}, out {}) ->{}",
          fresh, o_.long_prompt_tokens, av.name, short_of, sla_class_name(in.sla), at(h).name, sla_class_name(in.sla),
          p, n, numbers());
      return d;
    }
    std::string why = in.sla == SlaClass::kInteractive ? "interactive decode stays" : "decode slots free";
    if (in.sla == SlaClass::kBatch && o_.handoff_batch_decode && tpot_t > 0) {
      why = host_tpot > o_.batch_host_tpot_fraction * tpot_t
                ? fmt::format("batch decode split: {} has room and host {} TPOT {:.3f}s > {:.2f} x target {:.3f}s",
                              av.name, at(h).name, host_tpot, o_.batch_host_tpot_fraction, tpot_t)
                : fmt::format("batch decode split: {} has room and host {} has {} sequences >= its {}", av.name,
                              at(h).name, host_load, accel_load);
    }
    return whole(a, "R4",
                 fmt::format("long prompt ({} >= {}) prefills and decodes on {} ({})", fresh, o_.long_prompt_tokens,
                             av.name, why));
  }
  // R6: short interactive -> whole on the accelerator.
  if (in.sla == SlaClass::kInteractive) {
    const int b = best_of(ex, is_accel, total);
    return whole(b, "R6", fmt::format("short interactive runs whole on accelerator {}", at(b).name));
  }
  // R7: short standard -> whole on the host executor, unless it is overloaded.
  if (in.sla == SlaClass::kStandard) {
    const int h = best_of(ex, is_host, total);
    const int b = best_of(ex, is_accel, total);
    const double th = total(at(h)), tb = total(at(b));
    if (std::string miss; !host_meets_slo(at(h), true, miss)) {
      return whole(b, "R7", fmt::format("short standard: {}, runs on {}", miss, at(b).name));
    }
    if (th > o_.overload_factor * tb) {
      return whole(
          b, "R7",
          fmt::format("short standard: host {} overloaded (est {:.3f}s > {:.1f} x {:.3f}s on {}), overflow to {}",
                      at(h).name, th, o_.overload_factor, tb, at(b).name, at(b).name));
    }
    return whole(
        h, "R7",
        fmt::format("short standard runs whole on host {} (est {:.3f}s; accelerator {:.3f}s)", at(h).name, th, tb));
  }
  // R8: batch -> least estimated completion time anywhere.
  const int b = best_of(ex, all, total);
  return whole(b, "R8", fmt::format("batch: least estimated completion on {}", at(b).name));
}

}  // namespace tandem
