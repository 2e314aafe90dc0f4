// tandem-server: OpenAI request bodies -> Scheduler requests, results -> OpenAI response
// bodies (chat.completion, chat.completion.chunk, text_completion), and the error object.
//
// Shapes follow the OpenAI API reference field for field; extensions are named as
// llama-server names them (top_k, min_p, repeat_penalty, ignore_eos) plus Tandem's `sla` and
// `timeout`. Every bad field raises ApiError naming it in `param`.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/grammar/grammar.hpp"
#include "tandem/sched/routing_policy.hpp"
#include "tandem/sched/scheduler.hpp"
#include "tandem/session/sampler.hpp"
#include "tandem/template/chat_template.hpp"
#include "tandem/template/tool_calls.hpp"
#include "tandem/tokenizer/tokenizer.hpp"

namespace tandem::server {

/// An error answered with the OpenAI error object and an HTTP status.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string message, std::string param = {}, std::string code = {});
  int status() const noexcept { return status_; }
  const std::string& param() const noexcept { return param_; }
  const std::string& code() const noexcept { return code_; }
  /// The OpenAI error type for the status ("invalid_request_error", ...).
  std::string_view type() const noexcept;
  /// {"error": {"message", "type", "param", "code"}} (param/code null when empty).
  nlohmann::json body() const;

 private:
  int status_;
  std::string message_;
  std::string param_;
  std::string code_;
};

/// Bounds on the grammars a client sends (`response_format.json_schema.schema`, `json_schema`,
/// `grammar`, and the tools' `parameters`, which a forced call compiles): xgrammar compiles
/// them on the request's thread in time that grows with their size and nesting, without a
/// limit of its own (grammar.hpp). Beyond a bound: 400, code "grammar_too_large" or
/// "grammar_too_deep", the message naming the limit. Measured on SmolLM2's 49152-token
/// vocabulary (a loaded 2-core machine): an object of 500 optional integer properties (14 KB)
/// compiles in 0.4 s, of 1000 (28 KB) in 2 to 4 s; required properties and GBNF alternatives
/// cost far less.
inline constexpr size_t kMaxGrammarBytes = 16 * 1024;  ///< a schema as compact JSON, or GBNF text
/// A schema's JSON nesting (objects and arrays: a property's schema is two levels below its
/// parent's), or GBNF's parenthesis nesting.
inline constexpr int32_t kMaxGrammarDepth = 32;
/// A schema's properties, all its objects together: optional properties cost xgrammar far
/// more than their bytes (800 untyped optional ones, 7 KB, compiled in 3.4 s, 1600 in 28 s;
/// 256 in 0.2 s). Beyond: 400 "grammar_too_large".
inline constexpr size_t kMaxSchemaProperties = 256;

/// What the server knows when it maps a request (read-only, shared by all handlers).
struct ModelInfo {
  const Tokenizer* tokenizer = nullptr;
  const ChatTemplate* chat_template = nullptr;
  int32_t n_ctx = 0;               ///< positions per sequence
  ToolPrompt tool_prompt;          ///< the template's tool-call format (tool_prompt_for_template)
  std::vector<std::string> names;  ///< accepted `model` values (alias first)
  /// How long a request's grammar may take to compile, its turn at the compiler included
  /// (--grammar-deadline; tandem/grammar/grammar.hpp): past it 400 grammar_too_complex, no
  /// turn within it 503 (another client's grammar is compiling).
  std::chrono::milliseconds grammar_deadline{10000};
};

/// One generation request after validation.
struct GenerationSpec {
  bool chat = false;
  bool stream = false;
  bool include_usage = false;  ///< stream_options.include_usage
  std::string model;           ///< the name answered back (the alias)
  std::vector<int32_t> prompt_ids;
  SamplingParams sampling;
  int32_t max_tokens = 0;
  std::vector<std::string> stop;
  bool ignore_eos = false;  ///< llama-server's extension: generate past end-of-generation
  SlaClass sla = SlaClass::kStandard;
  std::optional<double> timeout_s;
  /// -1: no logprobs; 0 .. kMaxTopLogprobs: each token's log-probability and this many
  /// alternatives (chat: `logprobs: true` + `top_logprobs`; completions: `logprobs: N`).
  int32_t logprobs = -1;
  int32_t n = 1;  ///< choices (`n`, 1..Scheduler::kMaxChoices): choice i samples with seed + i
  /// Chat with `tools` (tool_choice not "none"): the output is parsed for tool calls.
  struct Tools {
    ToolCallFormat format = ToolCallFormat::kHermes;
    std::string prefix;    ///< a forced call's opening (forced_call_prefix), already in the prompt
    bool parallel = true;  ///< parallel_tool_calls: false keeps the first call only
  };
  std::optional<Tools> tools;
  /// Structured output: response_format json_object / json_schema, or llama-server's
  /// `json_schema` / `grammar` fields; null = unconstrained. A schema or grammar that does
  /// not compile is ApiError 400 with the engine's reason.
  std::shared_ptr<const Grammar> grammar;
};

/// One finished choice: its text (a forced call's prefix included), finish, logprobs (or
/// null) and the tool calls parsed from the text (`content` the rest).
struct ChoiceResult {
  std::string text;
  RequestFinish finish = RequestFinish::kLength;
  nlohmann::json logprobs;
  std::optional<ParsedToolCalls> parsed;  ///< set when GenerationSpec::tools
};

