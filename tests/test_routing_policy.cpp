// DefaultRoutingPolicy against the table in docs/routing-policy.md: one case per row
// (and the boundary of each threshold), given executor speeds, queues and KV state.
#include <catch2/catch.hpp>

#include <vector>

#include "routing_test_support.hpp"
#include "tandem/sched/routing_policy.hpp"

using namespace tandem;

using tandem::test::gpu_cpu;
using tandem::test::input;

TEST_CASE("routing policy table", "[routing]") {
  DefaultRoutingPolicy pol;
  auto ex = gpu_cpu();

  SECTION("R1: a single executor takes everything") {
    std::vector<ExecutorView> one{ex[1]};
    const auto d = pol.route(input(SlaClass::kInteractive, 5000, 10), one);
    CHECK(d.rule == "R1");
    CHECK(d.prefill == 1);
    CHECK(d.decode == 1);
  }
  SECTION("R2: a session stays where its KV is") {
    auto in = input(SlaClass::kStandard, 20, 10);
    in.session_executor = 1;
    const auto d = pol.route(in, ex);
    CHECK(d.rule == "R2");
    CHECK(d.prefill == 1);
    CHECK(d.decode == 1);
  }
  SECTION("R2: SLA upgrade migrates a CPU session to the accelerator") {
    auto in = input(SlaClass::kInteractive, 20, 10);
    in.session_executor = 1;
    const auto d = pol.route(in, ex);
    CHECK(d.rule == "R2");
    CHECK(d.prefill == 0);
    CHECK(d.decode == 0);
    CHECK_THAT(d.reason, Catch::Contains("SLA upgrade"));
  }
  SECTION("R2: an interactive session already on the accelerator stays") {
    auto in = input(SlaClass::kInteractive, 20, 10);
    in.session_executor = 0;
    const auto d = pol.route(in, ex);
    CHECK(d.prefill == 0);
    CHECK_THAT(d.reason, Catch::Contains("affinity"));
  }
  SECTION("R3: the prefix holder wins when not much slower") {
    ex[1].prefill_tps = 4000;
    CHECK(pol.route(input(SlaClass::kStandard, 600, 2), ex).rule == "R4");  // without the prefix: the GPU
    ex[1].prefix_tokens = 512;                                              // CPU holds 512 of 600 tokens
    const auto d = pol.route(input(SlaClass::kStandard, 600, 2), ex);
    CHECK(d.rule == "R3");
    CHECK(d.prefill == 1);
    CHECK(d.decode == 1);
  }
  SECTION("R3: ... but not when it is much slower") {
    ex[1].prefill_tps = 4000;
    ex[1].prefix_tokens = 512;
    ex[1].queued_tokens = 20000;  // a long queue
    const auto d = pol.route(input(SlaClass::kStandard, 600, 2), ex);
    CHECK(d.rule != "R3");
    CHECK(d.prefill == 0);
  }
  SECTION("R3: ... nor when it holds less than half the prompt") {
    ex[1].prefill_tps = 4000;
    ex[1].prefix_tokens = 256;
    const auto d = pol.route(input(SlaClass::kStandard, 600, 2), ex);
    CHECK(d.rule == "R4");
  }
  SECTION("R4: a long prompt prefills and decodes on the accelerator when slots are free") {
    const auto d = pol.route(input(SlaClass::kStandard, 2000, 100), ex);
    CHECK(d.rule == "R4");
    CHECK(d.prefill == 0);
    CHECK(d.decode == 0);
  }
  SECTION("R4: long interactive decode stays on the accelerator even when slots are scarce") {
    ex[0].running = 8;
    const auto d = pol.route(input(SlaClass::kInteractive, 2000, 100), ex);
    CHECK(d.rule == "R4");
    CHECK(d.decode == 0);
  }
  SECTION("R5: long standard prompt hands decode to the CPU when accelerator slots are scarce") {
    ex[0].running = 6;  // 6 >= 0.75 * 8
    const auto d = pol.route(input(SlaClass::kStandard, 2000, 100), ex);
    CHECK(d.rule == "R5");
    CHECK(d.prefill == 0);
    CHECK(d.decode == 1);
    CHECK_THAT(d.reason, Catch::Contains("scarce"));
  }
  SECTION("R5 boundary: 5 of 8 running is not scarce") {
    ex[0].running = 5;
    CHECK(pol.route(input(SlaClass::kBatch, 2000, 100), ex).rule == "R4");
  }
  SECTION("long threshold: 255 fresh tokens is short") {
    CHECK(pol.route(input(SlaClass::kStandard, 255, 10), ex).rule == "R7");
    CHECK(pol.route(input(SlaClass::kStandard, 256, 10), ex).rule == "R4");
  }
  SECTION("R6: short interactive runs whole on the accelerator") {
    const auto d = pol.route(input(SlaClass::kInteractive, 30, 50), ex);
    CHECK(d.rule == "R6");
    CHECK(d.prefill == 0);
    CHECK(d.decode == 0);
  }
  SECTION("R7: short standard runs whole on the CPU") {
    const auto d = pol.route(input(SlaClass::kStandard, 30, 50), ex);
    CHECK(d.rule == "R7");
    CHECK(d.prefill == 1);
    CHECK(d.decode == 1);
  }
  SECTION("R7: short standard overflows to the accelerator when the CPU is overloaded") {
    ex[1].queued = 40;
    ex[1].running = 4;
    ex[1].queued_tokens = 4000;
    const auto d = pol.route(input(SlaClass::kStandard, 30, 50), ex);
    CHECK(d.rule == "R7");
    CHECK(d.prefill == 0);
    CHECK_THAT(d.reason, Catch::Contains("overloaded"));
  }
  SECTION("R8: short batch goes to the least estimated completion") {
    CHECK(pol.route(input(SlaClass::kBatch, 30, 50), ex).prefill == 0);  // the GPU is idle and faster
    ex[0].running = 8;
    ex[0].queued = 200;
    ex[0].queued_tokens = 1000000;
    const auto d = pol.route(input(SlaClass::kBatch, 30, 50), ex);
    CHECK(d.rule == "R8");
    CHECK(d.prefill == 1);
  }
  SECTION("R8: homogeneous executors (cpu+cpu without a marked accelerator) balance by estimate") {
    ex[0].accelerator = false;
    ex[0].prefill_tps = ex[1].prefill_tps;
    ex[0].decode_tps = ex[1].decode_tps;
    ex[0].running = 3;
    const auto d = pol.route(input(SlaClass::kInteractive, 3000, 50), ex);
    CHECK(d.rule == "R8");
    CHECK(d.prefill == 1);
  }
  SECTION("R7 with SLO targets: the CPU takes a short standard request only when its estimates meet them") {
    DefaultRoutingOptions o;
    o.ttft_target_s[int(SlaClass::kStandard)] = 0.5;
    o.tpot_target_s[int(SlaClass::kStandard)] = 0.05;
    DefaultRoutingPolicy slo(o);
    ex[0].running = 8;  // a busy GPU, so the overload rule alone keeps the request on the CPU
    // Idle CPU: TTFT 30 / 400 = 0.075 s, TPOT 1 / 40 = 0.025 s: both met.
    CHECK(slo.route(input(SlaClass::kStandard, 30, 50), ex).prefill == 1);
    // 2 of 4 slots busy: TPOT 0.025 x (1 + 2 / 4) = 0.0375 s, still met.
    ex[1].running = 2;
    CHECK(slo.route(input(SlaClass::kStandard, 30, 50), ex).prefill == 1);
    // 4 of 4 busy and 1 queued: TPOT 0.025 x (1 + 5 / 4) = 0.056 s > 0.05 s: the GPU.
    ex[1].running = 4;
    ex[1].queued = 1;
    const auto d = slo.route(input(SlaClass::kStandard, 30, 50), ex);
    CHECK(d.rule == "R7");
    CHECK(d.prefill == 0);
    CHECK_THAT(d.reason, Catch::Contains("would miss the standard SLO"));
    // The same state without targets stays on the CPU: est 2.89 s <= 3 x the GPU's 1.25 s.
    CHECK(pol.route(input(SlaClass::kStandard, 30, 50), ex).prefill == 1);
  }
  SECTION("R7 with SLO targets: a prompt the CPU cannot prefill within the TTFT target stays on the GPU") {
    DefaultRoutingOptions o;
    o.ttft_target_s[int(SlaClass::kStandard)] = 0.5;
    DefaultRoutingPolicy slo(o);
    ex[0].running = 8;                                                       // as above
    CHECK(slo.route(input(SlaClass::kStandard, 200, 10), ex).prefill == 1);  // 200 / 400 = 0.5 s: met
    ex[1].queued_tokens = 1;                                                 // 201 / 400 > 0.5 s
    CHECK(slo.route(input(SlaClass::kStandard, 200, 10), ex).prefill == 0);
    CHECK(pol.route(input(SlaClass::kStandard, 200, 10), ex).prefill == 1);  // without the target
  }
  SECTION("R5 with SLO targets: no hand-off to a CPU that would miss the TPOT target") {
    DefaultRoutingOptions o;
    o.tpot_target_s[int(SlaClass::kBatch)] = 0.03;
    DefaultRoutingPolicy slo(o);
    ex[0].running = 6;                                                      // scarce
    CHECK(slo.route(input(SlaClass::kBatch, 2000, 100), ex).rule == "R5");  // CPU TPOT 0.025 s
    ex[1].running = 2;                                                      // 0.0375 s > 0.03 s
    const auto d = slo.route(input(SlaClass::kBatch, 2000, 100), ex);
    CHECK(d.rule == "R4");
    CHECK(d.decode == 0);
    CHECK_THAT(d.reason, Catch::Contains("would miss the batch SLO"));
  }
  SECTION("R5 batch decode split: the host takes a batch decode only with TPOT to spare while the GPU has room") {
    // Fails on the main before this change: every long batch decode went to a host that met
    // the target (R5), however close to the target and however idle the GPU.
    DefaultRoutingOptions o;
    o.tpot_target_s[int(SlaClass::kBatch)] = 0.1;
    DefaultRoutingPolicy slo(o);
    const auto batch = input(SlaClass::kBatch, 2000, 100);  // 132 pages of 16 tokens
    ex[0].running = 4;  // the GPU decodes more sequences than the CPU (the balance below)
    // Idle CPU: TPOT 1 / 40 = 0.025 s <= 0.5 x 0.1 s: to the CPU.
    auto d = slo.route(batch, ex);
    CHECK(d.rule == "R5");
    CHECK(d.decode == 1);
    CHECK_THAT(d.reason, Catch::Contains("TPOT to spare"));
    // The CPU's model predicts 0.07 s at its batch: it meets the 0.1 s target, but the GPU
    // has room (1000 free >= 2 x 132) and no model TPOT above the target: the GPU keeps it.
    ex[1].model_tpot_s = 0.07;
    d = slo.route(batch, ex);
    CHECK(d.rule == "R4");
    CHECK(d.decode == 0);
    CHECK_THAT(d.reason, Catch::Contains("batch decode split") && Catch::Contains("0.070s"));
    // At 0.05 s (exactly half the target) the CPU takes it again.
    ex[1].model_tpot_s = 0.05;
    CHECK(slo.route(batch, ex).decode == 1);
    ex[1].model_tpot_s = 0.07;
    // The GPU's KV holds this request but not a second one (2 x 132 > 200): to the CPU.
    ex[0].kv_free_pages = 200;
    d = slo.route(batch, ex);
    CHECK(d.rule == "R5");
    CHECK(d.decode == 1);
    CHECK_THAT(d.reason, Catch::Contains("no room to spare"));
    // Queued prompts count against the GPU's room: 264 free, but 1 more queued page.
    ex[0].kv_free_pages = 264;
    CHECK(slo.route(batch, ex).decode == 0);
    ex[0].queued_tokens = 1;
    CHECK(slo.route(batch, ex).decode == 1);
    ex[0].queued_tokens = 0;
    // The GPU's own model predicts a TPOT above the target at its batch: to the CPU.
    ex[0].model_tpot_s = 0.11;
    CHECK(slo.route(batch, ex).decode == 1);
    ex[0].model_tpot_s = 0.1;
    CHECK(slo.route(batch, ex).decode == 0);
    // No free CPU slot: the GPU keeps it even without room to spare (the SLO guard).
    ex[0].kv_free_pages = 200;
    ex[1].running = 4;
    d = slo.route(batch, ex);
    CHECK(d.rule == "R4");
    CHECK(d.decode == 0);
    CHECK_THAT(d.reason, Catch::Contains("no free decode slot"));
    // Fraction 1.0 is the rule before the split (here the GPU runs more sequences, so the balance holds).
    ex[1].running = 0;
    ex[0].kv_free_pages = 1000;
    o.batch_host_tpot_fraction = 1.0;
    CHECK(DefaultRoutingPolicy(o).route(batch, ex).decode == 1);
    // Standard requests are not split: with free GPU slots and KV they stay whole on the GPU.
    CHECK(slo.route(input(SlaClass::kStandard, 2000, 100), ex).rule == "R4");
  }
  SECTION("every decision explains itself with the numbers used") {
    const auto d = pol.route(input(SlaClass::kStandard, 30, 50), ex);
    CHECK_THAT(d.reason, Catch::Contains("gpu[pf 20000 t/s") && Catch::Contains("cpu[pf 400 t/s") &&
                             Catch::Contains("est prefill"));
  }
}

