// Chat template detection, rendering and safe tokenization (see chat_template.hpp).
#include "tandem/template/chat_template.hpp"

#include <algorithm>
#include <array>
#include <cerrno>
#include <filesystem>
#include <fstream>

#include "tandem/core/error.hpp"
#include "tandem/model/model.hpp"
#include "tandem/template/jinja.hpp"
#include "tandem/tokenizer/tokenizer.hpp"

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

// U+E000 (private use): marks a message's text in a second rendering to find where the
// template wrote it. Templates never contain it.
const std::string kMark = "\xee\x80\x80";

nlohmann::ordered_json messages_json(std::span<const ChatMessage> ms) {
  nlohmann::ordered_json a = nlohmann::ordered_json::array();
  for (const ChatMessage& m : ms) a.push_back({{"role", m.role}, {"content", m.content}});
  return a;
}

std::vector<ChatMessage> messages_from_json(const nlohmann::ordered_json& messages) {
  if (!messages.is_array()) throw Error(ErrorCode::kInvalidArgument, "chat: messages must be a JSON array");
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const auto& m = messages[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() ||
        (m.contains("content") && !m["content"].is_string() && !m["content"].is_null())) {
      throw Error(ErrorCode::kInvalidArgument,
                  "chat message " + std::to_string(i) + ": the built-in template needs a role and a string content");
    }
    out.push_back({m["role"].get<std::string>(), m.value("content", nlohmann::ordered_json("")).is_string()
                                                     ? m["content"].get<std::string>()
                                                     : std::string()});
  }
  return out;
}

// Where a and b first differ (npos when equal).
size_t first_diff(std::string_view a, std::string_view b) {
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return i;
  }
  return a.size() == b.size() ? std::string_view::npos : n;
}

// The string fields of message i that hold its text: content, or the "text" of each part.
std::vector<nlohmann::ordered_json::json_pointer> text_fields(const nlohmann::ordered_json& messages, size_t i) {
  using Ptr = nlohmann::ordered_json::json_pointer;
  std::vector<Ptr> out;
  const auto& m = messages[i];
  if (!m.is_object() || !m.contains("content")) return out;
  const Ptr base = Ptr("/" + std::to_string(i) + "/content");
  const auto& c = m["content"];
  if (c.is_string()) {
    out.push_back(base);
  } else if (c.is_array()) {
    for (size_t k = 0; k < c.size(); ++k) {
      if (c[k].is_object() && c[k].contains("text") && c[k]["text"].is_string()) {
        out.push_back(base / std::to_string(k) / "text");
      }
    }
  }
  return out;
}

}  // namespace

ChatTemplateOverride ChatTemplateOverride::from_text(std::string text, std::string origin) {
  if (text.empty()) throw Error(ErrorCode::kInvalidArgument, origin + ": the chat template is empty");
  ChatTemplateOverride o;
  const bool named = std::any_of(kNames.begin(), kNames.end(), [&](const NamedFamily& n) { return text == n.name; });
  if (!named && text.find("{{") == std::string::npos && text.find("{%") == std::string::npos) {
    std::string names;  // a mistyped name would otherwise render as literal text
    for (const NamedFamily& n : kNames) names += (names.empty() ? "" : ", ") + std::string(n.name);
    throw Error(ErrorCode::kInvalidArgument, origin + ": '" + text.substr(0, 64) +
                                                 "' is neither a built-in template name (" + names +
                                                 ") nor Jinja (no '{{' or '{%')");
  }
  if (!named) {
    try {
      o.jinja_ = std::make_shared<const jinja::Template>(jinja::Template::parse(text));
    } catch (const Error& e) {
      throw Error(e.code(), origin + ": " + e.what());
    }
  }
  o.text_ = std::make_shared<const std::string>(std::move(text));
  o.origin_ = std::move(origin);
  return o;
}

ChatTemplateOverride ChatTemplateOverride::from_file(const std::string& path) {
  const std::string origin = "chat template file '" + path + "'";
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw Error(ErrorCode::kIo, "cannot read " + origin + ": a directory");
  if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec)) {
    throw Error(ErrorCode::kIo, "cannot read " + origin + ": not a regular file (a FIFO or device)");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorCode::kIo, "cannot read " + origin + ": " + errno_message(errno ? errno : ENOENT));
  // One byte past the parser's bound tells "too large" from "exactly at the bound".
  std::string text(jinja::Template::kMaxSourceBytes + 1, '\0');
  in.read(text.data(), std::streamsize(text.size()));
  if (in.bad()) throw Error(ErrorCode::kIo, "cannot read " + origin);
  text.resize(size_t(in.gcount()));
  if (text.size() > jinja::Template::kMaxSourceBytes) {
    throw Error(ErrorCode::kIo, "cannot read " + origin + ": larger than " +
                                    std::to_string(jinja::Template::kMaxSourceBytes >> 20) + " MiB");
  }
  return from_text(std::move(text), origin);
}

