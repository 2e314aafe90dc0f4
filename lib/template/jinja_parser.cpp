// The Jinja lexer and parser (see jinja.hpp): jinja2's lexing rules with trim_blocks,
// lstrip_blocks and keep_trailing_newline=False, and its grammar and operator precedence.
#include <fmt/format.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "template/jinja_internal.hpp"

namespace tandem::jinja {

[[noreturn]] void fail(int line, const std::string& message) {
  if (line > 0) throw Error(ErrorCode::kInvalidArgument, fmt::format("jinja: line {}: {}", line, message));
  throw Error(ErrorCode::kInvalidArgument, "jinja: " + message);
}

[[noreturn]] void fail_limit(const std::string& message) {
  throw Error(ErrorCode::kOutOfMemory, "jinja: " + message);
}

namespace {

enum class Tok : uint8_t { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof };

struct Token {
  Tok type;
  std::string text;
  int line;
};

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

// Python's unicode-escape decoding of a string literal's body (jinja2 decodes them so).
std::string decode_string(std::string_view body, int line) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    if (c != '\\' || i + 1 >= body.size()) {
      out += c;
      continue;
    }
    const char e = body[++i];
    auto hex = [&](size_t n) {
      uint32_t v = 0;
      for (size_t k = 1; k <= n; ++k) {
        if (i + k >= body.size()) fail(line, "truncated escape in a string literal");
        const char h = body[i + k];
        v <<= 4;
        if (h >= '0' && h <= '9') {
          v |= uint32_t(h - '0');
        } else if (h >= 'a' && h <= 'f') {
          v |= uint32_t(h - 'a' + 10);
        } else if (h >= 'A' && h <= 'F') {
          v |= uint32_t(h - 'A' + 10);
        } else {
          fail(line, "bad escape in a string literal");
        }
      }
      i += n;
      if (v > 0x10FFFF) fail(line, "escape out of the Unicode range in a string literal");
      append_utf8(out, v);
    };
    switch (e) {
      case '\n':
        break;
      case '\\':
        out += '\\';
        break;
      case '\'':
        out += '\'';
        break;
      case '"':
        out += '"';
        break;
      case 'a':
        out += '\a';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'n':
        out += '\n';
        break;
      case 'r':
        out += '\r';
        break;
      case 't':
        out += '\t';
        break;
      case 'v':
        out += '\v';
        break;
      case 'x':
        hex(2);
        break;
      case 'u':
        hex(4);
        break;
      case 'U':
        hex(8);
        break;
      default:
        if (e >= '0' && e <= '7') {
          uint32_t v = uint32_t(e - '0');
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7'; ++k) {
            v = v * 8 + uint32_t(body[++i] - '0');
          }
          append_utf8(out, v);
        } else {
          out += '\\';
          out += e;
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string_view src) {
    // jinja2 normalizes newlines to \n and drops one trailing newline.
    src_.reserve(src.size());
    for (size_t i = 0; i < src.size(); ++i) {
      if (src[i] == '\r') {
        src_ += '\n';
        if (i + 1 < src.size() && src[i + 1] == '\n') ++i;
      } else {
        src_ += src[i];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;
    while (pos < src_.size()) {
      size_t tag = find_tag(pos);
      std::string text = src_.substr(pos, tag - pos);
      if (tag >= src_.size()) {
        emit_text(text, pos);
        break;
      }
      const char kind = src_[tag + 1];  // '{', '%' or '#'
      const char sign = tag + 2 < src_.size() ? src_[tag + 2] : 0;
      if (sign == '-') {
        size_t e = text.size();
        while (e > 0 && is_space(text[e - 1])) --e;
        text.resize(e);
      } else if (sign != '+' && kind != '{') {
        const size_t nl = text.rfind('\n');
        const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
        if ((l_pos > 0 || line_starting) && l_pos < text.size()) {
          bool ws = true;
          for (size_t k = l_pos; k < text.size(); ++k) ws = ws && is_space(text[k]);
          if (ws) text.resize(l_pos);
        }
      }
      emit_text(text, pos);
      size_t p = tag + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      if (kind == '#') {
        const size_t end = src_.find("#}", p);
        if (end == std::string::npos) fail(line_at(tag), "unclosed comment");
        pos = end + 2;
        if (end > p && src_[end - 1] == '-') {
          while (pos < src_.size() && is_space(src_[pos])) ++pos;
        } else if (pos < src_.size() && src_[pos] == '\n') {
          ++pos;  // trim_blocks applies to comments too
        }
        line_starting = pos > 0 && src_[pos - 1] == '\n';
        continue;
      }
      if (kind == '%' && is_raw(p)) {
        pos = lex_raw(tag, p);
        line_starting = pos > 0 && src_[pos - 1] == '\n';
        continue;
      }
      out_.push_back({kind == '{' ? Tok::kVarBegin : Tok::kBlockBegin, {}, line_at(tag)});
      pos = lex_tag(p, kind == '{');
      line_starting = pos > 0 && src_[pos - 1] == '\n';
    }
    out_.push_back({Tok::kEof, {}, line_at(src_.size())});
    return std::move(out_);
  }

 private:
  size_t find_tag(size_t from) const {
    for (size_t i = from; i + 1 < src_.size(); ++i) {
      if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    }
    return src_.size();
  }

  int line_at(size_t pos) {
    // incremental line counting: positions are asked in increasing order (mostly)
    if (pos < line_pos_) {
      line_pos_ = 0;
      line_ = 1;
    }
    for (; line_pos_ < pos && line_pos_ < src_.size(); ++line_pos_) {
      if (src_[line_pos_] == '\n') ++line_;
    }
    return line_;
  }

  void emit_text(const std::string& text, size_t pos) {
    if (!text.empty()) out_.push_back({Tok::kText, text, line_at(pos)});
  }

  bool is_raw(size_t p) const {
    while (p < src_.size() && is_space(src_[p])) ++p;
    if (src_.compare(p, 3, "raw") != 0) return false;
    p += 3;
    while (p < src_.size() && is_space(src_[p])) ++p;
    return src_.compare(p, 2, "%}") == 0 || src_.compare(p, 3, "-%}") == 0 || src_.compare(p, 3, "+%}") == 0;
  }

  // {% raw %}...{% endraw %}: the body verbatim (with the tags' whitespace control).
  size_t lex_raw(size_t tag, size_t p) {
    const size_t close = src_.find("%}", p);
    size_t body = close + 2;
    if (src_[close - 1] == '-') {
      while (body < src_.size() && is_space(src_[body])) ++body;
    } else if (src_[close - 1] != '+' && body < src_.size() && src_[body] == '\n') {
      ++body;
    }
    for (size_t q = body; (q = src_.find("{%", q)) != std::string::npos; q += 2) {
      size_t r = q + 2;
      const char sign = r < src_.size() ? src_[r] : 0;
      if (sign == '-' || sign == '+') ++r;
      while (r < src_.size() && is_space(src_[r])) ++r;
      if (src_.compare(r, 6, "endraw") != 0) continue;
      r += 6;
      while (r < src_.size() && is_space(src_[r])) ++r;
      char esign = 0;
      if (r < src_.size() && (src_[r] == '-' || src_[r] == '+')) esign = src_[r++];
      if (src_.compare(r, 2, "%}") != 0) continue;
      std::string text = src_.substr(body, q - body);
      if (sign == '-') {
        size_t e = text.size();
        while (e > 0 && is_space(text[e - 1])) --e;
        text.resize(e);
      } else if (sign != '+') {
        const size_t nl = text.rfind('\n');
        const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
        bool ws = l_pos < text.size();
        for (size_t k = l_pos; k < text.size(); ++k) ws = ws && (text[k] == ' ' || text[k] == '\t');
        if (ws) text.resize(l_pos);
      }
      emit_text(text, body);
      size_t next = r + 2;
      if (esign == '-') {
        while (next < src_.size() && is_space(src_[next])) ++next;
      } else if (esign != '+' && next < src_.size() && src_[next] == '\n') {
        ++next;
      }
      return next;
    }
    fail(line_at(tag), "unclosed raw block");
  }

  // Tokens of a {{ }} or {% %} tag; returns the position after its end (and after the
  // whitespace its end strips).
  size_t lex_tag(size_t p, bool variable) {
    int depth = 0;
    const int line = line_at(p);
    while (true) {
      while (p < src_.size() && is_space(src_[p])) ++p;
      if (p >= src_.size()) fail(line, variable ? "unclosed '{{'" : "unclosed '{%'");
      if (depth == 0) {
        const char* end = variable ? "}}" : "%}";
        if (src_.compare(p, 3, std::string("-") + end) == 0) {
          out_.push_back({variable ? Tok::kVarEnd : Tok::kBlockEnd, {}, line});
          p += 3;
          while (p < src_.size() && is_space(src_[p])) ++p;
          return p;
        }
        if (!variable && src_.compare(p, 3, "+%}") == 0) {
          out_.push_back({Tok::kBlockEnd, {}, line});
          return p + 3;
        }
        if (src_.compare(p, 2, end) == 0) {
          out_.push_back({variable ? Tok::kVarEnd : Tok::kBlockEnd, {}, line});
          p += 2;
          if (!variable && p < src_.size() && src_[p] == '\n') ++p;  // trim_blocks
          return p;
        }
      }
      const char c = src_[p];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = p;
        while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        out_.push_back({Tok::kName, src_.substr(p, e - p), line});
        p = e;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        p = lex_number(p, line);
      } else if (c == '\'' || c == '"') {
        size_t e = p + 1;
        while (e < src_.size() && src_[e] != c) e += src_[e] == '\\' ? 2 : 1;
        if (e >= src_.size()) fail(line, "unterminated string literal");
        out_.push_back({Tok::kString, decode_string(std::string_view(src_).substr(p + 1, e - p - 1), line), line});
        p = e + 1;
      } else {
        static const char* const kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "(",
                                           ")",  "[",  "]",  "{",  "}",  ",",  ".", ":", "|", "=", "<", ">"};
        const char* op = nullptr;
        for (const char* o : kOps) {
          if (src_.compare(p, std::strlen(o), o) == 0) {
            op = o;
            break;
          }
        }
        if (op == nullptr) fail(line, fmt::format("unexpected character '{}'", c));
        if (*op == '(' || *op == '[' || *op == '{') ++depth;
        if (*op == ')' || *op == ']' || *op == '}') --depth;
        out_.push_back({Tok::kOp, op, line});
        p += std::strlen(op);
      }
    }
  }

