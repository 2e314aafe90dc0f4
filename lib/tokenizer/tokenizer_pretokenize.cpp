// Pre-tokenizers for byte-level BPE vocabularies, written as iterative scanners (no
// std::regex: its matcher recurses once per character and overflows the stack on long
// runs, field case B10). Each scanner reproduces the regex named above it with the
// semantics of llama.cpp (leftmost alternative wins, greedy quantifiers with the
// backtracking the regex would do), on Unicode 15.1 categories.
#include <algorithm>
#include <array>
#include <span>

#include "tokenizer/tokenizer_internal.hpp"

namespace tandem::detail {

UnicodeCat unicode_category(uint32_t cp) noexcept {
  if (cp >= 0x110000) return kCatUnassigned;
  if (cp < 0x80) {
    // fast path for ASCII; same values as the table
    static const std::array<uint8_t, 128> ascii = [] {
      std::array<uint8_t, 128> a{};
      for (uint32_t c = 0; c < 128; ++c) {
        const UnicodeRange* it = std::upper_bound(kUnicodeRanges, kUnicodeRanges + kUnicodeRangesCount, c,
                                                  [](uint32_t v, const UnicodeRange& r) { return v < r.first; });
        a[c] = (it - 1)->cat;
      }
      return a;
    }();
    return static_cast<UnicodeCat>(ascii[cp]);
  }
  const UnicodeRange* it = std::upper_bound(kUnicodeRanges, kUnicodeRanges + kUnicodeRangesCount, cp,
                                            [](uint32_t v, const UnicodeRange& r) { return v < r.first; });
  return static_cast<UnicodeCat>((it - 1)->cat);
}

bool unicode_is_whitespace(uint32_t cp) noexcept {
  if (cp < 0x80) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  return std::binary_search(kUnicodeWhiteSpace, kUnicodeWhiteSpace + kUnicodeWhiteSpaceCount, cp);
}

void utf8_decode_lax(std::string_view s, std::vector<uint32_t>& out) {
  out.clear();
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  auto cont = [&](size_t k) { return i + k < n && (p[i + k] & 0xC0) == 0x80; };
  while (i < n) {
    const uint8_t c = p[i];
    if (c < 0x80) {
      out.push_back(c);
      i += 1;
    } else if ((c & 0xE0) == 0xC0 && (c & 0x40)) {
      if (cont(1)) {
        out.push_back((uint32_t(c & 0x1F) << 6) | (p[i + 1] & 0x3F));
        i += 2;
      } else {
        out.push_back(0xFFFD);
        i += 1;
      }
    } else if ((c & 0xF0) == 0xE0) {
      if (cont(1) && cont(2)) {
        out.push_back((uint32_t(c & 0x0F) << 12) | (uint32_t(p[i + 1] & 0x3F) << 6) | (p[i + 2] & 0x3F));
        i += 3;
      } else {
        out.push_back(0xFFFD);
        i += 1;
      }
    } else if ((c & 0xF8) == 0xF0) {
      uint32_t cp = 0;
      if (cont(1) && cont(2) && cont(3) &&
          (cp = (uint32_t(c & 0x07) << 18) | (uint32_t(p[i + 1] & 0x3F) << 12) | (uint32_t(p[i + 2] & 0x3F) << 6) |
                (p[i + 3] & 0x3F)) <= 0x10FFFF) {
        out.push_back(cp);
        i += 4;
      } else {
        out.push_back(0xFFFD);
        i += 1;
      }
    } else {  // continuation byte or 0xF8..0xFF
      out.push_back(0xFFFD);
      i += 1;
    }
  }
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp <= 0x7F) {
    out.push_back(static_cast<char>(cp));
  } else if (cp <= 0x7FF) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp <= 0xFFFF) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | ((cp >> 18) & 0x07)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

namespace {

struct ByteMap {
  std::array<std::string, 256> to_char;
  std::array<uint32_t, 256> to_cp{};
  ByteMap() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool direct = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      to_cp[b] = direct ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++);
      utf8_append(to_char[b], to_cp[b]);
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

}  // namespace