ChatTemplate ChatTemplate::for_model(const Model& model, const ChatTemplateOverride* override) {
  // A Gemma 3 file without a template (the 270M base GGUF): Gemma's turn format, not ChatML,
  // whose markers the model has never seen.
  if (override == nullptr && model.tokenizer().chat_template().empty() && model.hparams().arch == Arch::kGemma3) {
    ChatTemplate t = by_name("gemma");
    t.origin_ = "tokenizer.chat_template";
    t.fallback_reason_ = "the model has no tokenizer.chat_template (gemma3: the built-in 'gemma')";
    return t;
  }
  return for_tokenizer(model.tokenizer(), override);
}

ChatTemplate ChatTemplate::for_tokenizer(const Tokenizer& tok, const ChatTemplateOverride* override) {
  const auto with_tokens = [&tok](ChatTemplate t) {
    if (tok.bos() >= 0) t.bos_token_ = std::string(tok.token_text(tok.bos()));
    if (tok.eos() >= 0) t.eos_token_ = std::string(tok.token_text(tok.eos()));
    return t;
  };
  if (override != nullptr) {
    ChatTemplate t = override->jinja_ ? detect(override->text()) : by_name(override->text());
    t.source_ = override->text_;
    t.origin_ = override->origin_;
    t.jinja_ = override->jinja_;
    return t.jinja_ ? with_tokens(std::move(t)) : t;
  }
  const std::string& src = tok.chat_template();
  ChatTemplate t = detect(src);
  t.origin_ = "tokenizer.chat_template";
  if (src.empty()) {
    t.fallback_reason_ = "the model has no tokenizer.chat_template";
    return t;
  }
  for (const NamedFamily& n : kNames) {
    if (src == n.name) {
      t.fallback_reason_ = "the model's tokenizer.chat_template names the built-in '" + std::string(n.name) + "'";
      return t;
    }
  }
  try {
    t.jinja_ = std::make_shared<const jinja::Template>(jinja::Template::parse(src));
  } catch (const Error& e) {
    t.fallback_reason_ = e.what();
    return t;
  }
  return with_tokens(std::move(t));
}

ChatTemplate ChatTemplate::from_jinja(std::string_view source, std::string bos_token, std::string eos_token) {
  ChatTemplate t = detect(source);
  t.jinja_ = std::make_shared<const jinja::Template>(jinja::Template::parse(source));
  t.bos_token_ = std::move(bos_token);
  t.eos_token_ = std::move(eos_token);
  return t;
}

