// Chat templates: render a conversation (system / user / assistant messages, tools) the way
// the model was trained to see it, and tokenize the result safely.
//
// The model's own template, executed: for_model() parses the GGUF key
// `tokenizer.chat_template` with Tandem's Jinja interpreter (tandem/jinja.hpp) and renders
// it as Hugging Face transformers does (jinja2's sandbox, trim_blocks, lstrip_blocks; the
// context: messages, tools, documents, add_generation_prompt, bos_token, eos_token), so
// prompts are byte-identical to transformers', vLLM's and llama.cpp --jinja's (e.g.
// SmolLM2's template adds its default system message when the conversation has none).
// is_jinja() says so. from_jinja() does the same for a template given as text.
//
// The built-in matcher is the fallback: when the model has no template or its template
// does not parse (fallback_reason() says why), the family is detected from the source the
// way llama.cpp's built-in matcher does (llama-chat.cpp: substring tests on the Jinja
// source; a source that is exactly a family name selects it): ChatML, Llama 3, Llama 2
// `[INST] <<SYS>>`, Mistral `[INST]`, Phi-3, Gemma, Zephyr, DeepSeek V3/R1. A model without
// a template, or with one no rule matches, gets ChatML (as llama.cpp's server does), with
// matched() false. detect() and by_name() always give the matcher.
//
// The matcher renders the published templates of those families, with llama.cpp's choices
// where a built-in renderer must choose: no default system message is invented, a system
// message for a family without a system role (Gemma, Mistral, Llama 2) opens the first user
// turn, and the text never starts with BOS: tokenize() adds BOS when the vocabulary asks
// for it (add_bos), as llama.cpp's tokenizer does. Per family (S system, U user, A assistant):
//   chatml   <|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n
//   llama3   <|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>...   (contents trimmed)
//   llama2   [INST] <<SYS>>\nS\n<</SYS>>\n\nU [/INST] A </s><s>[INST] U2 [/INST]  (trimmed)
//   mistral  [INST] S\n\nU[/INST] A</s>[INST] U2[/INST]
//   phi3     <|system|>\nS<|end|>\n<|user|>\nU<|end|>\n<|assistant|>\n
//   gemma    <start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\n  (trimmed)
//   zephyr   <|system|>\nS</s>\n<|user|>\nU</s>\n<|assistant|>\n
//   deepseek S<｜User｜>U<｜Assistant｜>A<｜end▁of▁sentence｜><｜User｜>U2<｜Assistant｜>
// Llama 2 and Mistral end a user turn with [/INST], which already is the generation
// prompt, so add_assistant adds nothing there. A Jinja template's text is whatever the
// template writes (it may start with the BOS text; tokenize() then adds no second BOS).
//
// Safety rule: tokenize() turns only the template's own markers into control tokens; the
// text of every message is tokenized with special-token parsing off, so a user who types
// "<|im_end|>" or "</s>" cannot end a turn or forge another role. With a Jinja template, a
// message whose text contains control-token text is located in the rendering by rendering
// again with that text marked; a template that transforms such text beyond trimming (so it
// cannot be located) makes tokenize() refuse with kInvalidArgument rather than risk it.
//
// A user's template in place of the model's (llama.cpp's --chat-template NAME_OR_JINJA and
// --chat-template-file FILE): a ChatTemplateOverride, made from a built-in family name or
// Jinja source and parsed when made, which for_tokenizer()/for_model() use instead of the
// GGUF's tokenizer.chat_template. Those two are the one place that decides which template
// a model gets; source() is the text the decision took (tool_prompt_for_template reads it).
//
// Errors: a Jinja template's runtime errors (its raise_exception, type errors, limits) are
// tandem::Error with the interpreter's codes (kInvalidArgument, kOutOfMemory for a limit).
// Thread-safety: a ChatTemplate is immutable after construction; all methods are const
// and may be called from any thread; copies share the parsed template.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tandem {

class Model;
class Tokenizer;

/// One message of a conversation. `role` is "system", "user" or "assistant" for the
/// matcher (other roles are refused with ErrorCode::kInvalidArgument by render/tokenize);
/// a Jinja template gets any role and decides (e.g. "tool").
struct ChatMessage {
  std::string role;
  std::string content;
};