TEST_CASE("a replacement policy object is honoured", "[routing]") {
  struct AlwaysLast final : RoutingPolicy {
    RouteDecision route(const RouteInput&, std::span<const ExecutorView> ex) override {
      return {int(ex.size()) - 1, int(ex.size()) - 1, "X", "always the last"};
    }
  } p;
  auto ex = gpu_cpu();
  CHECK(p.route(input(SlaClass::kInteractive, 10, 10), ex).prefill == 1);
  CHECK(parse_sla_class("batch") == SlaClass::kBatch);
  CHECK(!parse_sla_class("gold"));
  CHECK(sla_class_name(SlaClass::kInteractive) == "interactive");
}

// Fails on main (issue 16): R7's TTFT estimate on the host was (queued prompt tokens +
// prompt) / prefill_tps, blind to the prompts the host had already admitted and to the
// decodes that share each of its steps; the host took prompts it could not prefill in time.
TEST_CASE("R7's host TTFT estimate counts admitted prompts and the decode share", "[routing]") {
  DefaultRoutingOptions o;
  o.ttft_target_s[int(SlaClass::kStandard)] = 0.5;
  DefaultRoutingPolicy slo(o);
  auto ex = gpu_cpu();
  // A busy GPU (est 150 / 20000 + 10 / 80 x (1 + 24 / 8) = 0.51 s), so that the overload
  // rule (3 x 0.51 s) never keeps the request off the CPU here, and a CPU with free slots.
  ex[0].running = 8;
  ex[0].queued = 16;
  ex[1].max_running = 16;
  const auto req = input(SlaClass::kStandard, 150, 10);
  // Idle CPU: 150 / 400 = 0.375 s <= 0.5 s: the CPU.
  CHECK(DefaultRoutingPolicy::est_prefill_s(ex[1], 150) == Approx(0.375));
  CHECK(slo.route(req, ex).prefill == 1);

  SECTION("admitted prompts go first") {
    // 60 prompt tokens of an admitted sequence still to prefill: (60 + 150) / 400 = 0.525 s.
    ex[1].running = 1;
    ex[1].running_prompt_tokens = 60;
    CHECK(DefaultRoutingPolicy::est_prefill_s(ex[1], 150) == Approx(0.525));
    const auto d = slo.route(req, ex);
    CHECK(d.rule == "R7");
    CHECK(d.prefill == 0);
    CHECK_THAT(d.reason, Catch::Contains("est TTFT 0.525s"));
    ex[1].running_prompt_tokens = 40;  // (40 + 150) / 400 = 0.475 s: met
    CHECK(slo.route(req, ex).prefill == 1);
  }
  SECTION("decodes share every step of the prompt") {
    // Measured: 400 tokens/s in steps carrying prompt tokens. With 3 sequences decoding
    // and chunks of 16 prompt tokens, a step carries 16 prompt + 3 decode tokens: prompt
    // speed 400 x 16 / 19 = 336.8 t/s, 150 tokens take 0.445 s: met.
    ex[1].running = ex[1].decoding = 3;
    ex[1].token_tps = 400;
    ex[1].prefill_chunk = 16;
    CHECK(DefaultRoutingPolicy::est_prefill_s(ex[1], 150) == Approx(150.0 / (400.0 * 16 / 19)));
    CHECK(slo.route(req, ex).prefill == 1);
    // 4 decoding (a hand-off on its way included): 400 x 16 / 20 = 320 t/s, 0.469 s: met.
    ex[1].running = ex[1].decoding = 4;
    CHECK(slo.route(req, ex).prefill == 1);
    // 6 decoding: 400 x 16 / 22 = 290.9 t/s, 150 tokens take 0.516 s > 0.5 s: the GPU.
    ex[1].running = ex[1].decoding = 6;
    CHECK(DefaultRoutingPolicy::est_prefill_s(ex[1], 150) == Approx(0.515625));
    const auto d = slo.route(req, ex);
    CHECK(d.rule == "R7");
    CHECK(d.prefill == 0);
    CHECK_THAT(d.reason, Catch::Contains("est TTFT 0.516s"));
    // The measured prefill speed still bounds the estimate: a token rate above it at this
    // decode share (1000 x 16 / 22 = 727 t/s) leaves 400 t/s, 0.375 s.
    ex[1].token_tps = 1000;
    CHECK(DefaultRoutingPolicy::est_prefill_s(ex[1], 150) == Approx(0.375));
    // Without a measured token rate or a known chunk, the decode share is not applied.
    ex[1].token_tps = 0;
    CHECK(DefaultRoutingPolicy::est_prefill_s(ex[1], 150) == Approx(0.375));
  }
}

