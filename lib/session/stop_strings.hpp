// Stop strings over streamed text, shared by Session and the Scheduler (internal).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace tandem {

struct StopScan {
  bool hit = false;        ///< a stop string occurred: `text` was cut before it
  std::string_view piece;  ///< text newly final (it can no longer become a stop string)
};

/// `text` is everything generated so far, of which the first `emitted` bytes were already
/// passed on. Cuts `text` at the first occurrence of a stop string, then returns the part
/// after `emitted` that is final: all of it after a hit, otherwise all but the longest
/// suffix that is a proper prefix of some stop string (held back until it is decided).
/// Advances `emitted` past the returned piece, which views `text`.
StopScan scan_stop_strings(std::string& text, size_t& emitted, const std::vector<std::string>& stops);

}  // namespace tandem