  size_t lex_number(size_t p, int line) {
    size_t e = p;
    auto digits = [&](auto pred) {
      while (e < src_.size() && (pred(src_[e]) || (src_[e] == '_' && e + 1 < src_.size() && pred(src_[e + 1])))) ++e;
    };
    auto dec = [](char ch) { return ch >= '0' && ch <= '9'; };
    const bool after_dot = !out_.empty() && out_.back().type == Tok::kOp && out_.back().text == ".";
    if (src_[p] == '0' && p + 1 < src_.size() && std::strchr("xXoObB", src_[p + 1]) != nullptr) {
      const char base = static_cast<char>(std::tolower(static_cast<unsigned char>(src_[p + 1])));
      e = p + 2;
      digits([base](char ch) {
        if (base == 'x') return std::isxdigit(static_cast<unsigned char>(ch)) != 0;
        if (base == 'o') return ch >= '0' && ch <= '7';
        return ch == '0' || ch == '1';
      });
      std::string d;
      for (size_t k = p + 2; k < e; ++k) {
        if (src_[k] != '_') d += src_[k];
      }
      if (d.empty()) fail(line, "bad number literal");
      errno = 0;
      const unsigned long long v = std::strtoull(d.c_str(), nullptr, base == 'x' ? 16 : base == 'o' ? 8 : 2);
      if (errno != 0 || v > uint64_t(INT64_MAX)) fail(line, "integer literal out of the 64-bit range");
      out_.push_back({Tok::kInt, std::to_string(v), line});
      return e;
    }
    digits(dec);
    bool is_float = false;
    if (!after_dot && e + 1 < src_.size() && src_[e] == '.' && dec(src_[e + 1])) {
      ++e;
      digits(dec);
      is_float = true;
    }
    if (!after_dot && e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
      size_t q = e + 1;
      if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
      if (q < src_.size() && dec(src_[q])) {
        e = q;
        digits(dec);
        is_float = true;
      }
    }
    std::string d;
    for (size_t k = p; k < e; ++k) {
      if (src_[k] != '_') d += src_[k];
    }
    if (!is_float) {
      errno = 0;
      const unsigned long long v = std::strtoull(d.c_str(), nullptr, 10);
      if (errno != 0 || v > uint64_t(INT64_MAX)) fail(line, "integer literal out of the 64-bit range");
    }
    out_.push_back({is_float ? Tok::kFloat : Tok::kInt, d, line});
    return e;
  }