/// A request body's JSON nesting at most (objects and arrays; deeper is 400): what reads it
/// after parsing may recurse.
inline constexpr int32_t kMaxBodyDepth = 128;
/// Parse a body as JSON (ApiError 400 for malformed JSON, a non-object, or nesting deeper
/// than kMaxBodyDepth).
nlohmann::json parse_body(std::string_view body);
/// ApiError 400 when `body` nests deeper than kMaxBodyDepth (json or ordered_json).
template <class Json>
void check_body_depth(const Json& body);
/// Check `model` (absent is accepted, an unknown name -> ApiError 404).
void check_model(const nlohmann::json& body, const ModelInfo& info);

/// POST /v1/chat/completions. `sla_header`: the x-tandem-sla header ("" = absent). `raw`:
/// the body's text, whose key order the template sees when it renders `tools` and tool
/// calls (as transformers renders the client's dicts); "" = `body`'s order.
///
/// Tools: `tools` (function tools, checked as OpenAI checks them: a name of 1 to 64 of
/// a-z A-Z 0-9 _ -, `parameters` a JSON schema object of type "object" within
/// kMaxGrammarBytes / kMaxGrammarDepth; else 400 naming tools[i]), `tool_choice` ("none":
/// tools neither rendered nor parsed, as vLLM; "auto", the default with tools; "required" or
/// {"type": "function", "function": {"name"}}: decoded under forced_tool_call_schema's
/// grammar after the opening of a call; without xgrammar only prompted, forced_call_prefix),
/// `parallel_tool_calls` (false: the first call only). The model's own template renders the
/// tools and earlier tool_calls / tool messages when it knows them (ModelInfo::tool_prompt),
/// else hermes_tool_messages() rewrites the conversation for it.
GenerationSpec parse_chat_request(const nlohmann::json& body, const ModelInfo& info, std::string_view sla_header,
                                  std::string_view raw = {});
/// POST /v1/completions: `prompt` a string (special tokens parsed), token ids, or a
/// one-element list of either; a batch of several prompts is refused (400).
GenerationSpec parse_completion_request(const nlohmann::json& body, const ModelInfo& info, std::string_view sla_header);

/// OpenAI's values: "stop" (end-of-generation or stop string), "length" (max_tokens, or the
/// request's `timeout`: the choice then carries "tandem_timeout": true); "abort" otherwise
/// (never answered: a cancelled request gets an error object).
std::string_view finish_reason_name(RequestFinish f) noexcept;
/// The output was cut short: max_tokens (or the context) or the request's `timeout`.
bool cut_short(RequestFinish f) noexcept;

/// A choice's `logprobs` for generated tokens, in OpenAI's shape. Chat: {"content": [{"token",
/// "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": null}.
/// Completions (the legacy shape): {"tokens", "token_logprobs", "top_logprobs": [{token:
/// logprob}], "text_offset"}. A token's string is its own bytes (Tokenizer::token_to_piece,
/// the pieces the text is made of; invalid UTF-8 shown as U+FFFD), `bytes` those bytes
/// exactly. A log-probability that is not finite (a -inf logit) is given as -9999.0, as
/// OpenAI does. `text_offset`: code points of the completion text before `entries[0]`
/// (vLLM's text_offset, 0 at the completion's start); advanced past the entries' pieces.
nlohmann::json logprobs_json(const GenerationSpec& spec, const Tokenizer& tok, std::span<const TokenLogprob> entries,
                             size_t& text_offset);

/// The non-streaming response (chat.completion or text_completion), one choice per entry
/// (`index` = position). A chat choice with tool calls: message.content the text outside the
/// calls (null when none), message.tool_calls (tool_calls_json), finish_reason "tool_calls".
/// A tool choice cut short (cut_short: max_tokens or `timeout`) has finish_reason "length" as
/// OpenAI's: the calls it completed are still tool_calls, a call it was inside is dropped
/// (neither a call, since its arguments would not parse, nor content; ChoiceResult::parsed),
/// and content is null when nothing else remains. Streamed the same (sse_stream.hpp).
/// `usage`: the prompt counted once, the completion tokens of all choices together.
nlohmann::json completion_body(const GenerationSpec& spec, const std::string& id, int64_t created,
                               std::span<const ChoiceResult> choices, int32_t prompt_tokens, int32_t completion_tokens);
/// One streaming chunk of choice `index`: `text` (delta content), `role_only` (the chat's
/// opening chunk with the assistant role), `finish` (the last choice chunk; text may be
/// empty), `logprobs` the entries of the tokens this chunk accounts for (see sse_stream.hpp)
/// or null, `tool_calls` a delta's tool_calls array or null, `tools_called` (with `finish`):
/// finish_reason "tool_calls".
nlohmann::json stream_chunk(const GenerationSpec& spec, const std::string& id, int64_t created, int32_t index,
                            std::string_view text, bool role_only, std::optional<RequestFinish> finish,
                            nlohmann::json logprobs = nullptr, nlohmann::json tool_calls = nullptr,
                            bool tools_called = false);
/// OpenAI's tool_calls array: {"id": "call_" + 24 random alphanumerics, "type": "function",
/// "function": {"name", "arguments"}}; `with_index` adds each call's "index" (stream deltas).
nlohmann::json tool_calls_json(std::span<const ToolCall> calls, bool with_index);
/// The usage-only chunk sent last when stream_options.include_usage (choices empty).
nlohmann::json usage_chunk(const GenerationSpec& spec, const std::string& id, int64_t created, int32_t prompt_tokens,
                           int32_t completion_tokens);

/// POST /tokenize {"content", "add_special", "parse_special", "with_pieces"} -> {"tokens"}.
nlohmann::json tokenize_response(const nlohmann::json& body, const Tokenizer& tokenizer);
/// POST /detokenize {"tokens"} -> {"content"}.
nlohmann::json detokenize_response(const nlohmann::json& body, const Tokenizer& tokenizer);

}  // namespace tandem::server
