// Tokenizer: SentencePiece-style ("llama") and byte-level BPE ("gpt2") vocabularies read
// from GGUF metadata, with the semantics of llama.cpp's llama_tokenize /
// llama_token_to_piece / llama_detokenize (reference: llama.cpp ec98e2002 as vendored by
// ollama; the goldens under shared/golden/tokenizer*/ come from it).
//
// Thread-safety: a Tokenizer is immutable after construction; every const member
// function may be called from any number of threads at once. Copies share the immutable
// state (cheap). A StreamingDetokenizer is a small mutable object: one per stream, not
// shared between threads without external locking.
//
// Stack use: tokenizing is iterative everywhere (no recursion, no std::regex); stack use
// does not grow with the input length (field case B10). Time is O(n log n) in the input
// length for both vocabulary kinds.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/core/error.hpp"

namespace tandem {

class GgufFile;

/// Token types as stored in `tokenizer.ggml.token_type` (llama.cpp's llama_token_type).
enum class TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

/// `tokenizer.ggml.model`.
enum class TokenizerModel {
  kSpm,  ///< "llama": SentencePiece BPE with scores and <0xXX> byte fallback
  kBpe,  ///< "gpt2": byte-level BPE with ranked merges
};

/// Pre-tokenizer of a BPE vocabulary (`tokenizer.ggml.pre`), with the regexes of
/// llama.cpp (llama-vocab.cpp, base ec98e2002). Several names share one regex; the list
/// after each value is every name Tandem accepts for it. Any other name is refused with
/// Error(kTokenizer) naming it (llama.cpp would fall back to `default` with a warning,
/// which silently changes how numbers and punctuation are split; Tandem refuses instead).
enum class PreTokenizer {
  kNone,         ///< SPM vocabularies: no pre-tokenizer
  kDefault,      ///< absent / "default": llama.cpp's default chain of four regexes
  kGpt2,         ///< "gpt-2", "phi-2", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "gigachat",
                 ///< "a.x-4.0", "mellum", "exaone4", "mpt", "olmo", "jais", "trillion",
                 ///< "granite-docling": the original GPT-2 regex
  kLlama3,       ///< "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                 ///< "midm-2.0", "lfm2" (whole-word lookup first, BOS added), "dbrx", "smaug-bpe"
  kQwen2,        ///< "qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "hunyuan", "grok-2",
                 ///< "megrez": the Llama 3 regex with single digits
  kSmollm,       ///< "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                 ///< "minerva-7b": every digit alone (\p{N}), then the GPT-2 regex
  kTekken,       ///< "tekken" (Mistral Nemo): case-split words, single digits; BOS added,
                 ///< whole-word lookup first
  kDeepseekLlm,  ///< "deepseek-llm": newlines, cased-letter runs, punctuation runs,
                 ///< trailing whitespace, CJK runs, number runs (six regexes in a chain)
};

/// The tokenizer part of GGUF metadata, as plain data. Build one by hand for tests or
/// get it from a GGUF file with Tokenizer::from_gguf. Optional fields left empty take
/// llama.cpp's defaults.
struct TokenizerVocab {
  std::string model;                 ///< "llama" or "gpt2" (required)
  std::string pre;                   ///< tokenizer.ggml.pre; "" = absent
  std::vector<std::string> tokens;   ///< required, non-empty
  std::vector<float> scores;         ///< empty (all 0) or one per token
  std::vector<int32_t> token_types;  ///< empty (all normal) or one per token
  std::vector<std::string> merges;   ///< "left right" lines in rank order (gpt2 only)
  std::optional<int64_t> bos_id, eos_id, unk_id, pad_id, eot_id, eom_id;
  std::optional<bool> add_bos, add_eos, add_space_prefix;
  std::string chat_template;  ///< tokenizer.chat_template; "" = absent
};

class Tokenizer {
 public:
  /// Validate and index a vocabulary. Throws Error(kTokenizer) when the model is not
  /// "llama"/"gpt2", the vocabulary is empty, scores/token_types have the wrong length,
  /// a token text appears twice, a special id given explicitly is >= n_vocab, a gpt2
  /// vocabulary has no merges array, or the pre-tokenizer is one Tandem does not
  /// implement. Negative special ids count as absent. Empty token texts are renamed
  /// "[EMPTY_<id>]" as llama.cpp does. Merges whose parts are not tokens are kept (as
  /// llama.cpp: they can still join symbols; a symbol that is not a token then falls back
  /// to its single bytes); malformed merge lines (no space) are ignored; for a repeated
  /// merge line the first rank counts.
  explicit Tokenizer(TokenizerVocab vocab);

