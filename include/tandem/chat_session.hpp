// ChatSession: a multi-turn chat over one Session. The conversation's KV stays in the
// session: each turn evaluates only its new tokens (the closing markers of the previous
// reply, the new user message, the generation prompt), never the history again.
//
// Thread-safety: used by one thread at a time, like its Session.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "tandem/chat_template.hpp"
#include "tandem/session.hpp"

namespace tandem {

class ChatSession {
 public:
  /// `session` must outlive this object. When the session already holds tokens (e.g. a
  /// restored chat), they are taken as a conversation that ended with an assistant reply.
  /// A non-empty `system_prompt` opens the conversation (ignored for a non-empty session).
  ChatSession(Session& session, ChatTemplate chat_template, std::string system_prompt = {});

  /// Add a user message and generate the assistant's reply (stops on any end-of-
  /// generation token of the vocabulary, max_tokens, a stop string or the callback).
  /// The reply joins the history. Errors: those of Session::generate; on
  /// kContextOverflow nothing was evaluated and the history is unchanged.
  GenerateResult send(std::string_view user_message, const GenerateOptions& options);

  /// The messages so far (a restored session's earlier turns are not listed).
  const std::vector<ChatMessage>& messages() const noexcept { return messages_; }
  const ChatTemplate& chat_template() const noexcept { return template_; }

 private:
  Session& session_;
  ChatTemplate template_;
  std::vector<ChatMessage> messages_;
  size_t n_done_ = 0;       ///< messages whose rendering is in the KV cache
  bool continued_ = false;  ///< the session held an earlier conversation
};

}  // namespace tandem
