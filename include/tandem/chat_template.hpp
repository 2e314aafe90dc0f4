// Chat templates: render a conversation (system / user / assistant messages) the way the
// model was trained to see it, and tokenize the result safely.
//
// The template family is detected from the GGUF key `tokenizer.chat_template` the way
// llama.cpp's built-in matcher does (substring tests on the Jinja source, no Jinja engine):
// ChatML, Llama 3, Llama 2 / Mistral `[INST]`, Phi-3, Gemma, Zephyr, DeepSeek. A model
// without a template, or with one no rule matches, gets the documented fallback (ChatML,
// as llama.cpp's server does).
//
// Safety rule: tokenize() turns only the template's own markers into control tokens; the
// text of every message is tokenized with special-token parsing off, so a user who types
// "<|im_end|>" or "</s>" cannot end a turn or forge another role.
//
// Thread-safety: a ChatTemplate is immutable after construction; all methods are const
// and may be called from any thread.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tandem {

class Model;
class Tokenizer;

/// One message of a conversation. `role` is "system", "user" or "assistant"
/// (other roles are refused with ErrorCode::kInvalidArgument by render/tokenize).
struct ChatMessage {
  std::string role;
  std::string content;
};

enum class ChatTemplateFamily {
  kChatML,    ///< <|im_start|>role\n ... <|im_end|>\n (SmolLM2, Qwen2/2.5)
  kLlama3,    ///< <|start_header_id|>role<|end_header_id|>\n\n ... <|eot_id|>
  kLlama2,    ///< [INST] ... [/INST] with <<SYS>> (Llama 2, Mistral v1)
  kMistral,   ///< [INST] ... [/INST] without <<SYS>> (Mistral v3 "tekken" style)
  kPhi3,      ///< <|user|>\n ... <|end|>\n
  kGemma,     ///< <start_of_turn>user\n ... <end_of_turn>\n
  kZephyr,    ///< <|user|>\n ... </s>\n
  kDeepSeek,  ///< DeepSeek-V2/V3/R1 "<｜User｜> ... <｜Assistant｜>"
};

class ChatTemplate {
 public:
  /// The template of `model` (GGUF `tokenizer.chat_template`), or the fallback (ChatML).
  static ChatTemplate for_model(const Model& model);
  /// Detect the family from a Jinja template source; empty or unmatched -> ChatML.
  static ChatTemplate detect(std::string_view jinja_source);
  /// By name: "chatml", "llama3", "llama2", "mistral", "phi3", "gemma", "zephyr",
  /// "deepseek". Throws tandem::Error(kInvalidArgument) naming an unknown name.
  static ChatTemplate by_name(std::string_view name);

  ChatTemplateFamily family() const noexcept { return family_; }
  std::string_view name() const noexcept;
  /// True when the family was matched from the model's template, false for the fallback.
  bool matched() const noexcept { return matched_; }

  /// The conversation as text, markers included literally. With add_assistant, ends with
  /// the opening of an assistant turn (the generation prompt).
  std::string render(std::span<const ChatMessage> messages, bool add_assistant) const;

  /// Token ids for the rendered conversation: markers become their control-token ids
  /// (when the vocabulary has them; otherwise their text is tokenized plainly), message
  /// contents are tokenized with parse_special = false. BOS is added when the vocabulary
  /// says add_bos and the template does not already start with it.
  std::vector<int32_t> tokenize(const Tokenizer& tokenizer, std::span<const ChatMessage> messages,
                                bool add_assistant) const;

 private:
  explicit ChatTemplate(ChatTemplateFamily family, bool matched) : family_(family), matched_(matched) {}
  ChatTemplateFamily family_;
  bool matched_;
};

}  // namespace tandem
