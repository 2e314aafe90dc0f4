// The C ABI's model and tokenizer functions (cabi/include/tandem.h).
#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "capi_internal.hpp"
#include "tandem/tokenizer/tokenizer.hpp"

using namespace tandem;
using namespace tandem::capi;

extern "C" {

// ---- model ---------------------------------------------------------------------------------

tandem_status tandem_model_params_init(tandem_model_params* params, size_t struct_size) {
  return guard([&] {
    init_struct(params, struct_size, kModelParamsV01, default_model_params(), "tandem_model_params_init",
                "tandem_model_params");
  });
}

tandem_status tandem_model_load(const char* path, const tandem_model_params* params, tandem_model** out_model) {
  static constexpr const char* fn = "tandem_model_load";
  if (out_model != nullptr) *out_model = nullptr;
  return guard([&] {
    require(out_model, fn, "out_model");
    require(path, fn, "path");
    tandem_model_params p = default_model_params();
    if (params != nullptr) read_struct(params, kModelParamsV01, p, fn, "tandem_model_params");
    ModelOptions options;
    options.gguf.check_block_scales = p.check_block_scales != 0;
    options.gguf.max_alignment = p.max_alignment;
    auto obj = std::make_shared<ModelObj>();
    obj->model = Model::load(path, options);
    obj->name = obj->model->name();
    if (p.chat_template != nullptr)
      obj->chat_template = ChatTemplateOverride::from_text(p.chat_template, "chat_template");
    *out_model = Registry::instance().add_handle<tandem_model>(Kind::kModel, std::move(obj));
  });
}

tandem_status tandem_model_free(tandem_model* model) {
  return guard([&] {
    if (model == nullptr) return;
    auto obj = Registry::instance().remove(reinterpret_cast<uintptr_t>(model), Kind::kModel);
    if (!obj) {
      fail(TANDEM_E_INVALID_HANDLE, fmt::format("tandem_model_free: model handle {:#x} is not live (double free?)",
                                                reinterpret_cast<uintptr_t>(model)));
    }
  });
}

tandem_status tandem_model_info_init(tandem_model_info* info, size_t struct_size) {
  return guard([&] {
    init_struct(info, struct_size, kModelInfoV01, zeroed<tandem_model_info>(), "tandem_model_info_init",
                "tandem_model_info");
  });
}

tandem_status tandem_model_get_info(const tandem_model* model, tandem_model_info* info) {
  static constexpr const char* fn = "tandem_model_get_info";
  return guard([&] {
    auto m = get_model(model, fn);
    require(info, fn, "info");
    const size_t n = out_struct_size(info, kModelInfoV01, fn, "tandem_model_info");
    const HParams& hp = m->model->hparams();
    const Tokenizer& tok = m->model->tokenizer();
    tandem_model_info out{};
    out.arch = arch_name(hp.arch).data();  // string literals: NUL-terminated, static
    out.name = m->name.c_str();
    out.n_vocab = hp.n_vocab;
    out.n_ctx_train = hp.n_ctx_train;
    out.n_embd = hp.n_embd;
    out.n_layer = hp.n_layer;
    out.n_head = hp.n_head;
    out.n_head_kv = hp.n_head_kv;
    out.token_bos = tok.bos();
    out.token_eos = tok.eos();
    out.weight_bytes = m->model->weight_bytes();
    write_struct(info, out, n);
  });
}

tandem_status tandem_model_identity_hash(const tandem_model* model, uint64_t* out_hash) {
  static constexpr const char* fn = "tandem_model_identity_hash";
  return guard([&] {
    auto m = get_model(model, fn);
    require(out_hash, fn, "out_hash");
    *out_hash = m->model->identity_hash();
  });
}

// ---- tokenizer ---------------------------------------------------------------------------

tandem_status tandem_tokenize(const tandem_model* model, const char* text, size_t text_len, uint32_t flags,
                              int32_t* tokens, size_t capacity, size_t* out_n_tokens) {
  static constexpr const char* fn = "tandem_tokenize";
  return guard([&] {
    auto m = get_model(model, fn);
    require(out_n_tokens, fn, "out_n_tokens");
    if (text == nullptr && text_len != 0) {
      fail(TANDEM_E_INVALID_ARG, fmt::format("{}: text is NULL but text_len is {}", fn, text_len));
    }
    check_flags(flags, kTokenizeFlags, fn);
    const std::string_view sv = text_len == 0 ? std::string_view() : std::string_view(text, text_len);
    check_utf8(sv, fn, "text");
    const auto ids = m->model->tokenizer().tokenize(sv, (flags & TANDEM_TOKENIZE_ADD_SPECIAL) != 0,
                                                    (flags & TANDEM_TOKENIZE_PARSE_SPECIAL) != 0);
    *out_n_tokens = ids.size();
    if (check_capacity(tokens, capacity, ids.size(), fn, "tokens")) std::copy(ids.begin(), ids.end(), tokens);
  });
}

tandem_status tandem_detokenize(const tandem_model* model, const int32_t* tokens, size_t n_tokens, uint32_t flags,
                                char* buf, size_t capacity, size_t* out_len) {
  static constexpr const char* fn = "tandem_detokenize";
  return guard([&] {
    auto m = get_model(model, fn);
    require(out_len, fn, "out_len");
    if (tokens == nullptr && n_tokens != 0) {
      fail(TANDEM_E_INVALID_ARG, fmt::format("{}: tokens is NULL but n_tokens is {}", fn, n_tokens));
    }
    check_flags(flags, kDetokenizeFlags, fn);
    const std::span<const int32_t> ids(tokens, n_tokens);
    const int32_t n_vocab = m->model->tokenizer().n_vocab();
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= n_vocab) {
        fail(TANDEM_E_INVALID_ARG,
             fmt::format("{}: token id {} at index {} is outside the vocabulary [0, {})", fn, ids[i], i, n_vocab));
      }
    }
    const std::string text = m->model->tokenizer().detokenize(ids, (flags & TANDEM_DETOKENIZE_REMOVE_SPECIAL) != 0,
                                                              (flags & TANDEM_DETOKENIZE_UNPARSE_SPECIAL) != 0);
    write_text(text, buf, capacity, out_len, fn);
  });
}

tandem_status tandem_token_to_piece(const tandem_model* model, int32_t token, uint32_t flags, char* buf,
                                    size_t capacity, size_t* out_len) {
  static constexpr const char* fn = "tandem_token_to_piece";
  return guard([&] {
    auto m = get_model(model, fn);
    require(out_len, fn, "out_len");
    check_flags(flags, kDetokenizeFlags, fn);
    const std::string piece =
        m->model->tokenizer().token_to_piece(token, (flags & TANDEM_DETOKENIZE_UNPARSE_SPECIAL) != 0);
    write_text(piece, buf, capacity, out_len, fn);
  });
}

}  // extern "C"