  /// Read `tokenizer.ggml.*` and `tokenizer.chat_template` from a parsed GGUF file.
  /// Missing/ill-typed keys throw Error(kTokenizer) naming the key.
  static Tokenizer from_gguf(const GgufFile& file);

  /// llama_tokenize(text, add_special, parse_special):
  ///  - add_special: BOS first if add_bos(), EOS last if add_eos() (BOS is added even when
  ///    the text already starts with the BOS text and parse_special is on: double BOS).
  ///  - parse_special: control and unknown-type token texts in `text` become that token
  ///    (exact, case-sensitive match, longest token text first). User-defined tokens are
  ///    matched always, as llama.cpp does.
  ///  - SPM: a space is prefixed to the first text fragment and to every fragment that
  ///    follows a special token when add_space_prefix (default true); ' ' -> U+2581;
  ///    bigram merges by score (highest first, ties leftmost); pieces not in the
  ///    vocabulary fall back to <0xXX> byte tokens.
  ///  - BPE: invalid UTF-8 is replaced by U+FFFD per bad byte (llama.cpp); pre-tokenize,
  ///    byte-level map, merge by rank (lowest first, ties leftmost); for the llama3
  ///    names (not dbrx, smaug-bpe) and tekken a pre-token that is itself a token is
  ///    taken whole (llama.cpp's ignore_merges).
  std::vector<int32_t> tokenize(std::string_view text, bool add_special, bool parse_special) const;

  /// One piece of a text to tokenize (see the segment overload of tokenize()).
  struct TextSegment {
    std::string_view text;
    bool parse_special;  ///< control/unknown token texts inside this piece become tokens
  };
  /// Tokenize the concatenation of `segments` as one text (so SPM space prefixes, BPE
  /// pre-tokens and merges see it whole), but look for control-token texts only inside
  /// segments with parse_special and never across a segment boundary. This is how a chat
  /// template's markers become control tokens while message text never does. Equal to
  /// tokenize(text, add_special, p) for a single segment {text, p}.
  std::vector<int32_t> tokenize(std::span<const TextSegment> segments, bool add_special) const;

  /// Raw bytes of one token (llama_token_to_piece with lstrip 0): SPM U+2581 -> ' ',
  /// <0xXX> byte tokens -> that byte; BPE byte-level unmapping. Control and unknown-type
  /// tokens give "" unless `special` (then their text); user-defined tokens always give
  /// their text; unused/undefined-type tokens give "". Throws Error(kInvalidArgument) for
  /// an id outside [0, n_vocab).
  std::string token_to_piece(int32_t id, bool special) const;

  /// llama_detokenize(ids, remove_special, unparse_special), exactly:
  ///  1. if remove_special and add_bos() and ids[0] == bos(): drop it;
  ///     if remove_special and add_eos() and the last id == eos(): drop it.
  ///  2. join token_to_piece(id, unparse_special); with add_space_prefix (SPM default)
  ///     one leading ' ' of the first piece is removed -- but not when a BOS was dropped
  ///     in step 1 (llama.cpp quirk; so "<s> Hello" -> " Hello" with remove_special).
  ///  3. clean_spaces (BPE vocabularies except the qwen2 group; never SPM): remove the
  ///     space in " ?", " !", " .", " ,"; remove both spaces of " ' "; remove the space in
  ///     " 's", " 'm", " 're", " 've" (not " 't", " 'd", " 'll"). Byte-level, in this order.
  /// The result is raw bytes and may be invalid UTF-8 (e.g. half an emoji).
  std::string detokenize(std::span<const int32_t> ids, bool remove_special, bool unparse_special) const;

