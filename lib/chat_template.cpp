// Chat template detection, rendering and safe tokenization (see chat_template.hpp).
#include "tandem/chat_template.hpp"

#include <array>

#include "tandem/error.hpp"
#include "tandem/model.hpp"
#include "tandem/tokenizer.hpp"

namespace tandem {
namespace {

// A rendered conversation as a sequence of pieces: markers (their control-token texts
// become control tokens) and plain text (message contents and the template's own plain
// text, never parsed for special tokens). `message` is the index of the message a piece
// belongs to (-1: the generation prompt); `content` marks the piece that is exactly that
// message's (possibly trimmed) content.
struct Piece {
  std::string text;
  bool marker = false;
  int message = -1;
  bool content = false;
};

class Pieces {
 public:
  void marker(std::string text, int message) { out_.push_back({std::move(text), true, message, false}); }
  void plain(std::string text, int message) { out_.push_back({std::move(text), false, message, false}); }
  void content(std::string text, int message) { out_.push_back({std::move(text), false, message, true}); }
  std::vector<Piece> take() { return std::move(out_); }

 private:
  std::vector<Piece> out_;
};

// Python's str.strip() on ASCII whitespace, as the published templates' `| trim` /
// `.strip()` do for the texts models see in practice.
std::string trim(std::string_view s) {
  const char* ws = " \t\n\r\v\f";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  const size_t e = s.find_last_not_of(ws);
  return std::string(s.substr(b, e - b + 1));
}

void check_roles(std::span<const ChatMessage> messages) {
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& r = messages[i].role;
    if (r != "system" && r != "user" && r != "assistant") {
      throw Error(ErrorCode::kInvalidArgument,
                  "chat message " + std::to_string(i) + ": role '" + r + "' is not one of system, user, assistant");
    }
  }
}

// <|im_start|>role\ncontent<|im_end|>\n ... <|im_start|>assistant\n
void render_chatml(std::span<const ChatMessage> ms, bool add_assistant, Pieces& p) {
  for (size_t i = 0; i < ms.size(); ++i) {
    const int m = static_cast<int>(i);
    p.marker("<|im_start|>", m);
    p.plain(ms[i].role + "\n", m);
    p.content(ms[i].content, m);
    p.marker("<|im_end|>", m);
    p.plain("\n", m);
  }
  if (add_assistant) {
    p.marker("<|im_start|>", -1);
    p.plain("assistant\n", -1);
  }
}

// <|start_header_id|>role<|end_header_id|>\n\ntrim(content)<|eot_id|> (BOS from the vocabulary)
void render_llama3(std::span<const ChatMessage> ms, bool add_assistant, Pieces& p) {
  for (size_t i = 0; i < ms.size(); ++i) {
    const int m = static_cast<int>(i);
    p.marker("<|start_header_id|>", m);
    p.plain(ms[i].role, m);
    p.marker("<|end_header_id|>", m);
    p.plain("\n\n", m);
    p.content(trim(ms[i].content), m);
    p.marker("<|eot_id|>", m);
  }
  if (add_assistant) {
    p.marker("<|start_header_id|>", -1);
    p.plain("assistant", -1);
    p.marker("<|end_header_id|>", -1);
    p.plain("\n\n", -1);
  }
}

// Llama-2-chat: [INST] <<SYS>>\nS\n<</SYS>>\n\nU [/INST] A </s><s>[INST] U2 [/INST]
// (contents stripped; the first BOS comes from the vocabulary).
void render_llama2(std::span<const ChatMessage> ms, Pieces& p) {
  bool first_user = true;
  std::string system;
  for (size_t i = 0; i < ms.size(); ++i) {
    const int m = static_cast<int>(i);
    const ChatMessage& msg = ms[i];
    if (msg.role == "system") {
      system = trim(msg.content);  // rendered inside the first user turn
      continue;
    }
    if (msg.role == "user") {
      if (!first_user) p.marker("<s>", m);
      p.plain("[INST] ", m);
      if (first_user && !system.empty()) p.plain("<<SYS>>\n" + system + "\n<</SYS>>\n\n", m);
      p.content(trim(msg.content), m);
      p.plain(" [/INST]", m);
      first_user = false;
    } else {
      p.plain(" ", m);
      p.content(trim(msg.content), m);
      p.plain(" ", m);
      p.marker("</s>", m);
    }
  }
}

// Mistral v3: [INST] S\n\nU[/INST] A</s>[INST] U2[/INST] (system before the first user
// message, as llama.cpp; BOS from the vocabulary).
void render_mistral(std::span<const ChatMessage> ms, Pieces& p) {
  std::string system;
  for (size_t i = 0; i < ms.size(); ++i) {
    const int m = static_cast<int>(i);
    const ChatMessage& msg = ms[i];
    if (msg.role == "system") {
      system = msg.content;
      continue;
    }
    if (msg.role == "user") {
      p.marker("[INST]", m);
      p.plain(" ", m);
      if (!system.empty()) p.plain(system + "\n\n", m);
      system.clear();
      p.content(msg.content, m);
      p.marker("[/INST]", m);
    } else {
      p.plain(" ", m);
      p.content(trim(msg.content), m);
      p.marker("</s>", m);
    }
  }
}

// Phi-3: <|role|>\ncontent<|end|>\n ... <|assistant|>\n
void render_phi3(std::span<const ChatMessage> ms, bool add_assistant, Pieces& p) {
  for (size_t i = 0; i < ms.size(); ++i) {
    const int m = static_cast<int>(i);
    p.marker("<|" + ms[i].role + "|>", m);
    p.plain("\n", m);
    p.content(ms[i].content, m);
    p.marker("<|end|>", m);
    p.plain("\n", m);
  }
  if (add_assistant) {
    p.marker("<|assistant|>", -1);
    p.plain("\n", -1);
  }
}

// Gemma: <start_of_turn>user\n[S\n\n]trim(U)<end_of_turn>\n<start_of_turn>model\n...
// (no system role: its text opens the next user turn, as Gemma 3's template does).
void render_gemma(std::span<const ChatMessage> ms, bool add_assistant, Pieces& p) {
  std::string system;
  for (size_t i = 0; i < ms.size(); ++i) {
    const int m = static_cast<int>(i);
    const ChatMessage& msg = ms[i];
    if (msg.role == "system") {
      system = trim(msg.content);
      continue;
    }
    const bool model_turn = msg.role == "assistant";
    p.marker("<start_of_turn>", m);
    p.plain(model_turn ? "model\n" : "user\n", m);
    if (!model_turn && !system.empty()) {
      p.plain(system + "\n\n", m);
      system.clear();
    }
    p.content(trim(msg.content), m);
    p.marker("<end_of_turn>", m);
    p.plain("\n", m);
  }
  if (add_assistant) {
    p.marker("<start_of_turn>", -1);
    p.plain("model\n", -1);
  }
}

// Zephyr: <|role|>\ncontent</s>\n ... <|assistant|>\n
void render_zephyr(std::span<const ChatMessage> ms, bool add_assistant, Pieces& p) {
  for (size_t i = 0; i < ms.size(); ++i) {
    const int m = static_cast<int>(i);
    p.marker("<|" + ms[i].role + "|>", m);
    p.plain("\n", m);
    p.content(ms[i].content, m);
    p.marker("</s>", m);
    p.plain("\n", m);
  }
  if (add_assistant) {
    p.marker("<|assistant|>", -1);
    p.plain("\n", -1);
  }
}

// DeepSeek V3 / R1: S<｜User｜>U<｜Assistant｜>A<｜end▁of▁sentence｜>...<｜Assistant｜>
void render_deepseek(std::span<const ChatMessage> ms, bool add_assistant, Pieces& p) {
  static const std::string kUser = "<\xef\xbd\x9cUser\xef\xbd\x9c>";
  static const std::string kAssistant =
      "<\xef\xbd\x9c"
      "Assistant\xef\xbd\x9c>";
  static const std::string kEos =
      "<\xef\xbd\x9c"
      "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>";
  for (size_t i = 0; i < ms.size(); ++i) {
    const int m = static_cast<int>(i);
    const ChatMessage& msg = ms[i];
    if (msg.role == "system") {
      p.content(msg.content, m);
    } else if (msg.role == "user") {
      p.marker(kUser, m);
      p.content(msg.content, m);
    } else {
      p.marker(kAssistant, m);
      p.content(msg.content, m);
      p.marker(kEos, m);
    }
  }
  if (add_assistant) p.marker(kAssistant, -1);
}

std::vector<Piece> render_pieces(ChatTemplateFamily family, std::span<const ChatMessage> ms, bool add_assistant) {
  check_roles(ms);
  Pieces p;
  switch (family) {
    case ChatTemplateFamily::kChatML:
      render_chatml(ms, add_assistant, p);
      break;
    case ChatTemplateFamily::kLlama3:
      render_llama3(ms, add_assistant, p);
      break;
    case ChatTemplateFamily::kLlama2:
      render_llama2(ms, p);
      break;
    case ChatTemplateFamily::kMistral:
      render_mistral(ms, p);
      break;
    case ChatTemplateFamily::kPhi3:
      render_phi3(ms, add_assistant, p);
      break;
    case ChatTemplateFamily::kGemma:
      render_gemma(ms, add_assistant, p);
      break;
    case ChatTemplateFamily::kZephyr:
      render_zephyr(ms, add_assistant, p);
      break;
    case ChatTemplateFamily::kDeepSeek:
      render_deepseek(ms, add_assistant, p);
      break;
  }
  return p.take();
}

std::vector<int32_t> tokenize_pieces(const Tokenizer& tok, std::span<const Piece> pieces, bool add_bos) {
  std::vector<Tokenizer::TextSegment> segs;
  segs.reserve(pieces.size());
  for (const Piece& p : pieces) segs.push_back({p.text, p.marker});
  std::vector<int32_t> ids = tok.tokenize(segs, /*add_special=*/false);
  if (add_bos && tok.add_bos() && tok.bos() >= 0 && (ids.empty() || ids.front() != tok.bos())) {
    ids.insert(ids.begin(), tok.bos());
  }
  return ids;
}

struct NamedFamily {
  std::string_view name;
  ChatTemplateFamily family;
};
constexpr std::array<NamedFamily, 8> kNames = {{
    {"chatml", ChatTemplateFamily::kChatML},
    {"llama3", ChatTemplateFamily::kLlama3},
    {"llama2", ChatTemplateFamily::kLlama2},
    {"mistral", ChatTemplateFamily::kMistral},
    {"phi3", ChatTemplateFamily::kPhi3},
    {"gemma", ChatTemplateFamily::kGemma},
    {"zephyr", ChatTemplateFamily::kZephyr},
    {"deepseek", ChatTemplateFamily::kDeepSeek},
}};

}  // namespace

