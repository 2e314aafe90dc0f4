// llama.cpp's --cache-type-k / --cache-type-v (-ctk / -ctv) for the Tandem tools: the KV
// element type of a session's or executor's store (include/tandem/kv/kv_store.hpp).
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>

#include "tandem/kv/kv_store.hpp"

namespace tandem::cli {

/// The rewrite of llama.cpp's multi-letter one-dash spellings, which CLI11 cannot declare:
/// "-ctk" -> "--cache-type-k", "-ctv" -> "--cache-type-v" (also "-ctk=T" -> "--cache-type-k=T",
/// which CLI11 would read as "-c tk=T"), anything else unchanged.
inline std::string expand_cache_type_flag(const std::string& arg) {
  if (arg == "-ctk") return "--cache-type-k";
  if (arg == "-ctv") return "--cache-type-v";
  if (arg.starts_with("-ctk=")) return "--cache-type-k=" + arg.substr(5);
  if (arg.starts_with("-ctv=")) return "--cache-type-v=" + arg.substr(5);
  return arg;
}

/// The one KvDtype for K and V named `k` and `v` ("f16", "f32" or "q8_0"). A Tandem KV
/// store holds one dtype for K and V, so different names are refused rather than one of
/// them silently used. Returns "" and sets `out`, or the usage error to print, the values
/// quoted so that stray spaces show (the tools exit with status 2 on it).
inline std::string resolve_cache_types(std::string_view k, std::string_view v, KvDtype& out) {
  KvDtype dk{}, dv{};
  if (!kv_dtype_from_name(k, dk)) return fmt::format("--cache-type-k '{}' is not one of f16, f32, q8_0", k);
  if (!kv_dtype_from_name(v, dv)) return fmt::format("--cache-type-v '{}' is not one of f16, f32, q8_0", v);
  if (dk != dv) {
    return fmt::format(
        "--cache-type-k '{}' and --cache-type-v '{}' differ: Tandem's KV store holds one type for K and V "
        "(give both the same)",
        k, v);
  }
  out = dk;
  return "";
}

}  // namespace tandem::cli