const std::string& byte_to_bpe_char(uint8_t b) noexcept {
  return byte_map().to_char[b];
}

int bpe_char_to_byte(uint32_t cp) noexcept {
  if ((cp >= 0x21 && cp <= 0x7E) || (cp >= 0xA1 && cp <= 0xAC) || (cp >= 0xAE && cp <= 0xFF)) {
    return static_cast<int>(cp);
  }
  if (cp >= 256 && cp < 256 + 68) {
    const auto& m = byte_map();
    for (int b = 0; b < 256; ++b)
      if (m.to_cp[b] == cp) return b;
  }
  return -1;
}

namespace {

constexpr uint32_t kEnd = 0xFFFFFFFF;

// A view of cps[begin, end): out-of-range positions read as kEnd / no flags.
struct Seg {
  const std::vector<uint32_t>& cps;
  size_t begin, end;
  uint32_t cpt(size_t pos) const { return (pos >= begin && pos < end) ? cps[pos] : kEnd; }
  bool in(size_t pos) const { return pos >= begin && pos < end; }
  bool letter(size_t pos) const { return in(pos) && unicode_category(cps[pos]) == kCatLetter; }
  bool number(size_t pos) const { return in(pos) && unicode_category(cps[pos]) == kCatNumber; }
  bool space(size_t pos) const { return in(pos) && unicode_is_whitespace(cps[pos]); }
  // [^\s\p{L}\p{N}] (and inside the segment)
  bool other(size_t pos) const {
    if (!in(pos)) return false;
    const uint32_t c = cps[pos];
    const UnicodeCat k = unicode_category(c);
    return k != kCatLetter && k != kCatNumber && !unicode_is_whitespace(c);
  }
};

inline uint32_t ascii_lower(uint32_t c) {
  return (c >= 'A' && c <= 'Z') ? c + 32 : c;
}

// Llama 3:  (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
//           ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
// Qwen2:   the same with \p{N} instead of \p{N}{1,3} (max_digits = 1).
void split_llama3(const Seg& s, size_t max_digits, std::vector<size_t>& out) {
  size_t prev = s.begin;
  auto add = [&](size_t end) {
    if (end > prev) out.push_back(end - prev);
    prev = end;
  };
  size_t pos = s.begin;
  while (pos < s.end) {
    const uint32_t c = s.cps[pos];
    // contractions, ASCII case-insensitive
    if (c == '\'' && pos + 1 < s.end) {
      const uint32_t n1 = ascii_lower(s.cpt(pos + 1));
      if (n1 == 's' || n1 == 't' || n1 == 'm' || n1 == 'd') {
        add(pos + 2);
        pos += 2;
        continue;
      }
      if (pos + 2 < s.end) {
        const uint32_t n2 = ascii_lower(s.cpt(pos + 2));
        if ((n1 == 'r' && n2 == 'e') || (n1 == 'v' && n2 == 'e') || (n1 == 'l' && n2 == 'l')) {
          add(pos + 3);
          pos += 3;
          continue;
        }
      }
    }
    const bool is_num = s.number(pos);
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (!(c == '\r' || c == '\n' || is_num)) {
      if (s.letter(pos) || s.letter(pos + 1)) {
        ++pos;
        while (s.letter(pos)) ++pos;
        add(pos);
        continue;
      }
    }
    // \p{N}{1,max}
    if (is_num) {
      size_t ini = pos;
      while (s.number(pos)) {
        if (++pos - ini >= max_digits) {
          add(pos);
          ini = pos;
        }
      }
      add(pos);
      continue;
    }
    //  ?[^\s\p{L}\p{N}]+[\r\n]*
    {
      const size_t q = (c == ' ') ? pos + 1 : pos;
      if (s.other(q)) {
        pos = q;
        while (s.other(pos)) ++pos;
        while (s.cpt(pos) == '\r' || s.cpt(pos) == '\n') ++pos;
        add(pos);
        continue;
      }
    }
    size_t num_ws = 0;
    size_t last_rn_end = 0;
    while (s.space(pos + num_ws)) {
      const uint32_t c2 = s.cps[pos + num_ws];
      if (c2 == '\r' || c2 == '\n') last_rn_end = pos + num_ws + 1;
      ++num_ws;
    }
    // \s*[\r\n]+
    if (last_rn_end > 0) {
      pos = last_rn_end;
      add(pos);
      continue;
    }
    // \s+(?!\S)
    if (num_ws > 1 && s.in(pos + num_ws)) {
      pos += num_ws - 1;
      add(pos);
      continue;
    }
    // \s+
    if (num_ws > 0) {
      pos += num_ws;
      add(pos);
      continue;
    }
    // no match (cannot happen: every character is L, N, \s or other)
    add(++pos);
  }
}

// GPT-2:  's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
void split_gpt2(const Seg& s, std::vector<size_t>& out) {
  size_t prev = s.begin;
  auto add = [&](size_t end) {
    if (end > prev) out.push_back(end - prev);
    prev = end;
  };
  size_t pos = s.begin;
  while (pos < s.end) {
    const uint32_t c = s.cps[pos];
    if (c == '\'' && pos + 1 < s.end) {
      const uint32_t n1 = s.cpt(pos + 1);
      if (n1 == 's' || n1 == 't' || n1 == 'm' || n1 == 'd') {
        add(pos + 2);
        pos += 2;
        continue;
      }
      if (pos + 2 < s.end) {
        const uint32_t n2 = s.cpt(pos + 2);
        if ((n1 == 'r' && n2 == 'e') || (n1 == 'v' && n2 == 'e') || (n1 == 'l' && n2 == 'l')) {
          add(pos + 3);
          pos += 3;
          continue;
        }
      }
    }
    const size_t q = (c == ' ') ? pos + 1 : pos;
    if (s.letter(q)) {
      pos = q;
      while (s.letter(pos)) ++pos;
      add(pos);
      continue;
    }
    if (s.number(q)) {
      pos = q;
      while (s.number(pos)) ++pos;
      add(pos);
      continue;
    }
    if (s.other(q)) {
      pos = q;
      while (s.other(pos)) ++pos;
      add(pos);
      continue;
    }
    size_t num_ws = 0;
    while (s.space(pos + num_ws)) ++num_ws;
    if (num_ws > 1 && s.in(pos + num_ws)) {
      pos += num_ws - 1;
      add(pos);
      continue;
    }
    if (num_ws > 0) {
      pos += num_ws;
      add(pos);
      continue;
    }
    add(++pos);
  }
}

// One regex stage of the form  X+  (or X{3} when exact3): matches and the gaps between
// them both become pre-tokens, as llama.cpp's unicode_regex_split_stl does.
template <typename Pred>
void split_runs(const Seg& s, Pred pred, bool exact3, std::vector<size_t>& out) {
  size_t prev = s.begin;
  size_t pos = s.begin;
  while (pos < s.end) {
    if (!pred(s.cps[pos])) {
      ++pos;
      continue;
    }
    size_t end = pos;
    if (exact3) {
      if (pos + 3 <= s.end && pred(s.cps[pos + 1]) && pred(s.cps[pos + 2])) {
        end = pos + 3;
      } else {
        ++pos;
        continue;
      }
    } else {
      while (end < s.end && pred(s.cps[end])) ++end;
    }
    if (pos > prev) out.push_back(pos - prev);
    out.push_back(end - pos);
    prev = pos = end;
  }
  if (s.end > prev) out.push_back(s.end - prev);
}

// Leftmost-first regex search over one segment: `match_at(s, pos)` returns the end of a
// match starting at pos, or pos when none starts there. Matches and the gaps between them
// both become pre-tokens (llama.cpp's unicode_regex_split_stl).
template <typename MatchAt>
void split_matches(const Seg& s, MatchAt match_at, std::vector<size_t>& out) {
  size_t prev = s.begin;
  size_t pos = s.begin;
  while (pos < s.end) {
    const size_t end = match_at(s, pos);
    if (end == pos) {
      ++pos;
      continue;
    }
    if (pos > prev) out.push_back(pos - prev);
    out.push_back(end - pos);
    prev = pos = end;
  }
  if (s.end > prev) out.push_back(s.end - prev);
}

// A chain of regex stages: each stage splits every pre-token of the previous one.
template <typename... Stages>
void split_chain(const std::vector<uint32_t>& cps, std::vector<size_t>& lengths, Stages&&... stages) {
  std::vector<size_t> cur{cps.size()};
  std::vector<size_t> next;
  auto stage = [&](auto&& fn) {
    next.clear();
    size_t start = 0;
    for (size_t len : cur) {
      fn(Seg{cps, start, start + len}, next);
      start += len;
    }
    cur.swap(next);
  };
  (stage(stages), ...);
  lengths.swap(cur);
}

// \p{N} as llama.cpp's collapsed-category regexes see it: one number code point.
size_t match_one_number(const Seg& s, size_t pos) {
  return s.number(pos) ? pos + 1 : pos;
}

// Tekken (Mistral Nemo):
//   [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|
//   [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|
//    ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
// as llama.cpp runs it: on category-collapsed text, where "upper" is a letter other than
// a-z and "lower" a letter other than A-Z (a non-ASCII letter is both).
size_t match_tekken(const Seg& s, size_t pos) {
  const uint32_t c = s.cps[pos];
  auto upper = [&](size_t p) { return s.letter(p) && !(s.cps[p] >= 'a' && s.cps[p] <= 'z'); };
  auto lower = [&](size_t p) { return s.letter(p) && !(s.cps[p] >= 'A' && s.cps[p] <= 'Z'); };
  const bool prefix = c != '\r' && c != '\n' && !s.letter(pos) && !s.number(pos);
  const size_t q = prefix ? pos + 1 : pos;
  size_t r = q;  // the run of "upper" letters
  while (upper(r)) ++r;
  // alternative 1: upper* lower+ (backtracking into the upper run for a lower letter)
  size_t k = r;
  while (true) {
    if (lower(k)) {
      size_t e = k;
      while (lower(e)) ++e;
      if (k == r) return e;
      return k + 1;  // the upper run's last non-ASCII letter, followed by a non-lower
    }
    if (k == q) break;
    --k;
  }
  // alternative 2: upper+ lower*
  if (r > q) {
    while (lower(r)) ++r;
    return r;
  }
  if (s.number(pos)) return pos + 1;
  {
    const size_t o = c == ' ' ? pos + 1 : pos;
    if (s.other(o)) {
      size_t e = o;
      while (s.other(e)) ++e;
      while (s.cpt(e) == '\r' || s.cpt(e) == '\n' || s.cpt(e) == '/') ++e;
      return e;
    }
  }
  size_t num_ws = 0;
  size_t last_rn_end = 0;
  while (s.space(pos + num_ws)) {
    const uint32_t c2 = s.cps[pos + num_ws];
    if (c2 == '\r' || c2 == '\n') last_rn_end = pos + num_ws + 1;
    ++num_ws;
  }
  if (last_rn_end > 0) return last_rn_end;
  if (num_ws > 1 && s.in(pos + num_ws)) return pos + num_ws - 1;
  return pos + num_ws;
}

// DeepSeek LLM: letters are the cased letters its tokenizer lists (code point ranges,
// inclusive), the rest are the ranges of its other regexes.
struct CpRange {
  uint32_t first, last;
};
constexpr CpRange kDeepseekLetters[] = {
    {0x41, 0x5A},       {0x61, 0x7A},       {0xB5, 0xB5},       {0xC0, 0xD6},       {0xD8, 0xF6},
    {0xF8, 0x1BA},      {0x1BC, 0x1BF},     {0x1C4, 0x293},     {0x295, 0x2AF},     {0x370, 0x373},
    {0x376, 0x376},     {0x377, 0x377},     {0x37B, 0x37D},     {0x37F, 0x37F},     {0x386, 0x386},
    {0x388, 0x38A},     {0x38C, 0x38C},     {0x38E, 0x3A1},     {0x3A3, 0x3F5},     {0x3F7, 0x481},
    {0x48A, 0x52F},     {0x531, 0x556},     {0x10A0, 0x10C5},   {0x13A0, 0x13F5},   {0x13F8, 0x13FD},
    {0x1C90, 0x1CBA},   {0x1CBD, 0x1CBF},   {0x1D00, 0x1D2B},   {0x1D6B, 0x1D77},   {0x1D79, 0x1D9A},
    {0x1E00, 0x1F15},   {0x1F18, 0x1F1D},   {0x1F20, 0x1F45},   {0x1F48, 0x1F4D},   {0x1F50, 0x1F57},
    {0x1F59, 0x1F59},   {0x1F5B, 0x1F5B},   {0x1F5D, 0x1F5D},   {0x1F5F, 0x1F7D},   {0x1F80, 0x1FB4},
    {0x1FB6, 0x1FBC},   {0x1FBE, 0x1FBE},   {0x1FC2, 0x1FC4},   {0x1FC6, 0x1FCC},   {0x1FD0, 0x1FD3},
    {0x1FD6, 0x1FDB},   {0x1FE0, 0x1FEC},   {0x1FF2, 0x1FF4},   {0x1FF6, 0x1FFC},   {0x2102, 0x2102},
    {0x2107, 0x2107},   {0x210A, 0x2113},   {0x2115, 0x2115},   {0x2119, 0x211D},   {0x2124, 0x2124},
    {0x2126, 0x2126},   {0x2128, 0x2128},   {0x212A, 0x212D},   {0x212F, 0x2134},   {0x2139, 0x2139},
    {0x213C, 0x213F},   {0x2145, 0x2149},   {0x214E, 0x214E},   {0x2183, 0x2183},   {0x2184, 0x2184},
    {0x2C00, 0x2C7B},   {0x2C7E, 0x2CE4},   {0x2CEB, 0x2CEE},   {0x2CF2, 0x2CF2},   {0x2CF3, 0x2CF3},
    {0xA640, 0xA66D},   {0xA680, 0xA69B},   {0xA722, 0xA76F},   {0xA771, 0xA787},   {0xA78B, 0xA78E},
    {0xAB70, 0xABBF},   {0xFB00, 0xFB06},   {0xFB13, 0xFB17},   {0xFF21, 0xFF3A},   {0xFF41, 0xFF5A},
    {0x10400, 0x1044F}, {0x104B0, 0x104D3}, {0x104D8, 0x104FB}, {0x10C80, 0x10CB2}, {0x10CC0, 0x10CF2},
    {0x118A0, 0x118DF}, {0x1E900, 0x1E943}};

bool in_ranges(std::span<const CpRange> ranges, uint32_t c) {
  const auto it =
      std::upper_bound(ranges.begin(), ranges.end(), c, [](uint32_t v, const CpRange& r) { return v < r.first; });
  return it != ranges.begin() && c <= (it - 1)->last;
}

// llama.cpp runs these regexes with std::wregex on text where every non-ASCII whitespace
// code point was replaced by U+000B, so a class of non-ASCII characters never matches one.
bool deepseek_letter(const Seg& s, size_t p) {
  return s.in(p) && !s.space(p) && in_ranges(kDeepseekLetters, s.cps[p]);
}
bool deepseek_punct(const Seg& s, size_t p) {
  if (!s.in(p) || s.space(p)) return false;
  const uint32_t c = s.cps[p];
  // [!-/:-~！-／：-～‘-‟　-。]
  return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x7E) || (c >= 0xFF01 && c <= 0xFF0F) ||
         (c >= 0xFF1A && c <= 0xFF5E) || (c >= 0x2018 && c <= 0x201F) || (c >= 0x3000 && c <= 0x3002);
}
bool deepseek_cjk(const Seg& s, size_t p) {
  if (!s.in(p) || s.space(p)) return false;
  const uint32_t c = s.cps[p];
  // [一-龥ࠀ-一가-퟿]
  return (c >= 0x4E00 && c <= 0x9FA5) || (c >= 0x0800 && c <= 0x4E00) || (c >= 0xAC00 && c <= 0xD7FF);
}
// \s?X+ for a class X
template <typename Cls>
size_t match_space_opt_run(const Seg& s, size_t pos, Cls cls) {
  size_t q = pos;
  if (s.space(pos) && cls(s, pos + 1)) q = pos + 1;
  if (!cls(s, q)) return pos;
  while (cls(s, q)) ++q;
  return q;
}