enum class ChatTemplateFamily {
  kChatML,    ///< <|im_start|>role\n ... <|im_end|>\n (SmolLM2, Qwen2/2.5)
  kLlama3,    ///< <|start_header_id|>role<|end_header_id|>\n\n ... <|eot_id|>
  kLlama2,    ///< [INST] ... [/INST] with <<SYS>> (Llama 2 chat)
  kMistral,   ///< [INST] ... [/INST] without <<SYS>> (Mistral v1/v3 instruct)
  kPhi3,      ///< <|user|>\n ... <|end|>\n
  kGemma,     ///< <start_of_turn>user\n ... <end_of_turn>\n
  kZephyr,    ///< <|user|>\n ... </s>\n
  kDeepSeek,  ///< DeepSeek V3 / R1 "<｜User｜> ... <｜Assistant｜>"
};

namespace jinja {
class Template;
}

/// A chat template a user gives in place of the model's: `text` exactly a built-in family
/// name ("chatml", "llama3", ..., as by_name) selects that family's built-in renderer; any
/// other text is Jinja source, parsed here (an override that does not parse is an error,
/// not a fallback). Immutable and usable from any thread; copies share the parsed template.
class ChatTemplateOverride {
 public:
  /// `origin` names the text in errors and in ChatTemplate::origin() (e.g. "--chat-template").
  /// Throws Error(kInvalidArgument) "ORIGIN: jinja: line N: ..." when the Jinja source does
  /// not parse, "ORIGIN: the chat template is empty" for empty text, and names the built-in
  /// templates when the text is neither one of their names nor Jinja (no "{{" or "{%").
  static ChatTemplateOverride from_text(std::string text, std::string origin);
  /// The whole file at `path` as from_text, origin "chat template file 'PATH'". Throws
  /// Error(kIo) naming the file when it is missing, a directory, not a regular file (a FIFO
  /// would block), unreadable, or larger than
  /// jinja::Template::kMaxSourceBytes (1 MiB); parse errors as from_text.
  static ChatTemplateOverride from_file(const std::string& path);

  const std::string& text() const noexcept { return *text_; }
  const std::string& origin() const noexcept { return origin_; }

 private:
  friend class ChatTemplate;
  ChatTemplateOverride() = default;
  std::shared_ptr<const std::string> text_;
  std::string origin_;
  std::shared_ptr<const jinja::Template> jinja_;  ///< null for a built-in family name
};

class ChatTemplate {
 public:
  /// The template `model` gets: `override` when given (see ChatTemplateOverride), else the
  /// GGUF's `tokenizer.chat_template` executed by the Jinja interpreter; when the model has
  /// none or it does not parse, the matcher's family for it (a gemma3 model without one: the
  /// built-in gemma; fallback_reason() says why).
  /// bos_token/eos_token are the vocabulary's texts. Throws only what the override threw.
  static ChatTemplate for_model(const Model& model, const ChatTemplateOverride* override = nullptr);
  /// The same from a vocabulary alone (Tokenizer::chat_template(), its BOS/EOS texts):
  /// what a tool that renders prompts needs without loading the weights.
  static ChatTemplate for_tokenizer(const Tokenizer& tokenizer, const ChatTemplateOverride* override = nullptr);
  /// A Jinja template given as text. Throws tandem::Error(kInvalidArgument) "jinja: line
  /// N: ..." when it does not parse. name()/matched() are the matcher's view of `source`.
  static ChatTemplate from_jinja(std::string_view source, std::string bos_token, std::string eos_token);
  /// Detect the family from a Jinja template source (or a family name); empty or
  /// unmatched -> ChatML with matched() false.
  static ChatTemplate detect(std::string_view jinja_source);
  /// By name: "chatml", "llama3", "llama2", "mistral", "phi3", "gemma", "zephyr",
  /// "deepseek". Throws tandem::Error(kInvalidArgument) naming an unknown name.
  static ChatTemplate by_name(std::string_view name);

