// llama.cpp's -ngl / --n-gpu-layers / --gpu-layers (layers offloaded to the GPU). Tandem has
// no layer offload: an executor runs every layer (include/tandem/exec/gpu/gpu_q4_executor.hpp,
// cpu_q4_executor.hpp). tandem-bench's speed mode runs on the CPU only: 0 is accepted, any
// other count is a usage error naming the tools that run the GPU executor. tandem-cli in a
// CUDA build puts the whole model on the GPU for llama.cpp's whole-model values
// (whole_model_gpu_layers).
#pragma once

#include <fmt/format.h>

#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>

namespace tandem::cli {

/// The rewrite of llama.cpp's one-dash "-ngl" (and "-ngl=N"), which CLI11 cannot declare,
/// to "--n-gpu-layers"; anything else unchanged. Applied beside expand_cache_type_flag.
inline std::string expand_gpu_layers_flag(const std::string& arg) {
  if (arg == "-ngl") return "--n-gpu-layers";
  if (arg.starts_with("-ngl=")) return "--n-gpu-layers=" + arg.substr(5);  // llama.cpp's -ngl=N
  return arg;
}

/// The usage error for llama.cpp's layer count `value` (as typed) given to `tool`, which runs
/// on the CPU only; the tools exit with status 2 on it. Any count but 0 (llama.cpp's "auto"
/// and "all" included) is refused the same way.
inline std::string cpu_only_gpu_layers_error(std::string_view tool, std::string_view value) {
  return fmt::format(
      "--n-gpu-layers {}: {} runs the whole model on the CPU (no layer offload), so only 0 is accepted; "
      "the GPU executor runs in tandem-server --executors gpu|cpu+gpu, tandem-bench serve --executors gpu|cpu+gpu "
      "and tandem-gpu-bench",
      value, tool);
}

/// One llama.cpp layer count as typed: a whole integer of any size or sign (`beyond_int64`
/// when it does not fit int64_t; llama.cpp reads it as "every layer" then), llama.cpp's
/// "auto" / "all", or not a count (`valid` false). The one parse behind the checks below.
struct LayerCount {
  bool valid = false;
  bool all = false;  ///< "auto" or "all"
  bool beyond_int64 = false;
  int64_t n = 0;
};
inline LayerCount parse_layer_count(std::string_view value) {
  if (value == "auto" || value == "all") return {true, true, false, 0};
  int64_t n = 0;
  const char* end = value.data() + value.size();
  const auto [ptr, ec] = std::from_chars(value.data(), end, n);
  if (value.empty() || ptr != end) return {};
  if (ec == std::errc::result_out_of_range) return {true, false, true, 0};
  return {ec == std::errc(), false, false, n};
}

/// Whether `value` is one of llama.cpp's layer counts other than 0: a whole integer of any
/// size or sign that is not 0, or "auto" / "all".
inline bool is_nonzero_layer_count(std::string_view value) {
  const LayerCount c = parse_layer_count(value);
  return c.valid && (c.all || c.beyond_int64 || c.n != 0);
}

/// "" when `value` is a layer count as llama.cpp takes one (an integer of any size or sign,
/// "auto", "all"); otherwise the usage error naming it.
inline std::string check_layer_count(std::string_view value) {
  if (parse_layer_count(value).valid) return "";
  return fmt::format("--n-gpu-layers '{}' is not a layer count (an integer; llama.cpp also takes auto or all)", value);
}

/// tandem-cli's reading of llama.cpp's -ngl `value` for a model of `n_layer` layers. Tandem
/// has no layer offload (an executor runs every layer), so: a whole 0 runs the CPU executor
/// (gpu false); llama.cpp's whole-model values ("all", "auto", a negative count, or a count
/// >= n_layer such as -ngl 99) run the GPU executor (gpu true); a count in 1 .. n_layer - 1
/// (partial offload) or a value that is not a count is a usage error, in `error`.
struct GpuLayers {
  bool gpu = false;
  std::string error;
};
inline GpuLayers whole_model_gpu_layers(std::string_view value, int32_t n_layer) {
  const LayerCount c = parse_layer_count(value);
  if (!c.valid) return {false, check_layer_count(value)};
  if (c.all || c.beyond_int64 || c.n < 0 || c.n >= n_layer) return {true, ""};
  if (c.n == 0) return {false, ""};
  return {false, fmt::format("--n-gpu-layers {}: Tandem runs every layer on one executor (no partial offload): 0 "
                             "runs the CPU executor, all, -1 or a count >= the model's {} layers the GPU executor",
                             value, n_layer)};
}

}  // namespace tandem::cli
