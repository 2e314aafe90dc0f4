// llama.cpp's --chat-template NAME_OR_JINJA and --chat-template-file FILE for the Tandem
// tools (tandem-server, tandem-cli --chat and apply-template): the template used instead of
// the GGUF's tokenizer.chat_template (tandem/template/chat_template.hpp).
#pragma once

#include <CLI/CLI.hpp>

#include <optional>
#include <string>

#include "tandem/core/error.hpp"
#include "tandem/template/chat_template.hpp"

namespace tandem::cli {

/// The two flags' values as given on the command line (nullopt: not given).
struct ChatTemplateFlags {
  std::optional<std::string> text;
  std::optional<std::string> file;
};

/// Declares --chat-template and --chat-template-file on `app`, writing into `flags`; giving
/// both is a usage error of the parse (exit 2, as the tools' other contradictory flags).
inline void add_chat_template_flags(CLI::App& app, ChatTemplateFlags& flags) {
  CLI::Option* text = app.add_option("--chat-template", flags.text,
                                     "chat template instead of the model's: a built-in name (chatml, llama3, llama2, "
                                     "mistral, phi3, gemma, zephyr, deepseek) or Jinja source");
  app.add_option("--chat-template-file", flags.file,
                 "chat template instead of the model's: a Jinja file (not with --chat-template)")
      ->excludes(text);
}

/// The override the flags ask for: nullopt when neither was given. Throws tandem::Error
/// (the tools print it and exit 1) when the file cannot be read and when the template does
/// not parse (the message names the flag or the file and the line).
inline std::optional<ChatTemplateOverride> chat_template_override(const ChatTemplateFlags& flags) {
  if (flags.text) return ChatTemplateOverride::from_text(*flags.text, "--chat-template");
  if (flags.file) return ChatTemplateOverride::from_file(*flags.file);
  return std::nullopt;
}

}  // namespace tandem::cli
