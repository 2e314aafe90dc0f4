// Structured outputs: grammars that constrain generation (JSON schema, any JSON object, GBNF)
// by masking the tokens they do not allow at each step, with xgrammar's C++ core
// (Apache-2.0, https://github.com/mlc-ai/xgrammar; built from its PyPI sdist by
// cmake/TandemXgrammar.cmake).
//
// A Grammar is compiled once for a tokenizer's vocabulary: xgrammar sees every token as the
// bytes Tokenizer::token_to_piece(id, /*special=*/false) gives (the bytes Tandem's generated
// text is made of, for SentencePiece and byte-level BPE vocabularies alike); tokens with no
// text (control, unused) are never allowed, and the end-of-generation tokens
// (Tokenizer::eog_ids) only where the grammar is complete. Compiled grammars are cached per
// vocabulary keyed by their source text (and kind), so building the same schema again is a
// lookup, served at once (no turn, no deadline) even while another grammar compiles; the
// cache holds at most 256 MiB per vocabulary (least recently used dropped).
//
// Compile time grows with the grammar and the vocabulary and has no limit: milliseconds for
// ordinary schemas (19 ms for a five-property one on SmolLM2's vocabulary, benchmarks/
// README.md), seconds for schemas with hundreds of nested levels or thousands of
// alternatives, minutes for some small GBNF grammars (1080 optional three-way alternatives,
// 16 KB: over 6 minutes). Grammars of one vocabulary compile one at a time. Callers that
// take grammars from untrusted clients should bound their size (tandem-server:
// kMaxGrammarBytes and kMaxGrammarDepth in examples/server/openai_json.hpp) and pass a
// compile deadline: the factory then waits at most that long, for its turn and its compile
// together. Past it, it throws Error(kInvalidArgument) ("takes longer than the compile
// deadline") and the compile finishes on a thread of its own (xgrammar cannot be stopped),
// keeping the vocabulary's turn meanwhile and caching its result; a factory that does not
// get its turn within its deadline throws Error(kOutOfMemory) ("stayed busy"), which a
// server answers as overloaded. Without a deadline (zero, the default) the factory compiles
// on the calling thread and waits for its turn as long as it takes.
//
// Every factory refuses (Error(kInvalidArgument)) a grammar that allows no token of the
// vocabulary at its start: one with no sentence at all (`root ::= root`), or whose first
// characters are no token's text; a generation under it could not take a single step.
//
// Attach one to a generation with GenerateOptions::grammar (Session) or Request::grammar
// (Scheduler); null means unconstrained, with output unchanged bit for bit.
//
// Thread-safety: a Grammar is immutable; the factories may be called from any thread.
// A GrammarMatcher is one generation's state: one thread at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/tokenizer/tokenizer.hpp"

namespace tandem {

class Grammar {
 public:
  /// False when this build has no grammar engine (xgrammar could not be fetched at
  /// configure time): every factory then throws Error(kInvalidArgument) saying so.
  static bool available() noexcept;

  /// A JSON schema (the text of a JSON object, as OpenAI's response_format.json_schema.schema).
  /// Output is compact JSON (", " and ": " separators, no other whitespace) and strict:
  /// properties and array items the schema does not name are never generated (OpenAI's
  /// strict mode; the output still validates against the schema as written). Which keywords
  /// are enforced is xgrammar's (type, properties, required, additionalProperties, items,
  /// prefixItems, minItems/maxItems, enum, const, anyOf/oneOf, $ref/$defs, pattern, format,
  /// minLength/maxLength, minimum/maximum/exclusive bounds on integers and numbers).
  /// Throws Error(kInvalidArgument) with xgrammar's reason when the text is not JSON or the
  /// schema cannot be compiled (e.g. an unknown type, a bad $ref, an invalid pattern), and,
  /// naming the keyword and its place, for constraints xgrammar would silently drop: `not`,
  /// `if`/`then`/`else`, `dependentRequired`/`dependentSchemas`/`dependencies`,
  /// `contains`/`minContains`/`maxContains`, `uniqueItems: true`, `multipleOf` other than alone
  /// on an integer, `minLength`/`maxLength` beside `format`, `allOf` of several schemas, and a
  /// `required` name that `properties` does not define.
  static std::shared_ptr<const Grammar> from_json_schema(const Tokenizer& tokenizer, std::string_view schema,
                                                         std::chrono::milliseconds deadline = {});
  /// Any JSON object, with any members (response_format {"type": "json_object"}); compact.
  static std::shared_ptr<const Grammar> json_object(const Tokenizer& tokenizer,
                                                    std::chrono::milliseconds deadline = {});
  /// A GBNF grammar (llama.cpp's grammar format, as llama-server's `grammar` field; start
  /// rule `root`). Left recursion (`root ::= root "a" | "b"`) is parsed as written (xgrammar
  /// is an Earley parser; llama.cpp's engine refuses it). Throws Error(kInvalidArgument)
  /// with the parser's reason when it does not parse (undefined rule, no `root`, bad syntax).
  static std::shared_ptr<const Grammar> from_gbnf(const Tokenizer& tokenizer, std::string_view gbnf,
                                                  std::chrono::milliseconds deadline = {});

  /// Tokenizer::identity_hash() of the vocabulary it was compiled for; a generation with
  /// another vocabulary refuses it (Error(kInvalidArgument)).
  uint64_t vocab_hash() const noexcept;
  /// Tokens the mask covers (the tokenizer's n_vocab); logits past it are never allowed.
  int32_t n_vocab() const noexcept;

  struct Impl;
  explicit Grammar(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  const Impl& impl() const noexcept { return *impl_; }

 private:
  std::shared_ptr<const Impl> impl_;
};

/// One generation's position in a grammar.
class GrammarMatcher {
 public:
  /// Throws Error(kInvalidArgument) for a null grammar.
  explicit GrammarMatcher(std::shared_ptr<const Grammar> grammar);
  ~GrammarMatcher();
  GrammarMatcher(GrammarMatcher&&) noexcept;
  GrammarMatcher& operator=(GrammarMatcher&&) noexcept;

  /// The tokens allowed next: bit (id % 32) of word id / 32 set = token id allowed;
  /// ceil(n_vocab / 32) words (Grammar::n_vocab). The span views a buffer of this matcher,
  /// valid until the next call. The buffer is allocated once; xgrammar's own traversal may
  /// allocate. After the grammar terminated (an end-of-generation token accepted) no token
  /// is allowed.
  std::span<const uint32_t> fill_mask();
  /// Advance by `token`. False when the grammar does not allow it (state unchanged). An
  /// end-of-generation token is allowed where the grammar is complete and terminates it.
  bool accept(int32_t token);
  /// The text so far is a complete sentence of the grammar (an end-of-generation token is
  /// allowed now).
  bool is_completed() const;
  /// An end-of-generation token has been accepted.
  bool is_terminated() const;
  /// Back to the start.
  void reset();

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace tandem
