// Error values used everywhere inside Tandem.
//
// Library code reports failures by throwing tandem::Error (code + message). The C ABI
// (cabi/include/tandem.h) catches it at the boundary and turns it into a status code
// and a thread-local message. Messages name the offending key/tensor/argument and, for
// file formats, the byte offset.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace tandem {

/// Every failure kind the library reports. The numeric values are stable: the C ABI
/// exposes them as TANDEM_E_* with the same numbers.
enum class ErrorCode : int32_t {
  kOk = 0,
  kInvalidArgument = 1,        ///< a caller-supplied argument is out of range or null
  kIo = 2,                     ///< open/read/mmap/write failed (errno text in the message)
  kOutOfMemory = 3,            ///< an allocation or a capacity limit was exceeded
  kGgufBadMagic = 10,          ///< file does not start with "GGUF"
  kGgufBadVersion = 11,        ///< version other than 2 or 3
  kGgufTruncated = 12,         ///< a field or tensor runs past the end of the file
  kGgufBadLength = 13,         ///< a string/array length or count cannot fit in the file
  kGgufBadAlignment = 14,      ///< general.alignment invalid, or a tensor offset misaligned
  kGgufDuplicateKey = 15,      ///< the same metadata key appears twice
  kGgufDuplicateTensor = 16,   ///< the same tensor name appears twice
  kGgufBadType = 17,           ///< unknown value/tensor type, or a key holds the wrong type
  kGgufBadTensor = 18,         ///< bad dims (zero, too many, overflow, row not a block multiple)
  kTensorNonFinite = 19,       ///< a quantisation block scale is Inf or NaN
  kModelUnsupportedArch = 30,  ///< general.architecture is not llama/qwen2/qwen3
  kModelMissingTensor = 31,    ///< a required tensor is absent
  kModelBadHparams = 32,       ///< a hyper-parameter is missing or inconsistent
  kModelBadTensorShape = 33,   ///< a tensor's shape/type does not fit the hyper-parameters
  kTokenizer = 40,             ///< tokenizer metadata missing or inconsistent
  kContextOverflow = 50,       ///< more tokens than the context holds
  kBadPosition = 51,           ///< a position that is negative, >= n_ctx or not contiguous
  kKvMismatch = 60,            ///< a KV hand-off for another model/tokenizer/RoPE/layout
  kKvChecksum = 61,            ///< a KV page's bytes do not match its checksum
  kKvLeaseExpired = 62,        ///< a KV hand-off's lease expired before it was imported
  kKvTokenRange = 63,          ///< a KV hand-off's tokens/positions do not fit the receiver
  kSessionCorrupt = 70,        ///< a session file is truncated, damaged or malformed
  kSessionModelMismatch = 71,  ///< a session file was saved with another model or tokenizer
  kSessionVersion = 72,        ///< a session file has a format version this build cannot read
  kInternal = 99,              ///< a broken invariant inside Tandem (a bug)
};

/// Short stable name of a code, e.g. "GGUF_TRUNCATED": the one name table for C++ and
/// the C ABI (tandem_status_name gives the same name for every code it shares, e.g.
/// "INVALID_ARG" as in TANDEM_E_INVALID_ARG).
std::string_view error_code_name(ErrorCode code) noexcept;

/// The text of an errno value ("No space left on device"), as strerror gives it but
/// thread-safe (strerror_r); unknown values give "Unknown error N".
std::string errno_message(int err);

/// The exception type thrown by all Tandem library code.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace tandem
