// Chat template detection, rendering and safe tokenization (see chat_template.hpp).
#include "tandem/chat_template.hpp"

#include "tandem/error.hpp"
#include "tandem/model.hpp"
#include "tandem/tokenizer.hpp"

namespace tandem {
namespace {

// A rendered conversation as alternating pieces: markers (may become control tokens) and
// message text (never parsed for special tokens).
struct Piece {
  std::string text;
  bool marker;
};

void check_role(const ChatMessage& m) {
  if (m.role != "system" && m.role != "user" && m.role != "assistant") {
    throw Error(ErrorCode::kInvalidArgument,
                "chat message role '" + m.role + "' is not one of system, user, assistant");
  }
}

std::vector<Piece> render_chatml(std::span<const ChatMessage> messages, bool add_assistant) {
  std::vector<Piece> out;
  for (const ChatMessage& m : messages) {
    check_role(m);
    out.push_back({"<|im_start|>", true});
    out.push_back({m.role + "\n" + m.content, false});
    out.push_back({"<|im_end|>", true});
    out.push_back({"\n", false});
  }
  if (add_assistant) {
    out.push_back({"<|im_start|>", true});
    out.push_back({"assistant\n", false});
  }
  return out;
}

std::vector<Piece> render_pieces(ChatTemplateFamily family, std::span<const ChatMessage> messages, bool add_assistant) {
  switch (family) {
    case ChatTemplateFamily::kChatML:
      return render_chatml(messages, add_assistant);
    default:
      break;
  }
  throw Error(ErrorCode::kInvalidArgument, "chat template family not available");
}

}  // namespace

ChatTemplate ChatTemplate::for_model(const Model& model) {
  const auto src = model.gguf().get_string("tokenizer.chat_template");
  return detect(src ? *src : std::string_view{});
}

ChatTemplate ChatTemplate::detect(std::string_view jinja_source) {
  if (jinja_source.find("<|im_start|>") != std::string_view::npos)
    return ChatTemplate(ChatTemplateFamily::kChatML, true);
  return ChatTemplate(ChatTemplateFamily::kChatML, false);
}

ChatTemplate ChatTemplate::by_name(std::string_view name) {
  if (name == "chatml") return ChatTemplate(ChatTemplateFamily::kChatML, true);
  throw Error(ErrorCode::kInvalidArgument, "unknown chat template name '" + std::string(name) + "'");
}

std::string_view ChatTemplate::name() const noexcept {
  switch (family_) {
    case ChatTemplateFamily::kChatML:
      return "chatml";
    case ChatTemplateFamily::kLlama3:
      return "llama3";
    case ChatTemplateFamily::kLlama2:
      return "llama2";
    case ChatTemplateFamily::kMistral:
      return "mistral";
    case ChatTemplateFamily::kPhi3:
      return "phi3";
    case ChatTemplateFamily::kGemma:
      return "gemma";
    case ChatTemplateFamily::kZephyr:
      return "zephyr";
    case ChatTemplateFamily::kDeepSeek:
      return "deepseek";
  }
  return "unknown";
}

std::string ChatTemplate::render(std::span<const ChatMessage> messages, bool add_assistant) const {
  std::string out;
  for (const Piece& p : render_pieces(family_, messages, add_assistant)) out += p.text;
  return out;
}

std::vector<int32_t> ChatTemplate::tokenize(const Tokenizer& tokenizer, std::span<const ChatMessage> messages,
                                            bool add_assistant) const {
  std::vector<int32_t> ids;
  if (tokenizer.add_bos() && tokenizer.bos() >= 0) ids.push_back(tokenizer.bos());
  for (const Piece& p : render_pieces(family_, messages, add_assistant)) {
    const std::vector<int32_t> part = tokenizer.tokenize(p.text, /*add_special=*/false, /*parse_special=*/p.marker);
    ids.insert(ids.end(), part.begin(), part.end());
  }
  return ids;
}

}  // namespace tandem
