// Tokenizer: vocabulary loading/validation, special-token partitioning, SentencePiece and
// byte-level BPE encoding, pieces, detokenization, streaming. Semantics follow
// llama.cpp's llama-vocab.cpp (see include/tandem/tokenizer/tokenizer.hpp for the exact rules).
#include "tandem/tokenizer/tokenizer.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <queue>
#include <string>
#include <unordered_map>
#include <utility>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "tandem/gguf/gguf.hpp"
#include "tokenizer/tokenizer_internal.hpp"

namespace tandem {

namespace {

constexpr int32_t kNull = -1;

[[noreturn]] void fail(const std::string& msg) {
  throw Error(ErrorCode::kTokenizer, "tokenizer: " + msg);
}

struct MergeKey {
  std::string_view left, right;
  bool operator==(const MergeKey& o) const noexcept { return left == o.left && right == o.right; }
};
struct MergeHash {
  size_t operator()(const MergeKey& k) const noexcept {
    const size_t a = std::hash<std::string_view>{}(k.left);
    const size_t b = std::hash<std::string_view>{}(k.right);
    return a ^ (b * 0x9E3779B97F4A7C15ull + 0x7F4A7C15ull + (a << 6) + (a >> 2));
  }
};

// Strings held as one byte blob plus each one's end offset: 4 bytes of overhead per
// string where a std::string costs 32 (Gemma 3's 262k tokens: 1 MiB, not 8). Append-only
// while it is built; the views it hands out stay valid once building is over.
class StringTable {
 public:
  void push_back(std::string_view s) {
    if (s.size() > UINT32_MAX - bytes_.size()) fail("vocabulary texts exceed 4 GiB");
    bytes_.append(s);
    ends_.push_back(static_cast<uint32_t>(bytes_.size()));
  }
  size_t size() const noexcept { return ends_.size(); }
  std::string_view operator[](size_t i) const noexcept {
    const uint32_t begin = i == 0 ? 0 : ends_[i - 1];
    return std::string_view(bytes_).substr(begin, ends_[i] - begin);
  }
  /// Drop the spare capacity the appends left.
  void shrink() {
    bytes_.shrink_to_fit();
    ends_.shrink_to_fit();
  }

 private:
  std::string bytes_;
  std::vector<uint32_t> ends_;
};

bool is_special_type(TokenType t) {
  return t == TokenType::kControl || t == TokenType::kUnknown;
}

}  // namespace

struct Tokenizer::Impl {
  TokenizerModel model = TokenizerModel::kSpm;
  PreTokenizer pre = PreTokenizer::kNone;
  detail::SplitKind split = detail::SplitKind::kDefault;
  std::string pre_name;
  std::string model_name;

  StringTable texts;  // never changed after the tables below are built
  std::vector<float> scores;
  std::vector<TokenType> types;
  // Token text -> id: open addressing over ids (linear probing, a power-of-two size at
  // most half full, kNull = empty), 4 bytes a slot; the texts live in `texts` once.
  std::vector<int32_t> id_slots;

  StringTable merge_lines;
  std::unordered_map<MergeKey, int32_t, MergeHash> ranks;

  StringTable pieces;                   // token_to_piece(id, special=true)
  std::vector<int32_t> special_tokens;  // control/unknown/user-defined, longest text first

  int32_t bos = kNull, eos = kNull, eot = kNull, eom = kNull, unk = kNull, pad = kNull;
  bool add_bos = false, add_eos = false, add_space_prefix = false;
  bool ignore_merges = false, clean_spaces = false;

  std::vector<int32_t> eog;
  std::vector<uint8_t> eog_flag;

  std::array<int32_t, 256> spm_byte_token{};     // <0xXX> (or the raw byte) token per byte
  std::array<int32_t, 256> single_byte_token{};  // token whose text is that one byte

  std::string chat_template;
  uint64_t hash = 0;

  // The id_slots slot holding `s`, or the empty slot where it would go.
  size_t slot_of(std::string_view s) const noexcept {
    const size_t mask = id_slots.size() - 1;
    for (size_t k = XXH3_64bits(s.data(), s.size()) & mask;; k = (k + 1) & mask) {
      const int32_t id = id_slots[k];
      if (id == kNull || texts[static_cast<size_t>(id)] == s) return k;
    }
  }
  int32_t find(std::string_view s) const noexcept { return id_slots.empty() ? kNull : id_slots[slot_of(s)]; }
  int32_t rank(std::string_view l, std::string_view r) const noexcept {
    auto it = ranks.find(MergeKey{l, r});
    return it == ranks.end() ? -1 : it->second;
  }
  void check_id(int32_t id) const {
    if (id < 0 || static_cast<size_t>(id) >= texts.size()) {
      throw Error(ErrorCode::kInvalidArgument, "tokenizer: token id " + std::to_string(id) + " out of range [0, " +
                                                   std::to_string(texts.size()) + ")");
    }
  }

  void encode_spm(std::string_view text, std::vector<int32_t>& out) const;
  void encode_bpe(std::string_view text, std::vector<int32_t>& out) const;