ChatTemplate ChatTemplate::for_model(const Model& model) {
  const auto src = model.gguf().get_string("tokenizer.chat_template");
  return detect(src ? *src : std::string_view{});
}

ChatTemplate ChatTemplate::detect(std::string_view src) {
  for (const NamedFamily& n : kNames) {
    if (src == n.name) return ChatTemplate(n.family, true);
  }
  auto has = [src](std::string_view s) { return src.find(s) != std::string_view::npos; };
  ChatTemplateFamily f = ChatTemplateFamily::kChatML;
  bool matched = true;
  if (has("<|im_start|>")) {
    f = ChatTemplateFamily::kChatML;
  } else if (src.starts_with("mistral") || has("[INST]")) {
    f = has("<<SYS>>") ? ChatTemplateFamily::kLlama2 : ChatTemplateFamily::kMistral;
  } else if (has("<|assistant|>") && has("<|end|>")) {
    f = ChatTemplateFamily::kPhi3;
  } else if (has("<|assistant|>") && has("<|user|>")) {
    f = ChatTemplateFamily::kZephyr;
  } else if (has("<start_of_turn>")) {
    f = ChatTemplateFamily::kGemma;
  } else if (has("<|start_header_id|>") && has("<|end_header_id|>")) {
    f = ChatTemplateFamily::kLlama3;
  } else if (has("<\xef\xbd\x9c"
                 "Assistant\xef\xbd\x9c>") &&
             has("<\xef\xbd\x9cUser\xef\xbd\x9c>")) {
    f = ChatTemplateFamily::kDeepSeek;
  } else {
    matched = false;
  }
  return ChatTemplate(f, matched);
}