  ChatTemplateFamily family() const noexcept { return family_; }
  std::string_view name() const noexcept;
  /// True when the family was matched from the template source (or named), false for the
  /// fallback.
  bool matched() const noexcept { return matched_; }
  /// True when rendering executes a Jinja template (the model's own or an override's).
  bool is_jinja() const noexcept { return jinja_ != nullptr; }
  /// for_model() without a Jinja template: why ("the model has no tokenizer.chat_template",
  /// or the parse error); empty otherwise (and for an override).
  const std::string& fallback_reason() const noexcept { return fallback_reason_; }
  /// The text the template was made from: the override's text, the model's
  /// tokenizer.chat_template ("" when it has none, also when the matcher renders), the
  /// Jinja source of from_jinja/detect, or the name given to by_name.
  const std::string& source() const noexcept { return *source_; }
  /// Where the template came from: the override's origin, "tokenizer.chat_template" for
  /// the model's own (for_model/for_tokenizer without an override), "" otherwise.
  const std::string& origin() const noexcept { return origin_; }

  /// The template's rendering of an OpenAI-shaped conversation: `messages` a JSON array of
  /// message objects (role, content as a string, null or a list of parts, tool_calls,
  /// tool_call_id, name, reasoning_content, ...), `tools` a JSON array or null, `extra` an
  /// object of further template variables (e.g. enable_thinking) or null. Exactly the text
  /// the template writes (no newline added). The matcher renders only role/content strings
  /// (kInvalidArgument otherwise, and for tools). Errors: see the file comment.
  std::string render_json(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                          const nlohmann::ordered_json& tools = nullptr,
                          const nlohmann::ordered_json& extra = nullptr) const;
  /// render_json's text tokenized as tokenize() does (control tokens only from the
  /// template's own text; BOS when the vocabulary asks and the text has none).
  std::vector<int32_t> tokenize_json(const Tokenizer& tokenizer, const nlohmann::ordered_json& messages,
                                     bool add_generation_prompt, const nlohmann::ordered_json& tools = nullptr,
                                     const nlohmann::ordered_json& extra = nullptr) const;

  /// The conversation as text, markers included literally. With add_assistant, ends with
  /// the opening of an assistant turn (the generation prompt; for a Jinja template,
  /// add_generation_prompt).
  std::string render(std::span<const ChatMessage> messages, bool add_assistant) const;

  /// Token ids for the rendered conversation: markers become their control-token ids
  /// (when the vocabulary has them; otherwise their text is tokenized plainly), message
  /// contents are tokenized with parse_special = false. BOS is added when the vocabulary
  /// says add_bos. Errors: kInvalidArgument for a role other than system/user/assistant.
  std::vector<int32_t> tokenize(const Tokenizer& tokenizer, std::span<const ChatMessage> messages,
                                bool add_assistant) const;

  /// The ids that continue a conversation already in a KV cache: the cache holds the
  /// rendering of messages [0, n_done) up to the end of message n_done-1's content (a
  /// reply just generated, whose end-of-turn marker the model sampled but did not
  /// evaluate). Returns the rest of the rendering of `messages`: that turn's closing
  /// markers, the new messages, and with add_assistant the generation prompt; no BOS.
  /// n_done == 0 is tokenize(). With a Jinja template, "the rest" starts where message
  /// n_done-1's content ends in the rendering of `messages` (found by rendering again with
  /// a mark after that content). Errors: kInvalidArgument (bad role, n_done > size).
  std::vector<int32_t> tokenize_continuation(const Tokenizer& tokenizer, std::span<const ChatMessage> messages,
                                             size_t n_done, bool add_assistant) const;

 private:
  ChatTemplate(ChatTemplateFamily family, bool matched, std::string_view source)
      : family_(family), matched_(matched), source_(std::make_shared<const std::string>(source)) {}
  std::string render_jinja(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                           const nlohmann::ordered_json& tools, const nlohmann::ordered_json& extra) const;
  std::vector<int32_t> tokenize_jinja(const Tokenizer& tokenizer, const nlohmann::ordered_json& messages,
                                      bool add_generation_prompt, const nlohmann::ordered_json& tools,
                                      const nlohmann::ordered_json& extra, size_t n_done) const;
  ChatTemplateFamily family_;
  bool matched_;
  std::shared_ptr<const jinja::Template> jinja_;
  std::shared_ptr<const std::string> source_;
  std::string origin_;
  std::string bos_token_, eos_token_;
  std::string fallback_reason_;
};

}  // namespace tandem