ChatTemplate ChatTemplate::detect(std::string_view src) {
  for (const NamedFamily& n : kNames) {
    if (src == n.name) return ChatTemplate(n.family, true, src);
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
  return ChatTemplate(f, matched, src);
}

ChatTemplate ChatTemplate::by_name(std::string_view name) {
  for (const NamedFamily& n : kNames) {
    if (name == n.name) return ChatTemplate(n.family, true, name);
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

std::string ChatTemplate::render_jinja(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                       const nlohmann::ordered_json& tools, const nlohmann::ordered_json& extra) const {
  if (!messages.is_array()) throw Error(ErrorCode::kInvalidArgument, "chat: messages must be a JSON array");
  if (!tools.is_null() && !tools.is_array())
    throw Error(ErrorCode::kInvalidArgument, "chat: tools must be a JSON array");
  // What transformers' apply_chat_template passes (its special tokens: BOS and EOS here).
  nlohmann::ordered_json ctx = nlohmann::ordered_json::object();
  ctx["messages"] = messages;
  ctx["tools"] = tools;
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = add_generation_prompt;
  ctx["bos_token"] = bos_token_;
  ctx["eos_token"] = eos_token_;
  if (extra.is_object()) {
    for (const auto& [k, v] : extra.items()) ctx[k] = v;
  } else if (!extra.is_null()) {
    throw Error(ErrorCode::kInvalidArgument, "chat: extra template variables must be a JSON object");
  }
  return jinja_->render(ctx);
}

std::vector<int32_t> ChatTemplate::tokenize_jinja(const Tokenizer& tok, const nlohmann::ordered_json& messages,
                                                  bool add_generation_prompt, const nlohmann::ordered_json& tools,
                                                  const nlohmann::ordered_json& extra, size_t n_done) const {
  const std::string text = render_jinja(messages, add_generation_prompt, tools, extra);
  // Spans of message text that holds control-token text: tokenized with parsing off.
  std::vector<std::pair<size_t, size_t>> spans;
  for (size_t i = 0; i < messages.size(); ++i) {
    for (const auto& ptr : text_fields(messages, i)) {
      const std::string field = messages[ptr].get<std::string>();
      if (field.empty() || tok.tokenize(field, false, true) == tok.tokenize(field, false, false)) continue;
      nlohmann::ordered_json probe = messages;
      probe[ptr] = kMark + field;
      const std::string marked = render_jinja(probe, add_generation_prompt, tools, extra);
      const size_t p = first_diff(text, marked);
      size_t len = std::string::npos;
      if (p != std::string::npos) {
        const std::string trimmed = trim(field);
        if (text.compare(p, field.size(), field) == 0) {
          len = field.size();
        } else if (!trimmed.empty() && text.compare(p, trimmed.size(), trimmed) == 0) {
          len = trimmed.size();
        }
      }
      if (len == std::string::npos) {
        throw Error(ErrorCode::kInvalidArgument,
                    "chat message " + std::to_string(i) +
                        ": its text contains control-token text and the chat template transforms it, so it cannot "
                        "be kept apart from the template's own markers; refusing to tokenize it");
      }
      spans.emplace_back(p, p + len);
    }
  }
  std::sort(spans.begin(), spans.end());
  size_t start = 0;
  if (n_done > 0) {
    const auto fields = text_fields(messages, n_done - 1);
    nlohmann::ordered_json probe = messages;
    if (fields.empty()) {
      probe[n_done - 1]["content"] = kMark;
    } else {
      probe[fields.back()] = probe[fields.back()].get<std::string>() + kMark;
    }
    start = first_diff(text, render_jinja(probe, add_generation_prompt, tools, extra));
    if (start == std::string::npos) {
      // the template does not show that message: continue after what the first n_done
      // messages render to (their common prefix with the whole)
      nlohmann::ordered_json head = nlohmann::ordered_json::array();
      for (size_t i = 0; i < n_done; ++i) head.push_back(messages[i]);
      start = first_diff(text, render_jinja(head, false, tools, extra));
      if (start == std::string::npos) start = text.size();
    }
  }
  std::vector<Piece> pieces;
  size_t pos = start;
  for (const auto& [b, e] : spans) {
    if (e <= pos) continue;
    const size_t from = std::max(b, pos);
    if (from > pos) pieces.push_back({text.substr(pos, from - pos), true, -1, false});
    pieces.push_back({text.substr(from, e - from), false, -1, true});
    pos = e;
  }
  if (pos < text.size()) pieces.push_back({text.substr(pos), true, -1, false});
  return tokenize_pieces(tok, pieces, /*add_bos=*/n_done == 0);
}

std::string ChatTemplate::render_json(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                      const nlohmann::ordered_json& tools, const nlohmann::ordered_json& extra) const {
  if (jinja_) return render_jinja(messages, add_generation_prompt, tools, extra);
  if (!tools.is_null() && !(tools.is_array() && tools.empty())) {
    throw Error(ErrorCode::kInvalidArgument, "chat: tools need the model's own (Jinja) chat template");
  }
  return render(messages_from_json(messages), add_generation_prompt);
}

std::vector<int32_t> ChatTemplate::tokenize_json(const Tokenizer& tokenizer, const nlohmann::ordered_json& messages,
                                                 bool add_generation_prompt, const nlohmann::ordered_json& tools,
                                                 const nlohmann::ordered_json& extra) const {
  if (jinja_) return tokenize_jinja(tokenizer, messages, add_generation_prompt, tools, extra, 0);
  if (!tools.is_null() && !(tools.is_array() && tools.empty())) {
    throw Error(ErrorCode::kInvalidArgument, "chat: tools need the model's own (Jinja) chat template");
  }
  return tokenize(tokenizer, messages_from_json(messages), add_generation_prompt);
}

std::string ChatTemplate::render(std::span<const ChatMessage> messages, bool add_assistant) const {
  if (jinja_) return render_jinja(messages_json(messages), add_assistant, nullptr, nullptr);
  std::string out;
  for (const Piece& p : render_pieces(family_, messages, add_assistant)) out += p.text;
  return out;
}

std::vector<int32_t> ChatTemplate::tokenize(const Tokenizer& tokenizer, std::span<const ChatMessage> messages,
                                            bool add_assistant) const {
  if (jinja_) return tokenize_jinja(tokenizer, messages_json(messages), add_assistant, nullptr, nullptr, 0);
  return tokenize_pieces(tokenizer, render_pieces(family_, messages, add_assistant), /*add_bos=*/true);
}

std::vector<int32_t> ChatTemplate::tokenize_continuation(const Tokenizer& tokenizer,
                                                         std::span<const ChatMessage> messages, size_t n_done,
                                                         bool add_assistant) const {
  if (n_done > messages.size()) {
    throw Error(ErrorCode::kInvalidArgument, "chat: " + std::to_string(n_done) + " messages done but only " +
                                                 std::to_string(messages.size()) + " given");
  }
  if (jinja_) return tokenize_jinja(tokenizer, messages_json(messages), add_assistant, nullptr, nullptr, n_done);
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