ChatTemplate ChatTemplate::by_name(std::string_view name) {
  for (const NamedFamily& n : kNames) {
    if (name == n.name) return ChatTemplate(n.family, true);
  }
  throw Error(ErrorCode::kInvalidArgument,
              "unknown chat template name '" + std::string(name) +
                  "' (known: chatml, llama3, llama2, mistral, phi3, gemma, zephyr, deepseek)");
}

std::string_view ChatTemplate::name() const noexcept {
  for (const NamedFamily& n : kNames) {
    if (n.family == family_) return n.name;
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
  return tokenize_pieces(tokenizer, render_pieces(family_, messages, add_assistant), /*add_bos=*/true);
}

std::vector<int32_t> ChatTemplate::tokenize_continuation(const Tokenizer& tokenizer,
                                                         std::span<const ChatMessage> messages, size_t n_done,
                                                         bool add_assistant) const {
  if (n_done > messages.size()) {
    throw Error(ErrorCode::kInvalidArgument, "chat: " + std::to_string(n_done) + " messages done but only " +
                                                 std::to_string(messages.size()) + " given");
  }
  const std::vector<Piece> pieces = render_pieces(family_, messages, add_assistant);
  if (n_done == 0) return tokenize_pieces(tokenizer, pieces, /*add_bos=*/true);
  size_t from = pieces.size();
  for (size_t i = pieces.size(); i-- > 0;) {
    if (pieces[i].content && pieces[i].message == static_cast<int>(n_done) - 1) {
      from = i + 1;
      break;
    }
  }
  return tokenize_pieces(tokenizer, std::span<const Piece>(pieces).subspan(from), /*add_bos=*/false);
}

}  // namespace tandem
