// tandem-bench (no subcommand): prompt (pp) and generation (tg) speed, llama-bench's way.
//
// Flags, list syntax, test definitions and output records follow llama.cpp's llama-bench
// (tools/llama-bench), so the two programs' outputs can be read side by side:
//   -p/-n/-d/-t take comma lists of "first[-last[(+|*)step]]" items (and may repeat),
//   -ctk/-ctv comma lists of KV types (and may repeat); -ngl lists of 0 (the CPU executor
//   alone runs here: another layer count is refused, the GPU tools named);
//   one pp test per non-zero prompt size and one tg test per non-zero generation size,
//   for every KV type x thread count x depth; -r runs each after one warm-up run;
//   -o md (table), json (array of records) or jsonl (one record per line).
#pragma once

#include <string>
#include <vector>

namespace tandem::bench {

struct SpeedOptions {
  std::string model;
  std::vector<std::string> prompt{"512"};  ///< -p lists (prompt tokens; 0 = no pp test)
  std::vector<std::string> gen{"128"};     ///< -n lists (generated tokens; 0 = no tg test)
  std::vector<std::string> depth{"0"};     ///< -d lists (tokens in the KV before the timed part)
  std::vector<std::string> threads{"0"};   ///< -t lists (0 = physical cores)
  int reps = 5;                            ///< -r
  std::string output;                      ///< -o: md, json or jsonl ("" = md, or json with --json)
  bool json = false;                       ///< --json: same as -o json
  bool no_bandwidth = false;               ///< skip the read-bandwidth measurement
  /// -ctk lists: KV cache types of K (f16, f32, q8_0), comma-separated, the flag may repeat;
  /// every test runs once per type.
  std::vector<std::string> cache_type_k{"f16"};
  /// -ctv lists: of V; item by item the same types as -ctk (one dtype per store).
  std::vector<std::string> cache_type_v{"f16"};
  /// -ngl lists (llama-bench's GPU layers): every item must be 0, as this mode runs the whole
  /// model on one CPU executor; every test runs once per item (as once per -t item).
  std::vector<std::string> gpu_layers{"0"};
};

/// Parse one llama-bench list: comma-separated items "first[-last[(+|*)step]]" (a range
/// steps by +step or *step, default +1). Values lie in [lo, hi]; a list expands to at most
/// 4096 values. Throws std::invalid_argument with a message naming the fault.
std::vector<int> parse_int_list(const std::string& text, int lo, int hi);

/// Run the tests and print them to stdout. Returns the exit status: 0, 1 on a runtime
/// error (message on stderr), 2 on a refused flag value (message names the flag).
int run_speed(const SpeedOptions& opt);

}  // namespace tandem::bench