  // Construction, in order (Tokenizer::Tokenizer).
  struct Defaults {
    int32_t bos = kNull, eos = kNull, unk = kNull;
  };
  void set_model_defaults(const std::string& pre_name, Defaults& d);
  void load_tokens(TokenizerVocab& v, size_t n);
  void set_special_ids(const TokenizerVocab& v, size_t n, const Defaults& d);
  void find_eog(size_t n);
  void build_tables();
  void compute_hash();
  void encode_bpe_word(std::string_view word, std::vector<int32_t>& out) const;
};

// ---------------------------------------------------------------------------------------
// construction

void Tokenizer::Impl::set_model_defaults(const std::string& p, Defaults& d) {
  Impl& m = *this;
  // defaults by model (llama.cpp llama_vocab::impl::load)
  if (m.model == TokenizerModel::kSpm) {
    m.pre = PreTokenizer::kNone;
    d.bos = 1;
    d.eos = 2;
    d.unk = 0;
    m.add_space_prefix = true;
    m.clean_spaces = false;
    m.add_bos = true;
    m.add_eos = false;
  } else {
    d.bos = 11;
    d.eos = 11;
    m.add_space_prefix = false;
    auto is = [&p](std::initializer_list<std::string_view> names) {
      return std::find(names.begin(), names.end(), p) != names.end();
    };
    auto use = [&](PreTokenizer pt, detail::SplitKind sk, bool clean) {
      m.pre = pt;
      m.split = sk;
      m.clean_spaces = clean;
    };
    // llama.cpp llama_vocab::impl::load: pre-tokenizer, clean_spaces, ignore_merges, add_bos
    if (p.empty() || p == "default") {
      use(PreTokenizer::kDefault, detail::SplitKind::kDefault, true);
    } else if (is({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"})) {
      use(PreTokenizer::kLlama3, detail::SplitKind::kLlama3, true);
      m.ignore_merges = true;
      m.add_bos = true;
    } else if (is({"dbrx", "smaug-bpe"})) {
      use(PreTokenizer::kLlama3, detail::SplitKind::kLlama3, true);
    } else if (is({"qwen2", "deepseek-r1-qwen", "kormo", "hunyuan", "grok-2"})) {
      use(PreTokenizer::kQwen2, detail::SplitKind::kQwen2, false);
    } else if (is({"stablelm2", "megrez"})) {
      use(PreTokenizer::kQwen2, detail::SplitKind::kQwen2, true);
    } else if (is({"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
                   "exaone4", "mpt", "olmo", "jais"})) {
      use(PreTokenizer::kGpt2, detail::SplitKind::kGpt2, true);
    } else if (is({"trillion", "granite-docling"})) {
      use(PreTokenizer::kGpt2, detail::SplitKind::kGpt2, false);
    } else if (is({"smollm", "command-r"})) {
      use(PreTokenizer::kSmollm, detail::SplitKind::kSmollm, false);
    } else if (is({"starcoder", "refact", "codeshell", "exaone", "minerva-7b"})) {
      use(PreTokenizer::kSmollm, detail::SplitKind::kSmollm, true);
    } else if (p == "tekken") {
      use(PreTokenizer::kTekken, detail::SplitKind::kTekken, false);
      m.ignore_merges = true;
      m.add_bos = true;
    } else if (p == "deepseek-llm") {
      use(PreTokenizer::kDeepseekLlm, detail::SplitKind::kDeepseekLlm, false);
    } else {
      fail("unsupported tokenizer.ggml.pre '" + p +
           "' (Tandem implements default, the gpt-2, llama3/llama-bpe, qwen2, smollm, tekken and deepseek-llm "
           "pre-tokenizers and their aliases; see PreTokenizer in tokenizer.hpp)");
    }
  }
}

void Tokenizer::Impl::load_tokens(TokenizerVocab& v, size_t n) {
  Impl& m = *this;
  for (size_t i = 0; i < n; ++i) {
    m.texts.push_back(v.tokens[i].empty() ? "[EMPTY_" + std::to_string(i) + "]" : v.tokens[i]);
  }
  m.texts.shrink();
  std::vector<std::string>().swap(v.tokens);
  m.scores = v.scores.empty() ? std::vector<float>(n, 0.0f) : std::move(v.scores);
  m.types.resize(n, TokenType::kNormal);
  for (size_t i = 0; i < v.token_types.size(); ++i) {
    const int32_t t = v.token_types[i];
    m.types[i] = (t >= 1 && t <= 6) ? static_cast<TokenType>(t) : TokenType::kUndefined;
  }
  m.id_slots.assign(std::bit_ceil(n * 2), kNull);
  for (size_t i = 0; i < n; ++i) {
    int32_t& slot = m.id_slots[m.slot_of(m.texts[i])];
    if (slot != kNull) {
      fail("token text appears twice in tokenizer.ggml.tokens (ids " + std::to_string(slot) + " and " +
           std::to_string(i) + ")");
    }
    slot = static_cast<int32_t>(i);
  }

  // merges
  if (m.model == TokenizerModel::kBpe) {
    for (const std::string& line : v.merges) m.merge_lines.push_back(line);
    m.merge_lines.shrink();
    std::vector<std::string>().swap(v.merges);
    m.ranks.reserve(m.merge_lines.size() * 2);
    for (size_t i = 0; i < m.merge_lines.size(); ++i) {
      std::string_view line = m.merge_lines[i];
      const size_t pos = line.size() > 1 ? line.find(' ', 1) : std::string_view::npos;
      if (pos == std::string_view::npos) continue;  // llama.cpp: ("", "") which never matches
      m.ranks.emplace(MergeKey{line.substr(0, pos), line.substr(pos + 1)}, static_cast<int32_t>(i));
    }
  }
}

void Tokenizer::Impl::set_special_ids(const TokenizerVocab& v, size_t n, const Defaults& d) {
  Impl& m = *this;
  auto special = [&](const std::optional<int64_t>& given, int32_t def, const char* key) -> int32_t {
    if (given && *given >= 0) {
      if (static_cast<uint64_t>(*given) >= n) {
        fail(std::string(key) + " = " + std::to_string(*given) + " is out of range (n_vocab " + std::to_string(n) +
             ")");
      }
      return static_cast<int32_t>(*given);
    }
    return (def >= 0 && static_cast<size_t>(def) < n) ? def : kNull;
  };
  m.bos = special(v.bos_id, d.bos, "tokenizer.ggml.bos_token_id");
  m.eos = special(v.eos_id, d.eos, "tokenizer.ggml.eos_token_id");
  m.unk = special(v.unk_id, d.unk, "tokenizer.ggml.unknown_token_id");
  m.pad = special(v.pad_id, kNull, "tokenizer.ggml.padding_token_id");
  m.eot = special(v.eot_id, kNull, "tokenizer.ggml.eot_token_id");
  m.eom = special(v.eom_id, kNull, "tokenizer.ggml.eom_token_id");
  if (m.add_bos && m.bos == kNull) fail("add_bos_token is set but there is no BOS token");
  if (m.add_eos && m.eos == kNull) fail("add_eos_token is set but there is no EOS token");
}

// End-of-generation ids and the special-token names that imply them (llama.cpp
// llama_vocab::impl::load).
void Tokenizer::Impl::find_eog(size_t n) {
  Impl& m = *this;
  auto force_control = [&](int32_t id) {
    if (m.types[id] != TokenType::kControl) m.types[id] = TokenType::kControl;
  };
  auto first_of = [&](std::initializer_list<std::string_view> names) -> int32_t {
    for (auto s : names) {
      const int32_t id = m.find(s);
      if (id != kNull) return id;
    }
    return kNull;
  };
  // DeepSeek's "<｜end▁of▁sentence｜>" (fullwidth bars, U+2581 spaces), spelt in bytes.
  constexpr std::string_view kDeepSeekEndOfSentence =
      "<\xef\xbd\x9c"
      "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>";
  if (m.eot == kNull) {
    m.eot = first_of({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
                      "<EOT>", "_<EOT>", kDeepSeekEndOfSentence, "<end_of_utterance>"});
    if (m.eot != kNull) force_control(m.eot);
  }
  if (m.eom == kNull) {
    m.eom = first_of({"<|eom_id|>"});
    if (m.eom != kNull) force_control(m.eom);
  }
  std::vector<int32_t> ids;
  {
    const int32_t fim_pad = first_of({"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"});
    const int32_t fim_rep = first_of({"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"});
    const int32_t fim_sep = first_of({"<|file_sep|>"});
    for (int32_t id : {fim_pad, fim_rep, fim_sep}) {
      if (id != kNull) {
        force_control(id);
        ids.push_back(id);
      }
    }
    for (std::string_view s :
         {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
          "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>"}) {
      const int32_t id = m.find(s);
      if (id != kNull) {
        ids.push_back(id);
        force_control(id);
      }
    }
    for (int32_t id : {m.eos, m.eot, m.eom})
      if (id != kNull) ids.push_back(id);
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    // o200k_harmony: "<|end|>" is not end-of-generation when "<|return|>" and "<|call|>" are
    const int32_t ret = m.find("<|return|>"), call = m.find("<|call|>"), end = m.find("<|end|>");
    if (ret != kNull && call != kNull && end != kNull) {
      ids.erase(std::remove(ids.begin(), ids.end(), end), ids.end());
      m.types[end] = TokenType::kUserDefined;
    }
  }
  m.eog = std::move(ids);
  m.eog_flag.assign(n, 0);
  for (int32_t id : m.eog) m.eog_flag[id] = 1;
}

void Tokenizer::Impl::build_tables() {
  Impl& m = *this;
  const size_t n = texts.size();
  // special tokens for partitioning: longest text first (ties: lower id first)
  for (size_t i = 0; i < n; ++i) {
    const TokenType t = m.types[i];
    if (t == TokenType::kControl || t == TokenType::kUserDefined || t == TokenType::kUnknown)
      m.special_tokens.push_back(static_cast<int32_t>(i));
  }
  std::stable_sort(m.special_tokens.begin(), m.special_tokens.end(),
                   [&](int32_t a, int32_t b) { return m.texts[a].size() > m.texts[b].size(); });

  // byte tokens
  static const char* kHex = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) {
    const char one[1] = {static_cast<char>(b)};
    m.single_byte_token[b] = m.find(std::string_view(one, 1));
    const char hex[6] = {'<', '0', 'x', kHex[b >> 4], kHex[b & 15], '>'};
    const int32_t id = m.find(std::string_view(hex, 6));
    m.spm_byte_token[b] = id != kNull ? id : m.single_byte_token[b];
  }

  // pieces (special = true)
  std::string piece;
  for (size_t i = 0; i < n; ++i) {
    const std::string_view text = m.texts[i];
    const TokenType t = m.types[i];
    piece.clear();
    if (t == TokenType::kControl || t == TokenType::kUnknown || t == TokenType::kUserDefined) {
      piece = text;
    } else if (m.model == TokenizerModel::kSpm) {
      if (t == TokenType::kNormal) {
        piece.reserve(text.size());
        for (size_t k = 0; k < text.size();) {
          if (text.compare(k, 3, "\xe2\x96\x81") == 0) {
            piece.push_back(' ');
            k += 3;
          } else {
            piece.push_back(text[k++]);
          }
        }
      } else if (t == TokenType::kByte) {
        // llama.cpp: strtol(text.substr(3, 2), 16)
        unsigned value = 0;
        for (size_t k = 3; k < 5 && k < text.size(); ++k) {
          const char c = text[k];
          int d = -1;
          if (c >= '0' && c <= '9')
            d = c - '0';
          else if (c >= 'a' && c <= 'f')
            d = c - 'a' + 10;
          else if (c >= 'A' && c <= 'F')
            d = c - 'A' + 10;
          if (d < 0) break;
          value = value * 16 + static_cast<unsigned>(d);
        }
        piece.push_back(static_cast<char>(value & 0xFF));
      }
    } else if (t == TokenType::kNormal) {
      std::vector<uint32_t> cps;
      detail::utf8_decode_lax(text, cps);
      for (uint32_t cp : cps) {
        const int b = detail::bpe_char_to_byte(cp);
        if (b >= 0) {
          piece.push_back(static_cast<char>(b));
        } else {  // llama.cpp's llama_decode_text marker for an unmapped code point
          std::string u;
          detail::utf8_append(u, cp);
          piece += "[UNK_BYTE_0x";
          static const char* kLow = "0123456789abcdef";
          for (unsigned char c : u) {
            piece.push_back(kLow[c >> 4]);
            piece.push_back(kLow[c & 15]);
          }
          piece.append(text);
          piece += ']';
        }
      }
    }
    m.pieces.push_back(piece);
  }
  m.pieces.shrink();
}

void Tokenizer::Impl::compute_hash() {
  Impl& m = *this;
  const size_t n = texts.size();
  {
    XXH3_state_t* st = XXH3_createState();
    XXH3_64bits_reset(st);
    auto put_u64 = [&](uint64_t x) { XXH3_64bits_update(st, &x, sizeof x); };
    auto put_str = [&](std::string_view s) {
      put_u64(s.size());
      XXH3_64bits_update(st, s.data(), s.size());
    };
    put_str("tandem-tokenizer-v1");
    put_str(m.model_name);
    put_str(m.pre_name);
    put_u64(n);
    for (size_t i = 0; i < n; ++i) put_str(m.texts[i]);
    XXH3_64bits_update(st, m.scores.data(), m.scores.size() * sizeof(float));
    for (TokenType t : m.types) put_u64(static_cast<uint64_t>(t));
    put_u64(m.merge_lines.size());
    for (size_t i = 0; i < m.merge_lines.size(); ++i) put_str(m.merge_lines[i]);
    for (int32_t id : {m.bos, m.eos, m.eot, m.eom, m.unk, m.pad})
      put_u64(static_cast<uint64_t>(static_cast<int64_t>(id)));
    put_u64((m.add_bos ? 1u : 0u) | (m.add_eos ? 2u : 0u) | (m.add_space_prefix ? 4u : 0u));
    put_str(m.chat_template);
    m.hash = XXH3_64bits_digest(st);
    XXH3_freeState(st);
  }
}

Tokenizer::Tokenizer(TokenizerVocab v) {
  auto impl = std::make_shared<Impl>();
  Impl& m = *impl;

  if (v.model == "llama") {
    m.model = TokenizerModel::kSpm;
  } else if (v.model == "gpt2") {
    m.model = TokenizerModel::kBpe;
  } else {
    fail("unsupported tokenizer.ggml.model '" + v.model + "' (supported: llama, gpt2)");
  }
  const size_t n = v.tokens.size();
  if (n == 0) fail("empty vocabulary (tokenizer.ggml.tokens)");
  if (n > static_cast<size_t>(INT32_MAX)) fail("vocabulary too large");
  if (!v.scores.empty() && v.scores.size() != n) {
    fail("tokenizer.ggml.scores has " + std::to_string(v.scores.size()) + " entries, expected " + std::to_string(n));
  }
  if (!v.token_types.empty() && v.token_types.size() != n) {
    fail("tokenizer.ggml.token_type has " + std::to_string(v.token_types.size()) + " entries, expected " +
         std::to_string(n));
  }

  m.model_name = v.model;
  m.pre_name = v.pre;
  m.chat_template = std::move(v.chat_template);

  // defaults by model (llama.cpp llama_vocab::impl::load)
  Impl::Defaults defs;
  m.set_model_defaults(v.pre, defs);
  if (v.add_space_prefix) m.add_space_prefix = *v.add_space_prefix;
  if (v.add_bos) m.add_bos = *v.add_bos;
  if (v.add_eos) m.add_eos = *v.add_eos;

  m.load_tokens(v, n);
  m.set_special_ids(v, n, defs);
  m.find_eog(n);
  m.build_tables();
  m.compute_hash();
  impl_ = std::move(impl);
}

// ---------------------------------------------------------------------------------------
// SentencePiece

namespace {

struct Symbol {
  int32_t prev;
  int32_t next;
  uint32_t off;
  uint32_t n;
};

struct SpmBigram {
  int32_t left;
  int32_t right;
  float score;
  uint32_t size;
};
struct SpmCmp {
  bool operator()(const SpmBigram& l, const SpmBigram& r) const {
    return l.score < r.score || (l.score == r.score && l.left > r.left);
  }
};

struct BpeBigram {
  int32_t rank;
  int32_t left;
  int32_t right;
  uint32_t size;
};
struct BpeCmp {
  bool operator()(const BpeBigram& l, const BpeBigram& r) const {
    return l.rank > r.rank || (l.rank == r.rank && l.left > r.left);
  }
};

// One symbol per UTF-8 character of `text` (a truncated character at the end is one
// symbol of the remaining bytes), linked as a list through prev/next.
void split_utf8_symbols(std::string_view text, std::vector<Symbol>& sym) {
  sym.clear();
  for (size_t off = 0; off < text.size();) {
    const size_t len = std::min(detail::utf8_len_from_lead(static_cast<uint8_t>(text[off])), text.size() - off);
    const int32_t idx = static_cast<int32_t>(sym.size());
    off += len;
    sym.push_back(Symbol{idx - 1, off == text.size() ? -1 : idx + 1, static_cast<uint32_t>(off - len),
                         static_cast<uint32_t>(len)});
  }
}

// The merge loop SPM and BPE share (as llama.cpp's tokenizers do): pop the best bigram,
// skip it when an earlier merge outdated it, merge its right symbol into its left one and
// offer the merged symbol's two new neighbour pairs back through `try_add(left, right)`.
template <class Queue, class TryAdd>
void merge_bigrams(std::vector<Symbol>& sym, Queue& queue, TryAdd&& try_add) {
  while (!queue.empty()) {
    const auto b = queue.top();
    queue.pop();
    Symbol& L = sym[b.left];
    Symbol& R = sym[b.right];
    if (L.n == 0 || R.n == 0 || L.n + R.n != b.size) continue;  // outdated
    L.n += R.n;
    R.n = 0;
    L.next = R.next;
    if (R.next >= 0) sym[R.next].prev = b.left;
    try_add(L.prev, b.left);
    try_add(b.left, L.next);
  }
}

}  // namespace

void Tokenizer::Impl::encode_spm(std::string_view text, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  if (text.size() > UINT32_MAX / 2) throw Error(ErrorCode::kInvalidArgument, "tokenizer: text too long");
  std::vector<Symbol> sym;
  sym.reserve(text.size());
  split_utf8_symbols(text, sym);
  std::vector<SpmBigram> storage;
  storage.reserve(sym.size());
  std::priority_queue<SpmBigram, std::vector<SpmBigram>, SpmCmp> queue(SpmCmp{}, std::move(storage));
  auto try_add = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const uint32_t size = sym[l].n + sym[r].n;
    const int32_t id = find(text.substr(sym[l].off, size));
    if (id == kNull) return;
    queue.push(SpmBigram{l, r, scores[id], size});
  };
  for (int32_t i = 1; i < static_cast<int32_t>(sym.size()); ++i) try_add(i - 1, i);
  merge_bigrams(sym, queue, try_add);
  // "resegment": every merged symbol is a token (it was created from a bigram whose text
  // is in the vocabulary), so only unmerged characters can miss -> byte fallback.
  for (int32_t i = 0; i != -1; i = sym[i].next) {
    const Symbol& s = sym[i];
    const std::string_view piece = text.substr(s.off, s.n);
    const int32_t id = find(piece);
    if (id != kNull) {
      out.push_back(id);
      continue;
    }
    for (unsigned char c : piece) {
      const int32_t bt = spm_byte_token[c];
      if (bt != kNull) {
        out.push_back(bt);
      } else if (unk != kNull) {
        out.push_back(unk);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// byte-level BPE

void Tokenizer::Impl::encode_bpe_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges) {
    const int32_t id = find(word);
    if (id != kNull) {
      out.push_back(id);
      return;
    }
  }
  std::vector<Symbol> sym;
  sym.reserve(word.size() / 2 + 1);
  split_utf8_symbols(word, sym);
  std::vector<BpeBigram> storage;
  storage.reserve(sym.size());
  std::priority_queue<BpeBigram, std::vector<BpeBigram>, BpeCmp> queue(BpeCmp{}, std::move(storage));
  auto try_add = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const int32_t rk = rank(word.substr(sym[l].off, sym[l].n), word.substr(sym[r].off, sym[r].n));
    if (rk < 0) return;
    queue.push(BpeBigram{rk, l, r, sym[l].n + sym[r].n});
  };
  for (int32_t i = 1; i < static_cast<int32_t>(sym.size()); ++i) try_add(i - 1, i);
  merge_bigrams(sym, queue, try_add);
  for (int32_t i = 0; i != -1; i = sym[i].next) {
    const Symbol& s = sym[i];
    const std::string_view piece = word.substr(s.off, s.n);
    const int32_t id = find(piece);
    if (id != kNull) {
      out.push_back(id);
      continue;
    }
    // llama.cpp: look every byte of the (byte-level encoded) symbol up as a 1-char token
    for (unsigned char c : piece) {
      const int32_t bt = single_byte_token[c];
      if (bt != kNull) out.push_back(bt);
    }
  }
}

void Tokenizer::Impl::encode_bpe(std::string_view text, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  std::vector<uint32_t> cps;
  detail::utf8_decode_lax(text, cps);
  std::vector<size_t> lengths;
  detail::pretokenize(split, cps, lengths);
  std::string utf8;
  std::string word;
  size_t start = 0;
  for (size_t len : lengths) {
    word.clear();
    for (size_t i = start; i < start + len; ++i) {
      utf8.clear();
      detail::utf8_append(utf8, cps[i]);
      for (unsigned char c : utf8) word += detail::byte_to_bpe_char(c);
    }
    start += len;
    encode_bpe_word(word, out);
  }
}

// ---------------------------------------------------------------------------------------
// public API

std::vector<int32_t> Tokenizer::tokenize(std::string_view text, bool add_special, bool parse_special) const {
  const TextSegment one{text, parse_special};
  return tokenize(std::span<const TextSegment>(&one, 1), add_special);
}

std::vector<int32_t> Tokenizer::tokenize(std::span<const TextSegment> segments, bool add_special) const {
  const Impl& m = *impl_;
  struct Frag {
    int32_t token;  // kNull: raw text [off, off + len)
    size_t off, len;
    bool parse;  // special-token text inside it becomes control tokens
  };
  // One buffer holding every segment; special tokens are searched only inside fragments
  // of segments that allow it, and never across a segment boundary.
  std::string joined;
  std::vector<Frag> frags;
  bool any_parse = false;
  for (const TextSegment& seg : segments) {
    if (seg.text.empty()) continue;
    frags.push_back(Frag{kNull, joined.size(), seg.text.size(), seg.parse_special});
    joined.append(seg.text);
    any_parse = any_parse || seg.parse_special;
  }
  const std::string_view text = joined;
  std::vector<Frag> next;
  for (int32_t sid : m.special_tokens) {
    const bool control = is_special_type(m.types[sid]);
    if (!any_parse && control) continue;
    const std::string_view st = m.texts[sid];
    auto eligible = [&](const Frag& f) { return f.token == kNull && (f.parse || !control) && f.len >= st.size(); };
    bool any = false;
    for (const Frag& f : frags) {
      if (eligible(f) && text.substr(f.off, f.len).find(st) != std::string_view::npos) {
        any = true;
        break;
      }
    }
    if (!any) continue;
    next.clear();
    for (const Frag& f : frags) {
      if (!eligible(f)) {
        next.push_back(f);
        continue;
      }
      size_t off = f.off;
      const size_t end = f.off + f.len;
      while (off < end) {
        const size_t pos = text.substr(0, end).find(st, off);
        if (pos == std::string_view::npos) break;
        if (pos > off) next.push_back(Frag{kNull, off, pos - off, f.parse});
        next.push_back(Frag{sid, 0, 0, false});
        off = pos + st.size();
      }
      if (off < end) next.push_back(Frag{kNull, off, end - off, f.parse});
    }
    frags.swap(next);
  }
  // Raw fragments that touch (text of neighbouring segments) are one text, as if the
  // segments had been tokenized as one string.
  next.clear();
  for (const Frag& f : frags) {
    if (f.token == kNull && !next.empty() && next.back().token == kNull && next.back().off + next.back().len == f.off) {
      next.back().len += f.len;
    } else {
      next.push_back(f);
    }
  }
  frags.swap(next);

  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  if (add_special && m.add_bos) out.push_back(m.bos);
  if (m.model == TokenizerModel::kSpm) {
    bool prev_special = true;  // prefix the first fragment with a space
    std::string buf;
    for (const Frag& f : frags) {
      if (f.token != kNull) {
        out.push_back(f.token);
        prev_special = true;
        continue;
      }
      buf.clear();
      if (m.add_space_prefix && prev_special) buf += "\xe2\x96\x81";
      for (char c : text.substr(f.off, f.len)) {
        if (c == ' ')
          buf += "\xe2\x96\x81";
        else
          buf.push_back(c);
      }
      m.encode_spm(buf, out);
      prev_special = false;
    }
  } else {
    for (const Frag& f : frags) {
      if (f.token != kNull) {
        out.push_back(f.token);
      } else {
        m.encode_bpe(text.substr(f.off, f.len), out);
      }
    }
  }
  if (add_special && m.add_eos) out.push_back(m.eos);
  return out;
}

std::string Tokenizer::token_to_piece(int32_t id, bool special) const {
  const Impl& m = *impl_;
  m.check_id(id);
  if (!special && is_special_type(m.types[id])) return {};
  return std::string(m.pieces[id]);
}

std::string Tokenizer::detokenize(std::span<const int32_t> ids, bool remove_special, bool unparse_special) const {
  const Impl& m = *impl_;
  for (int32_t id : ids) m.check_id(id);
  bool remove_space = m.add_space_prefix;
  if (remove_special && m.add_bos && !ids.empty() && ids.front() == m.bos) {
    remove_space = false;
    ids = ids.subspan(1);
  }
  if (remove_special && m.add_eos && !ids.empty() && ids.back() == m.eos) {
    ids = ids.subspan(0, ids.size() - 1);
  }
  std::string text;
  for (int32_t id : ids) {
    if (unparse_special || !is_special_type(m.types[id])) {
      std::string_view p = m.pieces[id];
      if (remove_space && !p.empty() && p.front() == ' ') p.remove_prefix(1);
      text.append(p);
    }
    remove_space = false;
  }
  if (!m.clean_spaces || text.empty()) return text;

  // llama.cpp's clean_spaces, three in-place passes over the bytes
  char* t = text.data();
  int64_t total = static_cast<int64_t>(text.size());
  {  // " ?", " !", " .", " ,"
    const int64_t total1 = total;
    total = 1;
    for (int64_t i = 1; i < total1; ++i) {
      const char x = t[i];
      if (t[i - 1] == ' ' && (x == '?' || x == '!' || x == '.' || x == ',')) --total;
      t[total++] = x;
    }
  }
  {  // " ' "
    const int64_t total2 = total;
    total = total2 ? 1 : 0;
    for (int64_t i = 1; i < total2; ++i) {
      const char x = t[i];
      if (x == '\'' && i + 1 < total2 && t[i - 1] == ' ' && t[i + 1] == ' ') {
        --total;
        t[++i] = '\0';
      }
      t[total++] = x;
    }
  }
  {  // " 's", " 'm", " 're", " 've"
    const int64_t total3 = total;
    total = total3 ? 1 : 0;
    for (int64_t i = 1; i < total3; ++i) {
      const char x = t[i];
      if (t[i - 1] == ' ' && x == '\'' && i + 1 < total3) {
        const char x1 = t[i + 1];
        if (x1 == 's' || x1 == 'm') {
          --total;
        } else if (x1 != 't' && x1 != 'd' && i + 2 < total3) {
          const char x2 = t[i + 2];
          if ((x1 == 'r' && x2 == 'e') || (x1 == 'v' && x2 == 'e')) --total;
        }
      }
      t[total++] = x;
    }
  }
  text.resize(static_cast<size_t>(total));
  return text;
}

std::string Tokenizer::detokenize_raw(std::span<const int32_t> ids, bool special) const {
  const Impl& m = *impl_;
  for (int32_t id : ids) m.check_id(id);
  std::string text;
  for (int32_t id : ids) {
    if (special || !is_special_type(m.types[id])) text += m.pieces[id];
  }
  return text;
}

int32_t Tokenizer::n_vocab() const noexcept {
  return static_cast<int32_t>(impl_->texts.size());
}
int32_t Tokenizer::bos() const noexcept {
  return impl_->bos;
}
int32_t Tokenizer::eos() const noexcept {
  return impl_->eos;
}
int32_t Tokenizer::eot() const noexcept {
  return impl_->eot;
}
int32_t Tokenizer::eom() const noexcept {
  return impl_->eom;
}
int32_t Tokenizer::unk() const noexcept {
  return impl_->unk;
}
int32_t Tokenizer::pad() const noexcept {
  return impl_->pad;
}
bool Tokenizer::is_eog(int32_t id) const noexcept {
  return id >= 0 && static_cast<size_t>(id) < impl_->eog_flag.size() && impl_->eog_flag[id];
}
const std::vector<int32_t>& Tokenizer::eog_ids() const noexcept {
  return impl_->eog;
}
TokenType Tokenizer::token_type(int32_t id) const noexcept {
  if (id < 0 || static_cast<size_t>(id) >= impl_->types.size()) return TokenType::kUndefined;
  return impl_->types[id];
}
bool Tokenizer::is_control(int32_t id) const noexcept {
  return token_type(id) == TokenType::kControl;
}
std::string_view Tokenizer::token_text(int32_t id) const {
  impl_->check_id(id);
  return impl_->texts[id];
}
int32_t Tokenizer::find_token(std::string_view text) const noexcept {
  return impl_->find(text);
}
bool Tokenizer::add_bos() const noexcept {
  return impl_->add_bos;
}
bool Tokenizer::add_eos() const noexcept {
  return impl_->add_eos;
}
bool Tokenizer::add_space_prefix() const noexcept {
  return impl_->add_space_prefix;
}
bool Tokenizer::clean_spaces() const noexcept {
  return impl_->clean_spaces;
}
TokenizerModel Tokenizer::model() const noexcept {
  return impl_->model;
}
PreTokenizer Tokenizer::pre() const noexcept {
  return impl_->pre;
}
const std::string& Tokenizer::pre_name() const noexcept {
  return impl_->pre_name;
}
const std::string& Tokenizer::chat_template() const noexcept {
  return impl_->chat_template;
}
uint64_t Tokenizer::identity_hash() const noexcept {
  return impl_->hash;
}

// ---------------------------------------------------------------------------------------
// UTF-8 sanitising and streaming

namespace {

enum class Utf8Status { kComplete, kIncomplete, kInvalid };

// Classify the sequence starting at s[i]: complete (len set), a valid prefix cut by the
// end of the buffer, or invalid (the lead byte cannot start a sequence here).
Utf8Status utf8_classify(std::string_view s, size_t i, size_t& len) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const uint8_t c = p[i];
  if (c < 0x80) {
    len = 1;
    return Utf8Status::kComplete;
  }
  uint8_t lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return Utf8Status::kInvalid;
  }
  for (size_t k = 1; k < len; ++k) {
    if (i + k >= s.size()) return Utf8Status::kIncomplete;
    const uint8_t b = p[i + k];
    const uint8_t l = (k == 1) ? lo : 0x80;
    const uint8_t h = (k == 1) ? hi : 0xBF;
    if (b < l || b > h) return Utf8Status::kInvalid;
  }
  return Utf8Status::kComplete;
}

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

// Emit the valid prefix of `buf`; returns the number of bytes consumed. With `final`,
// an incomplete tail is replaced too; otherwise it is left unconsumed.
size_t utf8_emit(std::string_view buf, bool final, std::string& out) {
  size_t i = 0;
  while (i < buf.size()) {
    size_t len = 0;
    const Utf8Status st = utf8_classify(buf, i, len);
    if (st == Utf8Status::kComplete) {
      out.append(buf.substr(i, len));
      i += len;
    } else if (st == Utf8Status::kIncomplete && !final) {
      break;
    } else {
      out.append(kReplacement);
      i += 1;
    }
  }
  return i;
}

}  // namespace