// Fails on main (issue 16): with room on the GPU, the split gave a batch decode to any host
// with TPOT to spare, however idle the GPU; on the long-context trace 11 of 17 batch
// decodes went to the EPYC while the L40S ran 0-2 sequences, and the EPYC's slots were
// full when the L40S's KV was short.
TEST_CASE("batch decode split: a host with room on the GPU takes a batch decode only while it runs fewer sequences",
          "[routing]") {
  DefaultRoutingOptions o;
  o.tpot_target_s[int(SlaClass::kBatch)] = 0.1;
  DefaultRoutingPolicy slo(o);
  auto ex = gpu_cpu();
  ex[1].max_running = 16;
  const auto batch = input(SlaClass::kBatch, 2000, 100);  // 132 pages; the GPU has 1000 free: room
  // Both idle: the CPU's TPOT 1 / 40 = 0.025 s <= 0.05 s, but it would run 1 sequence to
  // the GPU's 0: the GPU keeps it.
  auto d = slo.route(batch, ex);
  CHECK(d.rule == "R4");
  CHECK(d.decode == 0);
  CHECK_THAT(d.reason, Catch::Contains("host cpu has 0 sequences >= its 0"));
  // GPU 2 running, CPU 1 running + 1 hand-off on its way (queued): 2 >= 2, the GPU.
  ex[0].running = 2;
  ex[1].running = 1;
  ex[1].queued = 1;  // TPOT 0.025 x (1 + 2 / 16) = 0.028 s: still to spare
  CHECK(slo.route(batch, ex).decode == 0);
  // GPU 3: the CPU (2) runs fewer: to the CPU.
  ex[0].running = 3;
  d = slo.route(batch, ex);
  CHECK(d.rule == "R5");
  CHECK(d.decode == 1);
  CHECK_THAT(d.reason, Catch::Contains("host 2 < accelerator 3 sequences"));
  // Without room on the GPU the balance does not apply: a CPU busier than the GPU takes it.
  ex[0].running = 0;
  ex[0].kv_free_pages = 200;  // < 2 x 132
  d = slo.route(batch, ex);
  CHECK(d.rule == "R5");
  CHECK(d.decode == 1);
  CHECK_THAT(d.reason, Catch::Contains("no room to spare"));
  // batch_host_balance = false: the TPOT fraction alone (the rule before this change).
  ex[0].kv_free_pages = 1000;
  CHECK(slo.route(batch, ex).decode == 0);
  o.batch_host_balance = false;
  CHECK(DefaultRoutingPolicy(o).route(batch, ex).decode == 1);
}
