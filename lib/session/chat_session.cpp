// Multi-turn chat over one Session (see chat_session.hpp).
#include "tandem/session/chat_session.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

namespace tandem {

ChatSession::ChatSession(Session& session, ChatTemplate chat_template, std::string system_prompt)
    : session_(session), template_(std::move(chat_template)), system_prompt_(std::move(system_prompt)) {
  continued_ = !session_.tokens().empty();
  if (!continued_ && !system_prompt_.empty()) messages_.push_back({"system", system_prompt_});
}

void ChatSession::clear() {
  session_.reset();
  messages_.clear();
  if (!system_prompt_.empty()) messages_.push_back({"system", system_prompt_});
  n_done_ = 0;
  continued_ = false;
  last_shift_.reset();
}

std::vector<int32_t> ChatSession::shift_if_needed(std::string_view message, std::vector<int32_t> next_ids,
                                                  const GenerateOptions& options) {
  const size_t n_ctx = size_t(session_.n_ctx());
  const size_t room = std::min(size_t(std::max(options.max_tokens, 1)), n_ctx / 2);
  // +1: a reply's last sampled token may still wait to be evaluated.
  if (session_.tokens().size() + 1 + next_ids.size() + room <= n_ctx) return next_ids;

  const Tokenizer& tok = session_.model().tokenizer();
  const bool unknown_history = continued_ && n_done_ == 0;
  const size_t n_system = (!messages_.empty() && messages_[0].role == "system") ? 1 : 0;
  std::vector<ChatMessage> base;
  if (unknown_history) {
    if (!system_prompt_.empty()) base.push_back({"system", system_prompt_});
  } else {
    base.assign(messages_.begin(), messages_.begin() + std::ptrdiff_t(n_system));
  }
  // Drop whole exchanges, oldest first, until the rendering leaves room for the reply.
  size_t first_kept = unknown_history ? messages_.size() : n_system;
  std::vector<int32_t> full;
  for (;;) {
    std::vector<ChatMessage> kept = base;
    kept.insert(kept.end(), messages_.begin() + std::ptrdiff_t(first_kept), messages_.end());
    kept.push_back({"user", std::string(message)});
    full = template_.tokenize(tok, kept, true);
    if (full.size() + room <= n_ctx || first_kept >= messages_.size()) break;
    first_kept = std::min(messages_.size(), first_kept + 2);  // a user message and its reply
  }
  const bool drops = unknown_history || first_kept > n_system;
  if (!drops) return next_ids;  // nothing to drop: the turn runs in what is left (or overflows)
  if (full.size() + 1 > n_ctx) {
    throw Error(ErrorCode::kContextOverflow,
                fmt::format("context overflow: the message needs {} positions even without the earlier "
                            "conversation, n_ctx is {}",
                            full.size() + 1, n_ctx));
  }
  ContextShift shift;
  shift.messages_dropped = static_cast<int32_t>(first_kept - n_system);
  shift.restored_history_dropped = unknown_history;
  const size_t kept_tokens = session_.reuse_prefix(full);
  shift.tokens_kept = static_cast<int32_t>(kept_tokens);
  shift.tokens_evaluated = static_cast<int32_t>(full.size() - kept_tokens);
  if (unknown_history) {
    messages_ = base;
  } else {
    messages_.erase(messages_.begin() + std::ptrdiff_t(n_system), messages_.begin() + std::ptrdiff_t(first_kept));
  }
  continued_ = false;
  n_done_ = messages_.size();
  last_shift_ = shift;
  return {full.begin() + std::ptrdiff_t(kept_tokens), full.end()};
}

GenerateResult ChatSession::send(std::string_view user_message, const GenerateOptions& options) {
  const Tokenizer& tok = session_.model().tokenizer();
  last_shift_.reset();
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
  ids = shift_if_needed(user_message, std::move(ids), options);
  GenerateResult r = session_.generate(std::span<const int32_t>(ids), options);
  messages_.push_back({"user", std::string(user_message)});
  messages_.push_back({"assistant", r.text});
  n_done_ = messages_.size();
  continued_ = false;
  return r;
}

}  // namespace tandem
