// tandem-jinja-render: the oracle test's driver. Renders Jinja templates with Tandem's
// interpreter for tests/jinja_oracle/test_jinja_oracle.py.
//
//   tandem-jinja-render BATCH.json
// BATCH: {"cases": [{"template": "...", "context": {...}, "now": 1700000000}, ...]}.
// Prints a JSON array: per case {"ok": true, "text": "..."} or {"ok": false, "error": "...",
// "code": "INVALID_ARG"}. Exit 0 unless the batch itself cannot be read (1).
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tandem/core/error.hpp"
#include "tandem/template/jinja.hpp"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: tandem-jinja-render BATCH.json\n");
    return 2;
  }
  std::ifstream in(argv[1], std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "tandem-jinja-render: cannot open %s\n", argv[1]);
    return 1;
  }
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::ordered_json batch;
  try {
    batch = nlohmann::ordered_json::parse(ss.str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem-jinja-render: %s\n", e.what());
    return 1;
  }
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const auto& c : batch["cases"]) {
    nlohmann::ordered_json r;
    try {
      const auto t = tandem::jinja::Template::parse(c["template"].get<std::string>());
      tandem::jinja::RenderOptions opt;
      if (c.contains("now")) opt.now = c["now"].get<std::time_t>();
      if (c.contains("max_steps")) opt.limits.max_steps = c["max_steps"].get<size_t>();
      r["ok"] = true;
      r["text"] = t.render(c.value("context", nlohmann::ordered_json::object()), opt);
    } catch (const tandem::Error& e) {
      r["ok"] = false;
      r["error"] = e.what();
      r["code"] = std::string(tandem::error_code_name(e.code()));
    }
    out.push_back(std::move(r));
  }
  std::cout << out.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  return 0;
}
