// Internal helpers of the tokenizer: Unicode category lookup, lax UTF-8 decoding as
// llama.cpp does it, the GPT-2 byte<->unicode mapping and the BPE pre-tokenizers.
// Not part of the public API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::detail {

/// Major general category of a code point (Unicode 15.1, as llama.cpp's tables).
enum UnicodeCat : uint8_t {
  kCatUnassigned = 0,  // Cn, and anything >= 0x110000
  kCatLetter = 1,      // \p{L}
  kCatNumber = 2,      // \p{N}
  kCatSeparator = 3,   // \p{Z}
  kCatMark = 4,        // \p{M}
  kCatPunct = 5,       // \p{P}
  kCatSymbol = 6,      // \p{S}
  kCatOther = 7,       // \p{C} except Cn
};

struct UnicodeRange {
  uint32_t first;
  uint8_t cat;
};

extern const UnicodeRange kUnicodeRanges[];
extern const size_t kUnicodeRangesCount;
extern const uint32_t kUnicodeWhiteSpace[];
extern const size_t kUnicodeWhiteSpaceCount;

UnicodeCat unicode_category(uint32_t cp) noexcept;
bool unicode_is_whitespace(uint32_t cp) noexcept;

/// Decode UTF-8 the way llama.cpp's unicode_cpts_from_utf8 does: a byte that does not
/// start a well-formed sequence (lead byte with the right number of continuation bytes)
/// becomes U+FFFD and decoding resumes at the next byte. No overlong/surrogate checks.
void utf8_decode_lax(std::string_view s, std::vector<uint32_t>& out);
void utf8_append(std::string& out, uint32_t cp);

/// Length of the UTF-8 sequence announced by a lead byte (llama.cpp's unicode_len_utf8:
/// 1 for ASCII and continuation bytes, 2/3/4 from the high nibble).
inline size_t utf8_len_from_lead(uint8_t c) noexcept {
  static constexpr uint8_t kLookup[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kLookup[c >> 4];
}

/// GPT-2 bytes_to_unicode: the UTF-8 text of the code point byte `b` is mapped to.
const std::string& byte_to_bpe_char(uint8_t b) noexcept;
/// Inverse mapping of a code point; -1 if the code point is not a mapped byte.
int bpe_char_to_byte(uint32_t cp) noexcept;

enum class SplitKind { kLlama3, kQwen2, kGpt2, kDefault, kSmollm, kTekken, kDeepseekLlm };

/// Split code points [0, n) into pre-tokens; appends the length (in code points) of each
/// pre-token to `lengths`. Iterative, O(n), no recursion.
void pretokenize(SplitKind kind, const std::vector<uint32_t>& cps, std::vector<size_t>& lengths);

}  // namespace tandem::detail