std::string utf8_sanitize(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  utf8_emit(bytes, true, out);
  return out;
}

StreamingDetokenizer::StreamingDetokenizer(const Tokenizer& tokenizer, bool special, bool strip_leading_space)
    : tok_(tokenizer), special_(special), strip_(strip_leading_space && tokenizer.add_space_prefix()) {}

std::string StreamingDetokenizer::push(int32_t id) {
  std::string piece = tok_.token_to_piece(id, special_);
  if (strip_) {
    if (!piece.empty() && piece.front() == ' ') piece.erase(0, 1);
    strip_ = false;
  }
  std::string out;
  if (pending_.empty()) {
    const size_t used = utf8_emit(piece, false, out);
    pending_.assign(piece, used, std::string::npos);
  } else {
    pending_ += piece;
    const size_t used = utf8_emit(pending_, false, out);
    pending_.erase(0, used);
  }
  return out;
}

std::string StreamingDetokenizer::finish() {
  std::string out;
  utf8_emit(pending_, true, out);
  pending_.clear();
  return out;
}

// ---------------------------------------------------------------------------------------
// GGUF

Tokenizer Tokenizer::from_gguf(const GgufFile& f) {
  TokenizerVocab v;
  auto wrap = [](const char* key, auto&& fn) {
    try {
      return fn();
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kTokenizer) throw;
      fail(std::string("bad metadata key ") + key + ": " + e.what());
    }
  };
  auto get_str = [&](const char* key) { return wrap(key, [&] { return f.get_string(key); }); };
  auto get_int = [&](const char* key) { return wrap(key, [&] { return f.get_int(key); }); };
  auto get_bool = [&](const char* key) { return wrap(key, [&] { return f.get_bool(key); }); };

  auto model = get_str("tokenizer.ggml.model");
  if (!model) fail("missing metadata key tokenizer.ggml.model");
  v.model = *model;
  if (auto p = get_str("tokenizer.ggml.pre")) v.pre = *p;

  auto tokens = wrap("tokenizer.ggml.tokens", [&] { return f.get_string_array("tokenizer.ggml.tokens"); });
  if (!tokens) fail("missing metadata key tokenizer.ggml.tokens");
  v.tokens.reserve(tokens->size());
  for (auto s : *tokens) v.tokens.emplace_back(s);
  if (auto s = wrap("tokenizer.ggml.scores", [&] { return f.get_float_array("tokenizer.ggml.scores"); }))
    v.scores = std::move(*s);
  if (auto t = wrap("tokenizer.ggml.token_type", [&] { return f.get_int_array("tokenizer.ggml.token_type"); })) {
    v.token_types.reserve(t->size());
    for (int64_t x : *t) {
      v.token_types.push_back((x >= INT32_MIN && x <= INT32_MAX) ? static_cast<int32_t>(x) : 0);
    }
  }
  if (v.model == "gpt2") {
    auto merges = wrap("tokenizer.ggml.merges", [&] { return f.get_string_array("tokenizer.ggml.merges"); });
    if (!merges) fail("missing metadata key tokenizer.ggml.merges (required for gpt2)");
    v.merges.reserve(merges->size());
    for (auto s : *merges) v.merges.emplace_back(s);
  }
  v.bos_id = get_int("tokenizer.ggml.bos_token_id");
  v.eos_id = get_int("tokenizer.ggml.eos_token_id");
  v.unk_id = get_int("tokenizer.ggml.unknown_token_id");
  v.pad_id = get_int("tokenizer.ggml.padding_token_id");
  v.eot_id = get_int("tokenizer.ggml.eot_token_id");
  v.eom_id = get_int("tokenizer.ggml.eom_token_id");
  v.add_bos = get_bool("tokenizer.ggml.add_bos_token");
  v.add_eos = get_bool("tokenizer.ggml.add_eos_token");
  v.add_space_prefix = get_bool("tokenizer.ggml.add_space_prefix");
  if (auto t = get_str("tokenizer.chat_template")) v.chat_template = *t;
  return Tokenizer(std::move(v));
}

}  // namespace tandem