  /// Plain concatenation of token_to_piece(id, special) for every id: no BOS/EOS removal,
  /// no leading-space removal, no clean-up. For valid ids from tokenize(text, false, false)
  /// of a BPE vocabulary this equals the text (after U+FFFD replacement of invalid UTF-8).
  std::string detokenize_raw(std::span<const int32_t> ids, bool special) const;

  int32_t n_vocab() const noexcept;
  int32_t bos() const noexcept;  ///< -1 if none
  int32_t eos() const noexcept;  ///< -1 if none
  int32_t eot() const noexcept;  ///< tokenizer.ggml.eot_token_id or detected by text; -1 if none
  int32_t eom() const noexcept;
  int32_t unk() const noexcept;
  int32_t pad() const noexcept;
  /// End-of-generation: eos, eot, eom and every token whose text is a known end marker
  /// ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
  /// "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", ...), as llama.cpp.
  bool is_eog(int32_t id) const noexcept;
  const std::vector<int32_t>& eog_ids() const noexcept;  ///< sorted
  bool is_control(int32_t id) const noexcept;
  TokenType token_type(int32_t id) const noexcept;  ///< kUndefined for bad ids
  /// Token text as stored in the vocabulary (no unmapping); throws kInvalidArgument.
  std::string_view token_text(int32_t id) const;
  /// Id of an exact token text, or -1.
  int32_t find_token(std::string_view text) const noexcept;
  bool add_bos() const noexcept;
  bool add_eos() const noexcept;
  bool add_space_prefix() const noexcept;
  bool clean_spaces() const noexcept;
  TokenizerModel model() const noexcept;
  PreTokenizer pre() const noexcept;
  const std::string& pre_name() const noexcept;       ///< tokenizer.ggml.pre as given
  const std::string& chat_template() const noexcept;  ///< "" if absent

  /// xxHash3-64 of everything that decides tokenization and decoding: model, pre name,
  /// tokens, scores, token types, merges, special ids, add_bos/add_eos/add_space_prefix
  /// and the chat template (each field length-prefixed). Same vocabulary -> same hash.
  uint64_t identity_hash() const noexcept;

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

/// Incremental detokenizer for streaming generated text. push() returns only complete,
/// valid UTF-8: bytes of a multi-byte character that is not complete yet are held back
/// until it completes. Bytes that can no longer form a valid character (an invalid byte,
/// or a started sequence interrupted by a byte that cannot continue it) are emitted as
/// U+FFFD, one per byte. finish() flushes a trailing incomplete sequence the same way
/// (one U+FFFD per held byte, SentencePiece/HF behaviour). The concatenation of all
/// returned chunks equals utf8_sanitize(detokenize(ids, /*remove_special=*/false, special))
/// for vocabularies without clean_spaces (SPM, qwen2); clean_spaces is never applied here.
class StreamingDetokenizer {
 public:
  /// `special`: write control tokens' text (unparse_special). `strip_leading_space`: when
  /// the vocabulary has add_space_prefix (SPM), remove one leading ' ' from the piece of
  /// the first pushed token, as detokenize does; pass false when the stream continues
  /// text that already started (e.g. generation after a prompt).
  explicit StreamingDetokenizer(const Tokenizer& tokenizer, bool special = false, bool strip_leading_space = true);
  /// Append one token; returns the newly completed text (possibly empty). Throws
  /// Error(kInvalidArgument) for a bad id (the stream is unchanged).
  std::string push(int32_t id);
  /// Flush held-back bytes (one U+FFFD each). The object may keep streaming afterwards;
  /// the first-token space strip is not re-armed.
  std::string finish();
  /// Number of bytes currently held back (0..3).
  size_t pending_bytes() const noexcept { return pending_.size(); }

 private:
  Tokenizer tok_;
  bool special_;
  bool strip_;
  std::string pending_;
};

/// Replace every byte that is not part of a well-formed UTF-8 sequence (RFC 3629: no
/// overlongs, no surrogates, <= U+10FFFF) by U+FFFD, one per byte.
std::string utf8_sanitize(std::string_view bytes);

}  // namespace tandem
