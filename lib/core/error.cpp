// Stable names of tandem::ErrorCode values and errno texts (see include/tandem/core/error.hpp).
#include "tandem/core/error.hpp"

#include <cstring>

namespace tandem {

std::string_view error_code_name(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kOk:
      return "OK";
    case ErrorCode::kInvalidArgument:
      return "INVALID_ARG";
    case ErrorCode::kIo:
      return "IO";
    case ErrorCode::kOutOfMemory:
      return "OUT_OF_MEMORY";
    case ErrorCode::kGgufBadMagic:
      return "GGUF_BAD_MAGIC";
    case ErrorCode::kGgufBadVersion:
      return "GGUF_BAD_VERSION";
    case ErrorCode::kGgufTruncated:
      return "GGUF_TRUNCATED";
    case ErrorCode::kGgufBadLength:
      return "GGUF_BAD_LENGTH";
    case ErrorCode::kGgufBadAlignment:
      return "GGUF_BAD_ALIGNMENT";
    case ErrorCode::kGgufDuplicateKey:
      return "GGUF_DUPLICATE_KEY";
    case ErrorCode::kGgufDuplicateTensor:
      return "GGUF_DUPLICATE_TENSOR";
    case ErrorCode::kGgufBadType:
      return "GGUF_BAD_TYPE";
    case ErrorCode::kGgufBadTensor:
      return "GGUF_BAD_TENSOR";
    case ErrorCode::kTensorNonFinite:
      return "TENSOR_NON_FINITE";
    case ErrorCode::kModelUnsupportedArch:
      return "MODEL_UNSUPPORTED_ARCH";
    case ErrorCode::kModelMissingTensor:
      return "MODEL_MISSING_TENSOR";
    case ErrorCode::kModelBadHparams:
      return "MODEL_BAD_HPARAMS";
    case ErrorCode::kModelBadTensorShape:
      return "MODEL_BAD_TENSOR_SHAPE";
    case ErrorCode::kTokenizer:
      return "TOKENIZER";
    case ErrorCode::kContextOverflow:
      return "CONTEXT_OVERFLOW";
    case ErrorCode::kBadPosition:
      return "BAD_POSITION";
    case ErrorCode::kKvMismatch:
      return "KV_MISMATCH";
    case ErrorCode::kKvChecksum:
      return "KV_CHECKSUM";
    case ErrorCode::kKvLeaseExpired:
      return "KV_LEASE_EXPIRED";
    case ErrorCode::kKvTokenRange:
      return "KV_TOKEN_RANGE";
    case ErrorCode::kSessionCorrupt:
      return "SESSION_CORRUPT";
    case ErrorCode::kSessionModelMismatch:
      return "SESSION_MODEL_MISMATCH";
    case ErrorCode::kSessionVersion:
      return "SESSION_VERSION";
    case ErrorCode::kInternal:
      return "INTERNAL";
  }
  return "UNKNOWN";
}

std::string errno_message(int err) {
  char buf[256];
  // The GNU strerror_r: returns the message, in buf or a static string.
  return std::string(::strerror_r(err, buf, sizeof buf));
}

}  // namespace tandem