void split_deepseek_llm(const std::vector<uint32_t>& cps, std::vector<size_t>& lengths) {
  split_chain(
      cps, lengths,
      [](const Seg& s, std::vector<size_t>& out) {  // [\r\n]
        split_matches(
            s, [](const Seg& g, size_t p) { return (g.cps[p] == '\r' || g.cps[p] == '\n') ? p + 1 : p; }, out);
      },
      [](const Seg& s, std::vector<size_t>& out) {  // \s?[letters]+
        split_matches(
            s, [](const Seg& g, size_t p) { return match_space_opt_run(g, p, deepseek_letter); }, out);
      },
      [](const Seg& s, std::vector<size_t>& out) {  // \s?[punctuation]+
        split_matches(
            s, [](const Seg& g, size_t p) { return match_space_opt_run(g, p, deepseek_punct); }, out);
      },
      [](const Seg& s, std::vector<size_t>& out) {  // \s+$ : the segment's trailing whitespace
        size_t t = s.end;
        while (t > s.begin && s.space(t - 1)) --t;
        if (t > s.begin) out.push_back(t - s.begin);
        if (s.end > t) out.push_back(s.end - t);
      },
      [](const Seg& s, std::vector<size_t>& out) {  // [一-龥ࠀ-一가-퟿]+
        split_matches(
            s,
            [](const Seg& g, size_t p) {
              size_t e = p;
              while (deepseek_cjk(g, e)) ++e;
              return e;
            },
            out);
      },
      [](const Seg& s, std::vector<size_t>& out) {  // \p{N}+
        split_matches(
            s,
            [](const Seg& g, size_t p) {
              size_t e = p;
              while (g.number(e)) ++e;
              return e;
            },
            out);
      });
}

}  // namespace

