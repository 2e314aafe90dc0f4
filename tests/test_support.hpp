// Helpers shared by every test: where the shared data lives, golden-file reading, scratch
// directories, and the ErrorCode a call throws.
#pragma once

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>
#include <nlohmann/json.hpp>

#include "tandem/core/error.hpp"

namespace tandem::test {

/// Same length and the same bytes (bit-identical floats, NaN payloads and -0.0 included).
inline bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// ../shared (models/, golden/), overridable by TANDEM_SHARED.
inline std::filesystem::path shared_dir() {
  if (const char* env = std::getenv("TANDEM_SHARED"); env && *env) return env;
  return std::filesystem::path(TANDEM_SOURCE_DIR) / ".." / "shared";
}
/// The shared data is absent: the test cannot run. The message makes ctest count it as
/// skipped (SKIP_REGULAR_EXPRESSION in tests/CMakeLists.txt), never as passed.
struct SharedDataMissing : std::runtime_error {
  explicit SharedDataMissing(const std::filesystem::path& dir)
      : std::runtime_error("SKIPPED: " + dir.string() + " is absent (TANDEM_SHARED / TANDEM_MODELS)") {}
};
/// Model directory, overridable by TANDEM_MODELS. Throws SharedDataMissing when it does not
/// exist (a missing file inside it is left to the test: some tests want that error).
inline std::filesystem::path models_dir() {
  const char* env = std::getenv("TANDEM_MODELS");
  std::filesystem::path dir = env && *env ? std::filesystem::path(env) : shared_dir() / "models";
  if (!std::filesystem::is_directory(dir)) throw SharedDataMissing(dir);
  return dir;
}
/// The golden data; throws SharedDataMissing when the directory does not exist.
inline std::filesystem::path golden_dir() {
  std::filesystem::path dir = shared_dir() / "golden";
  if (!std::filesystem::is_directory(dir)) throw SharedDataMissing(dir);
  return dir;
}
inline std::filesystem::path model_path(const std::string& name) {
  return models_dir() / (name + ".gguf");
}

/// Tandem's download cache (scripts/fetch-smollm2 writes here): $TANDEM_CACHE, else
/// $XDG_CACHE_HOME/tandem, else ~/.cache/tandem.
inline std::filesystem::path cache_dir() {
  if (const char* env = std::getenv("TANDEM_CACHE"); env && *env) return env;
  if (const char* env = std::getenv("XDG_CACHE_HOME"); env && *env) return std::filesystem::path(env) / "tandem";
  const char* home = std::getenv("HOME");
  return std::filesystem::path(home && *home ? home : "/tmp") / ".cache" / "tandem";
}
/// SmolLM2-135M-Instruct as the PyPI wheel ships it (Q4_1); TANDEM_SMOLLM2 overrides.
/// Tests that need it SKIP with a message naming this path when it does not exist.
inline std::filesystem::path smollm2_q4_1_path() {
  if (const char* env = std::getenv("TANDEM_SMOLLM2"); env && *env) return env;
  return cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf";
}
/// Gemma 3 270M as the PyPI chunk packages assemble it (Q4_K_M, run in its own types; all converted to Q4_0 when
/// asked; scripts/fetch-gemma3); TANDEM_GEMMA3 overrides. Tests that need it SKIP when absent.
inline std::filesystem::path gemma3_q4_k_m_path() {
  if (const char* env = std::getenv("TANDEM_GEMMA3"); env && *env) return env;
  return cache_dir() / "gemma-3-270m-q4_k_m.gguf";
}

inline nlohmann::json read_json(const std::filesystem::path& p) {
  std::ifstream f(p);
  if (!f) throw std::runtime_error("cannot open " + p.string());
  return nlohmann::json::parse(f);
}

/// Raw little-endian float32 file.
inline std::vector<float> read_f32(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary | std::ios::ate);
  if (!f) throw std::runtime_error("cannot open " + p.string());
  const auto n = static_cast<size_t>(f.tellg());
  std::vector<float> v(n / sizeof(float));
  f.seekg(0);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
  return v;
}

/// This run's scratch root, <tmp>/tandem-test-<pid>-<random>: unique per test process
/// (two runs on one machine never delete each other's files), removed at exit.
inline const std::filesystem::path& scratch_root() {
  struct Root {
    std::filesystem::path path;
    Root() {
      std::random_device rd;
      path = std::filesystem::temp_directory_path() /
             ("tandem-test-" + std::to_string(::getpid()) + "-" + std::to_string(rd()));
      std::filesystem::create_directories(path);
    }
    ~Root() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Root root;
  return root.path;
}

/// A scratch directory of this run, made fresh for each call site name.
inline std::filesystem::path scratch_dir(const std::string& name) {
  auto p = scratch_root() / name;
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p;
}

/// The ErrorCode that `fn()` throws as a tandem::Error; kOk when it returns normally.
/// Any other exception propagates (a test failure, not a code).
template <class Fn>
ErrorCode code_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.code();
  }
  return ErrorCode::kOk;
}

/// As code_of, with the error's message (empty for kOk).
template <class Fn>
std::pair<ErrorCode, std::string> error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return {e.code(), e.what()};
  }
  return {ErrorCode::kOk, ""};
}

}  // namespace tandem::test
