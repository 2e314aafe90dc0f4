// Chat templates: render a conversation (system / user / assistant messages) the way the
// model was trained to see it, and tokenize the result safely.
//
// The template family is detected from the GGUF key `tokenizer.chat_template` the way
// llama.cpp's built-in matcher does (llama-chat.cpp: substring tests on the Jinja source,
// no Jinja engine; a source that is exactly a family name selects it): ChatML, Llama 3,
// Llama 2 `[INST] <<SYS>>`, Mistral `[INST]`, Phi-3, Gemma, Zephyr, DeepSeek V3/R1. A model
// without a template, or with one no rule matches, gets the documented fallback: ChatML
// (as llama.cpp's server does), with matched() false.
//
// Rendering follows the published templates of those models, with llama.cpp's choices
// where a built-in renderer must choose: no default system message is invented (SmolLM2's
// and Qwen2.5's Jinja add one when none is given; llama.cpp does not), a system message
// for a family without a system role (Gemma, Mistral, Llama 2) opens the first user turn,
// and the text never starts with BOS: tokenize() adds BOS when the vocabulary asks for it
// (add_bos), as llama.cpp's tokenizer does. Per family (S system, U user, A assistant):
//   chatml   <|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n
//   llama3   <|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>...   (contents trimmed)
//   llama2   [INST] <<SYS>>\nS\n<</SYS>>\n\nU [/INST] A </s><s>[INST] U2 [/INST]  (trimmed)
//   mistral  [INST] S\n\nU[/INST] A</s>[INST] U2[/INST]
//   phi3     <|system|>\nS<|end|>\n<|user|>\nU<|end|>\n<|assistant|>\n
//   gemma    <start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\n  (trimmed)
//   zephyr   <|system|>\nS</s>\n<|user|>\nU</s>\n<|assistant|>\n
//   deepseek S<｜User｜>U<｜Assistant｜>A<｜end▁of▁sentence｜><｜User｜>U2<｜Assistant｜>
// Llama 2 and Mistral end a user turn with [/INST], which already is the generation
// prompt, so add_assistant adds nothing there.
//
// Safety rule: tokenize() turns only the template's own markers into control tokens; the
// text of every message is tokenized with special-token parsing off, so a user who types
// "<|im_end|>" or "</s>" cannot end a turn or forge another role. The rendered text is
// tokenized as one string (Tokenizer::tokenize over segments), so ids equal what
// llama.cpp gives for the rendered text with markers parsed and contents not.
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
  kLlama2,    ///< [INST] ... [/INST] with <<SYS>> (Llama 2 chat)
  kMistral,   ///< [INST] ... [/INST] without <<SYS>> (Mistral v1/v3 instruct)
  kPhi3,      ///< <|user|>\n ... <|end|>\n
  kGemma,     ///< <start_of_turn>user\n ... <end_of_turn>\n
  kZephyr,    ///< <|user|>\n ... </s>\n
  kDeepSeek,  ///< DeepSeek V3 / R1 "<｜User｜> ... <｜Assistant｜>"
};

class ChatTemplate {
 public:
  /// The template of `model` (GGUF `tokenizer.chat_template`), or the fallback (ChatML).
  static ChatTemplate for_model(const Model& model);
  /// Detect the family from a Jinja template source (or a family name); empty or
  /// unmatched -> ChatML with matched() false.
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
  /// says add_bos. Errors: kInvalidArgument for a role other than system/user/assistant.
  std::vector<int32_t> tokenize(const Tokenizer& tokenizer, std::span<const ChatMessage> messages,
                                bool add_assistant) const;

  /// The ids that continue a conversation already in a KV cache: the cache holds the
  /// rendering of messages [0, n_done) up to the end of message n_done-1's content (a
  /// reply just generated, whose end-of-turn marker the model sampled but did not
  /// evaluate). Returns the rest of the rendering of `messages`: that turn's closing
  /// markers, the new messages, and with add_assistant the generation prompt; no BOS.
  /// n_done == 0 is tokenize(). Errors: kInvalidArgument (bad role, n_done > size).
  std::vector<int32_t> tokenize_continuation(const Tokenizer& tokenizer, std::span<const ChatMessage> messages,
                                             size_t n_done, bool add_assistant) const;

 private:
  explicit ChatTemplate(ChatTemplateFamily family, bool matched) : family_(family), matched_(matched) {}
  ChatTemplateFamily family_;
  bool matched_;
};

}  // namespace tandem
