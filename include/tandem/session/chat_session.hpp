// ChatSession: a multi-turn chat over one Session. The conversation's KV stays in the
// session: each turn evaluates only its new tokens (the closing markers of the previous
// reply, the new user message, the generation prompt), never the history again.
//
// Context shift (after llama.cpp's --context-shift, at message boundaries): when a turn
// would leave less than min(max_tokens, n_ctx / 2) positions for the reply, the oldest
// user/assistant exchanges are dropped until it does (the system message always stays);
// the KV of the common prefix (the system message) is kept and the kept messages are
// evaluated again (RoPE re-positioning of cached keys is not done). A restored session
// whose messages are unknown is dropped whole. last_shift() says what was dropped.
//
// Thread-safety: used by one thread at a time, like its Session.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/session/session.hpp"
#include "tandem/template/chat_template.hpp"

namespace tandem {

class ChatSession {
 public:
  /// `session` must outlive this object. When the session already holds tokens (e.g. a
  /// restored chat), they are taken as a conversation that ended with an assistant reply.
  /// A non-empty `system_prompt` opens the conversation (for a non-empty session it is
  /// used only once the restored conversation is dropped: clear() or a context shift).
  ChatSession(Session& session, ChatTemplate chat_template, std::string system_prompt = {});

  /// Add a user message and generate the assistant's reply (stops on any end-of-
  /// generation token of the vocabulary, max_tokens, a stop string or the callback).
  /// The reply joins the history. Oldest exchanges are dropped first when the context is
  /// short (see above). Errors: those of Session::generate; kContextOverflow when the
  /// message does not fit even with every earlier exchange dropped: nothing was evaluated
  /// and the history is unchanged.
  GenerateResult send(std::string_view user_message, const GenerateOptions& options);

  /// What the last send() dropped to make room; empty when it dropped nothing.
  struct ContextShift {
    int32_t messages_dropped = 0;           ///< user and assistant messages forgotten
    int32_t tokens_kept = 0;                ///< positions whose KV was reused (system message)
    int32_t tokens_evaluated = 0;           ///< positions evaluated again for the kept messages
    bool restored_history_dropped = false;  ///< a restored conversation was forgotten whole
  };
  const std::optional<ContextShift>& last_shift() const noexcept { return last_shift_; }

  /// Start over: forget every message but the system message (the session is reset, its
  /// KV pages returned; the system message is evaluated again with the next send()).
  void clear();

  /// The messages so far (a restored session's earlier turns are not listed).
  const std::vector<ChatMessage>& messages() const noexcept { return messages_; }
  const ChatTemplate& chat_template() const noexcept { return template_; }

 private:
  /// Drops the oldest exchanges when `next_ids` (the continuation for `message`) would
  /// not leave room for the reply; returns the ids to evaluate then.
  std::vector<int32_t> shift_if_needed(std::string_view message, std::vector<int32_t> next_ids,
                                       const GenerateOptions& options);

  Session& session_;
  ChatTemplate template_;
  std::string system_prompt_;
  std::optional<ContextShift> last_shift_;
  std::vector<ChatMessage> messages_;
  size_t n_done_ = 0;       ///< messages whose rendering is in the KV cache
  bool continued_ = false;  ///< the session held an earlier conversation
};

}  // namespace tandem
