#include "session/stop_strings.hpp"

#include <algorithm>

namespace tandem {

StopScan scan_stop_strings(std::string& text, size_t& emitted, const std::vector<std::string>& stops) {
  StopScan r;
  for (const auto& s : stops) {
    // Text before `emitted` held no stop string's start, so search from just before it.
    const size_t from = emitted > s.size() ? emitted - s.size() : 0;
    const size_t at = text.find(s, from);
    if (at != std::string::npos) {
      text.resize(at);
      r.hit = true;
    }
  }
  size_t hold = 0;
  if (!r.hit) {
    for (const auto& s : stops) {
      for (size_t len = std::min(text.size(), s.size() - 1); len > hold; --len) {
        if (std::string_view(text).substr(text.size() - len) == std::string_view(s).substr(0, len)) {
          hold = len;
          break;
        }
      }
    }
  }
  if (text.size() > emitted + hold) {
    r.piece = std::string_view(text).substr(emitted, text.size() - hold - emitted);
    emitted += r.piece.size();
  }
  return r;
}

}  // namespace tandem
