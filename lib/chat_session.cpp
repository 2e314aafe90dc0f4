// Multi-turn chat over one Session (see chat_session.hpp).
#include "tandem/chat_session.hpp"

#include <utility>

namespace tandem {

ChatSession::ChatSession(Session& session, ChatTemplate chat_template, std::string system_prompt)
    : session_(session), template_(chat_template) {
  continued_ = !session_.tokens().empty();
  if (!continued_ && !system_prompt.empty()) messages_.push_back({"system", std::move(system_prompt)});
}

GenerateResult ChatSession::send(std::string_view user_message, const GenerateOptions& options) {
  const Tokenizer& tok = session_.model().tokenizer();
  std::vector<int32_t> ids;
  if (continued_ && n_done_ == 0) {
    // An earlier conversation ended with a reply: close it, then the new turn.
    const std::vector<ChatMessage> turn = {{"assistant", ""}, {"user", std::string(user_message)}};
    ids = template_.tokenize_continuation(tok, turn, 1, true);
  } else {
    std::vector<ChatMessage> all = messages_;
    all.push_back({"user", std::string(user_message)});
    ids = template_.tokenize_continuation(tok, all, n_done_, true);
  }
  GenerateResult r = session_.generate(std::span<const int32_t>(ids), options);
  messages_.push_back({"user", std::string(user_message)});
  messages_.push_back({"assistant", r.text});
  n_done_ = messages_.size();
  continued_ = false;
  return r;
}

}  // namespace tandem