  std::string src_;
  std::vector<Token> out_;
  size_t line_pos_ = 0;
  int line_ = 1;
};

class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : t_(std::move(toks)) {}

  std::shared_ptr<const Program> run() {
    auto prog = std::make_shared<Program>();
    std::string end;
    prog->body = parse_body({}, &end);
    return prog;
  }

 private:
  struct DepthGuard {
    explicit DepthGuard(Parser& p) : p_(p) {
      if (++p_.depth_ > Template::kMaxParseDepth) {
        fail(p_.cur().line, fmt::format("the template nests deeper than {} levels", Template::kMaxParseDepth));
      }
    }
    ~DepthGuard() { --p_.depth_; }
    DepthGuard(const DepthGuard&) = delete;
    DepthGuard& operator=(const DepthGuard&) = delete;
    Parser& p_;
  };

  const Token& cur() const { return t_[i_]; }
  const Token& peek(size_t k = 1) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  void next() {
    if (i_ + 1 < t_.size()) ++i_;
  }
  bool is_op(std::string_view op) const { return cur().type == Tok::kOp && cur().text == op; }
  bool is_name(std::string_view n) const { return cur().type == Tok::kName && cur().text == n; }
  bool accept_op(std::string_view op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool accept_name(std::string_view n) {
    if (!is_name(n)) return false;
    next();
    return true;
  }
  std::string describe(const Token& t) const {
    switch (t.type) {
      case Tok::kEof:
        return "the end of the template";
      case Tok::kBlockEnd:
        return "'%}'";
      case Tok::kVarEnd:
        return "'}}'";
      case Tok::kText:
        return "template text";
      default:
        return "'" + t.text + "'";
    }
  }
  void expect_op(std::string_view op) {
    if (!accept_op(op)) fail(cur().line, fmt::format("expected '{}', found {}", op, describe(cur())));
  }
  std::string expect_name() {
    if (cur().type != Tok::kName) fail(cur().line, fmt::format("expected a name, found {}", describe(cur())));
    std::string n = cur().text;
    next();
    return n;
  }
  void expect_block_end() {
    if (cur().type != Tok::kBlockEnd) fail(cur().line, fmt::format("expected '%}}', found {}", describe(cur())));
    next();
  }

  static ExprPtr make(Expr::Kind k, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->line = line;
    return e;
  }

  // The node's height from its children's; a tree higher than kMaxParseDepth (a long
  // chain of operators, filters or attributes) is refused, so evaluating and destroying
  // it never recurses deeply.
  static ExprPtr seal(ExprPtr e) {
    int d = 0;
    if (e->a) d = std::max(d, e->a->depth);
    if (e->b) d = std::max(d, e->b->depth);
    for (const ExprPtr& x : e->items) {
      if (x) d = std::max(d, x->depth);
    }
    for (const Arg& x : e->args) d = std::max(d, x.value->depth);
    e->depth = d + 1;
    if (e->depth > Template::kMaxParseDepth) {
      fail(e->line, fmt::format("the expression nests deeper than {} levels", Template::kMaxParseDepth));
    }
    return e;
  }

  // Statements until a block tag whose keyword is in `ends` (left in *end, the tokens
  // positioned after that keyword); at the top level `ends` is empty and EOF ends.
  Body parse_body(std::initializer_list<std::string_view> ends, std::string* end) {
    DepthGuard g(*this);
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.type == Tok::kEof) {
        if (ends.size() != 0) {
          fail(t.line, fmt::format("unexpected end of the template, expected '{}'", *ends.begin()));
        }
        return body;
      }
      if (t.type == Tok::kText) {
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::kText;
        s->line = t.line;
        s->text = t.text;
        body.push_back(std::move(s));
        next();
        continue;
      }
      if (t.type == Tok::kVarBegin) {
        next();
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::kOutput;
        s->line = t.line;
        s->expr = parse_tuple(true);
        if (cur().type != Tok::kVarEnd) fail(cur().line, fmt::format("expected '}}}}', found {}", describe(cur())));
        next();
        body.push_back(std::move(s));
        continue;
      }
      if (t.type != Tok::kBlockBegin) fail(t.line, "unexpected " + describe(t));
      next();
      const Token& kw = cur();
      if (kw.type != Tok::kName) fail(kw.line, "expected a statement keyword, found " + describe(kw));
      for (std::string_view e : ends) {
        if (kw.text == e) {
          *end = kw.text;
          next();
          return body;
        }
      }
      body.push_back(parse_statement());
    }
  }

  StmtPtr parse_statement() {
    const Token kw = cur();
    next();
    auto s = std::make_unique<Stmt>();
    s->line = kw.line;
    const std::string& k = kw.text;
    std::string end;
    if (k == "if") {
      s->kind = Stmt::Kind::kIf;
      s->conds.push_back(parse_tuple(false));
      expect_block_end();
      s->bodies.push_back(parse_body({"elif", "else", "endif"}, &end));
      while (true) {
        if (end == "elif") {
          s->conds.push_back(parse_tuple(false));
          expect_block_end();
          s->bodies.push_back(parse_body({"elif", "else", "endif"}, &end));
        } else if (end == "else") {
          expect_block_end();
          s->else_body = parse_body({"endif"}, &end);
          break;
        } else {
          break;
        }
      }
      expect_block_end();
    } else if (k == "for") {
      s->kind = Stmt::Kind::kFor;
      s->targets = parse_targets();
      if (!accept_name("in")) fail(cur().line, "expected 'in' in a for statement, found " + describe(cur()));
      s->expr = parse_tuple(false, /*with_condexpr=*/false);
      if (accept_name("if")) s->cond = parse_expression();
      if (is_name("recursive")) fail(cur().line, "recursive for loops are not supported");
      expect_block_end();
      s->body = parse_body({"endfor", "else"}, &end);
      if (end == "else") {
        expect_block_end();
        s->else_body = parse_body({"endfor"}, &end);
      }
      expect_block_end();
    } else if (k == "set") {
      if (cur().type == Tok::kName && peek().type == Tok::kOp && peek().text == "." && peek(2).type == Tok::kName) {
        s->kind = Stmt::Kind::kSet;
        s->targets = {cur().text};
        s->attr = peek(2).text;
        next();
        next();
        next();
        expect_op("=");
        s->expr = parse_tuple(true);
        expect_block_end();
        return s;
      }
      s->targets = parse_targets();
      if (accept_op("=")) {
        s->kind = Stmt::Kind::kSet;
        s->expr = parse_tuple(true);
        expect_block_end();
      } else {
        if (s->targets.size() != 1) fail(s->line, "a block set assigns one name");
        s->kind = Stmt::Kind::kSetBlock;
        if (is_op("|")) s->expr = parse_filter_chain(nullptr);
        expect_block_end();
        s->body = parse_body({"endset"}, &end);
        expect_block_end();
      }
    } else if (k == "macro") {
      s->kind = Stmt::Kind::kMacro;
      s->name = expect_name();
      parse_params(s->params);
      expect_block_end();
      s->body = parse_body({"endmacro"}, &end);
      if (cur().type == Tok::kName) next();  // {% endmacro name %}
      expect_block_end();
    } else if (k == "call") {
      s->kind = Stmt::Kind::kCallBlock;
      if (is_op("(")) parse_params(s->params);
      s->expr = parse_expression();
      if (s->expr->kind != Expr::Kind::kCall) fail(s->line, "expected a call after 'call'");
      expect_block_end();
      s->body = parse_body({"endcall"}, &end);
      expect_block_end();
    } else if (k == "filter") {
      s->kind = Stmt::Kind::kFilterBlock;
      s->expr = parse_filter_chain(nullptr, /*first_without_pipe=*/true);
      expect_block_end();
      s->body = parse_body({"endfilter"}, &end);
      expect_block_end();
    } else if (k == "generation") {
      // transformers' AssistantTracker: marks assistant text, renders its body
      s->kind = Stmt::Kind::kIf;
      s->conds.push_back(literal(Value::boolean(true), kw.line));
      expect_block_end();
      s->bodies.push_back(parse_body({"endgeneration"}, &end));
      expect_block_end();
    } else if (k == "break" || k == "continue") {
      if (loop_depth_hint_ < 0) fail(s->line, k + " outside a loop");
      s->kind = k == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue;
      expect_block_end();
    } else {
      fail(kw.line, fmt::format("unknown or unsupported statement '{}'", k));
    }
    return s;
  }

  ExprPtr literal(Value v, int line) {
    auto e = make(Expr::Kind::kLiteral, line);
    e->value = std::move(v);
    return e;
  }

  std::vector<std::string> parse_targets() {
    std::vector<std::string> names;
    const bool paren = accept_op("(");
    names.push_back(expect_name());
    while (accept_op(",")) {
      if (cur().type != Tok::kName || is_name("in")) break;
      names.push_back(expect_name());
    }
    if (paren) expect_op(")");
    return names;
  }

  void parse_params(std::vector<MacroParam>& params) {
    expect_op("(");
    while (!is_op(")")) {
      if (!params.empty()) expect_op(",");
      if (is_op(")")) break;
      MacroParam p;
      p.name = expect_name();
      if (accept_op("=")) p.default_value = parse_expression();
      params.push_back(std::move(p));
    }
    expect_op(")");
  }

  // A filter chain applied to `input` (null: the block's content).
  ExprPtr parse_filter_chain(ExprPtr input, bool first_without_pipe = false) {
    bool first = first_without_pipe;
    while (first || is_op("|")) {
      if (!first) next();
      first = false;
      input = parse_filter(std::move(input));
    }
    return input;
  }

  ExprPtr parse_filter(ExprPtr input) {
    auto f = make(Expr::Kind::kFilter, cur().line);
    f->name = expect_name();
    while (accept_op(".")) f->name += "." + expect_name();
    if (!is_known_filter(f->name)) fail(f->line, fmt::format("no filter named '{}'", f->name));
    f->a = std::move(input);
    if (is_op("(")) parse_call_args(f->args);
    return seal(std::move(f));
  }

  void parse_call_args(std::vector<Arg>& args) {
    expect_op("(");
    while (!is_op(")")) {
      if (!args.empty()) expect_op(",");
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) fail(cur().line, "*args and **kwargs in calls are not supported");
      Arg a;
      if (cur().type == Tok::kName && peek().type == Tok::kOp && peek().text == "=") {
        a.name = cur().text;
        next();
        next();
      }
      a.value = parse_expression();
      args.push_back(std::move(a));
    }
    expect_op(")");
  }

  // Expression or an unparenthesized tuple (a, b).
  ExprPtr parse_tuple(bool allow_empty_end, bool with_condexpr = true) {
    (void)allow_empty_end;
    const int line = cur().line;
    ExprPtr first = with_condexpr ? parse_expression() : parse_or();
    if (!is_op(",")) return first;
    auto t = make(Expr::Kind::kList, line);
    t->value.tuple = true;
    t->items.push_back(std::move(first));
    while (accept_op(",")) {
      if (cur().type == Tok::kBlockEnd || cur().type == Tok::kVarEnd || is_op(")") || is_op("=")) break;
      t->items.push_back(with_condexpr ? parse_expression() : parse_or());
    }
    return seal(std::move(t));
  }

  ExprPtr parse_expression() {
    DepthGuard g(*this);
    ExprPtr e = parse_or();
    while (is_name("if")) {
      auto c = make(Expr::Kind::kCond, cur().line);
      next();
      c->a = parse_or();  // the condition
      c->items.push_back(std::move(e));
      if (accept_name("else")) {
        c->items.push_back(parse_expression());
      } else {
        c->items.push_back(nullptr);
      }
      e = seal(std::move(c));
    }
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr e = parse_and();
    while (is_name("or")) {
      auto o = make(Expr::Kind::kOr, cur().line);
      next();
      o->a = std::move(e);
      o->b = parse_and();
      e = seal(std::move(o));
    }
    return e;
  }

  ExprPtr parse_and() {
    ExprPtr e = parse_not();
    while (is_name("and")) {
      auto o = make(Expr::Kind::kAnd, cur().line);
      next();
      o->a = std::move(e);
      o->b = parse_not();
      e = seal(std::move(o));
    }
    return e;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      DepthGuard g(*this);
      auto u = make(Expr::Kind::kUnary, cur().line);
      next();
      u->name = "not";
      u->a = parse_not();
      return seal(std::move(u));
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    ExprPtr e = parse_math1();
    std::vector<std::pair<std::string, ExprPtr>> ops;
    while (true) {
      std::string op;
      if (cur().type == Tok::kOp && (cur().text == "==" || cur().text == "!=" || cur().text == "<" ||
                                     cur().text == "<=" || cur().text == ">" || cur().text == ">=")) {
        op = cur().text;
        next();
      } else if (is_name("in")) {
        op = "in";
        next();
      } else if (is_name("not") && peek().type == Tok::kName && peek().text == "in") {
        op = "not in";
        next();
        next();
      } else {
        break;
      }
      ops.emplace_back(op, parse_math1());
    }
    if (ops.empty()) return e;
    // a op1 b op2 c: Python's chain, each operand evaluated once (items: the operands,
    // ops: the operators)
    auto c = make(Expr::Kind::kCompare, e->line);
    c->items.push_back(std::move(e));
    for (auto& [op, operand] : ops) {
      c->ops.push_back(op);
      c->items.push_back(std::move(operand));
    }
    return seal(std::move(c));
  }

  ExprPtr binary(std::string op, ExprPtr a, ExprPtr b) {
    auto e = make(Expr::Kind::kBinary, a->line);
    e->name = std::move(op);
    e->a = std::move(a);
    e->b = std::move(b);
    return seal(std::move(e));
  }

  ExprPtr parse_math1() {
    ExprPtr e = parse_concat();
    while (is_op("+") || is_op("-")) {
      std::string op = cur().text;
      next();
      e = binary(op, std::move(e), parse_concat());
    }
    return e;
  }

  ExprPtr parse_concat() {
    ExprPtr e = parse_math2();
    while (is_op("~")) {
      next();
      e = binary("~", std::move(e), parse_math2());
    }
    return e;
  }

  ExprPtr parse_math2() {
    ExprPtr e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = cur().text;
      next();
      e = binary(op, std::move(e), parse_pow());
    }
    return e;
  }

  ExprPtr parse_pow() {
    ExprPtr e = parse_unary(true);
    while (is_op("**")) {
      next();
      e = binary("**", std::move(e), parse_unary(true));
    }
    return e;
  }

  ExprPtr parse_unary(bool with_filter) {
    DepthGuard g(*this);
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      auto u = make(Expr::Kind::kUnary, cur().line);
      u->name = cur().text;
      next();
      u->a = parse_unary(false);
      e = seal(std::move(u));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    const Token t = cur();
    switch (t.type) {
      case Tok::kName: {
        next();
        if (t.text == "true" || t.text == "True") return literal(Value::boolean(true), t.line);
        if (t.text == "false" || t.text == "False") return literal(Value::boolean(false), t.line);
        if (t.text == "none" || t.text == "None") return literal(Value::none(), t.line);
        auto n = make(Expr::Kind::kName, t.line);
        n->name = t.text;
        return n;
      }
      case Tok::kString: {
        std::string s = t.text;
        next();
        while (cur().type == Tok::kString) {
          s += cur().text;
          next();
        }
        return literal(Value::string(std::move(s)), t.line);
      }
      case Tok::kInt:
        next();
        return literal(Value::integer(std::stoll(t.text)), t.line);
      case Tok::kFloat:
        next();
        return literal(Value::number(std::strtod(t.text.c_str(), nullptr)), t.line);
      case Tok::kOp:
        if (t.text == "(") {
          next();
          if (accept_op(")")) {
            auto e = make(Expr::Kind::kList, t.line);
            e->value.tuple = true;
            return e;
          }
          ExprPtr e = parse_tuple(false);
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          next();
          auto e = make(Expr::Kind::kList, t.line);
          while (!is_op("]")) {
            if (!e->items.empty()) expect_op(",");
            if (is_op("]")) break;
            e->items.push_back(parse_expression());
          }
          expect_op("]");
          return seal(std::move(e));
        }
        if (t.text == "{") {
          next();
          auto e = make(Expr::Kind::kDict, t.line);
          while (!is_op("}")) {
            if (!e->items.empty()) expect_op(",");
            if (is_op("}")) break;
            e->items.push_back(parse_expression());
            expect_op(":");
            e->items.push_back(parse_expression());
          }
          expect_op("}");
          return seal(std::move(e));
        }
        break;
      default:
        break;
    }
    fail(t.line, "unexpected " + describe(t));
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      if (is_op(".")) {
        next();
        auto g = make(Expr::Kind::kGetAttr, cur().line);
        if (cur().type == Tok::kInt) {
          g->kind = Expr::Kind::kGetItem;
          g->b = literal(Value::integer(std::stoll(cur().text)), cur().line);
          next();
        } else {
          g->name = expect_name();
        }
        g->a = std::move(e);
        e = seal(std::move(g));
      } else if (is_op("[")) {
        const int line = cur().line;
        next();
        ExprPtr parts[3];
        bool slice = false;
        int idx = 0;
        while (!is_op("]")) {
          if (is_op(":")) {
            slice = true;
            if (++idx > 2) fail(line, "bad slice");
            next();
            continue;
          }
          if (parts[idx]) fail(line, "bad subscript");
          parts[idx] = parse_expression();
          if (!slice && is_op(",")) fail(line, "tuple subscripts are not supported");
        }
        next();
        if (slice) {
          auto s = make(Expr::Kind::kSlice, line);
          s->a = std::move(e);
          for (auto& p : parts) s->items.push_back(std::move(p));
          e = seal(std::move(s));
        } else {
          if (!parts[0]) fail(line, "empty subscript");
          auto g = make(Expr::Kind::kGetItem, line);
          g->a = std::move(e);
          g->b = std::move(parts[0]);
          e = seal(std::move(g));
        }
      } else if (is_op("(")) {
        auto c = make(Expr::Kind::kCall, cur().line);
        parse_call_args(c->args);
        c->a = std::move(e);
        e = seal(std::move(c));
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_filter_expr(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        next();
        e = parse_filter(std::move(e));
      } else if (is_name("is")) {
        next();
        auto t = make(Expr::Kind::kTest, cur().line);
        t->negated = accept_name("not");
        t->name = expect_name();
        while (accept_op(".")) t->name += "." + expect_name();
        if (!is_known_test(t->name)) fail(t->line, fmt::format("no test named '{}'", t->name));
        t->a = std::move(e);
        if (is_op("(")) {
          parse_call_args(t->args);
        } else if ((cur().type == Tok::kName || cur().type == Tok::kString || cur().type == Tok::kInt ||
                    cur().type == Tok::kFloat || is_op("(") || is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
          if (is_name("is")) fail(cur().line, "tests cannot be chained with 'is'");
          Arg a;
          a.value = parse_postfix(parse_primary());
          t->args.push_back(std::move(a));
        }
        e = seal(std::move(t));
      } else if (is_op("(")) {
        auto c = make(Expr::Kind::kCall, cur().line);
        parse_call_args(c->args);
        c->a = std::move(e);
        e = seal(std::move(c));
      } else {
        return e;
      }
    }
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  int depth_ = 0;
  int loop_depth_hint_ = 0;
};

}  // namespace

std::shared_ptr<const Program> parse_program(std::string_view source) {
  if (source.size() > Template::kMaxSourceBytes) {
    fail(0,
         fmt::format("the template has {} bytes, more than the {} allowed", source.size(), Template::kMaxSourceBytes));
  }
  Lexer lexer(source);
  Parser parser(lexer.run());
  return parser.run();
}

}  // namespace tandem::jinja