void pretokenize(SplitKind kind, const std::vector<uint32_t>& cps, std::vector<size_t>& lengths) {
  lengths.clear();
  if (cps.empty()) return;
  const Seg whole{cps, 0, cps.size()};
  switch (kind) {
    case SplitKind::kLlama3:
      split_llama3(whole, 3, lengths);
      return;
    case SplitKind::kQwen2:
      split_llama3(whole, 1, lengths);
      return;
    case SplitKind::kGpt2:
      split_gpt2(whole, lengths);
      return;
    case SplitKind::kTekken:
      split_matches(whole, match_tekken, lengths);
      return;
    case SplitKind::kDeepseekLlm:
      split_deepseek_llm(cps, lengths);
      return;
    case SplitKind::kSmollm:
      // \p{N} (one digit per pre-token), then the GPT-2 regex
      split_chain(
          cps, lengths, [](const Seg& s, std::vector<size_t>& out) { split_matches(s, match_one_number, out); },
          [](const Seg& s, std::vector<size_t>& out) { split_gpt2(s, out); });
      return;
    case SplitKind::kDefault:
      break;
  }
  // llama.cpp's "default" BPE pre-tokenizer: four regexes applied one after the other,
  // each inside the pieces of the previous one:
  //   [\p{P}\$\+<=>\^~\|]+ , the GPT-2 regex, \p{N}+ , [0-9][0-9][0-9]
  split_chain(
      cps, lengths,
      [](const Seg& s, std::vector<size_t>& out) {
        split_runs(
            s,
            [](uint32_t c) {
              if (c == '$' || c == '+' || c == '<' || c == '=' || c == '>' || c == '^' || c == '~' || c == '|')
                return true;
              return unicode_category(c) == kCatPunct && !unicode_is_whitespace(c);
            },
            false, out);
      },
      [](const Seg& s, std::vector<size_t>& out) { split_gpt2(s, out); },
      [](const Seg& s, std::vector<size_t>& out) {
        split_runs(
            s, [](uint32_t c) { return unicode_category(c) == kCatNumber && !unicode_is_whitespace(c); }, false, out);
      },
      [](const Seg& s, std::vector<size_t>& out) {
        split_runs(
            s, [](uint32_t c) { return c >= '0' && c <= '9'; }, true, out);
      });
}

}  // namespace tandem::detail
