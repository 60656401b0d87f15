#include "gather_config.h"

#include <stdexcept>

namespace ple {

namespace {

// The entry of `name` in a table of named choices (kPolicies, kIoModes);
// std::invalid_argument naming `what` and the choices for another name.
template <typename Entry, size_t N>
const Entry& find_choice(const char* what, const Entry (&choices)[N], const std::string& name) {
  std::string names;
  for (const Entry& known : choices) {
    if (name == known.name) return known;
    names += names.empty() ? "" : ", ";
    names += known.name;
  }
  throw std::invalid_argument(std::string("unknown ") + what + " '" + name +
                              "' (expected one of " + names + ")");
}

void check_range(const char* what, uint64_t value, uint64_t least, uint64_t most) {
  if (value < least || value > most) {
    throw std::invalid_argument(std::string(what) + " must be " +
                                (value < least ? "at least " + std::to_string(least)
                                               : "at most " + std::to_string(most)) +
                                ", got " + std::to_string(value));
  }
}

}  // namespace

Policy parse_policy(const std::string& name) {
  return find_choice("prefetch policy", kPolicies, name).policy;
}

Io parse_io(const std::string& name) { return find_choice("io mode", kIoModes, name).io; }

void check_config(const GatherConfig& config) {
  if (config.threads < 1) throw std::invalid_argument("threads must be at least 1");
  check_range("threads", static_cast<uint64_t>(config.threads), 1, kMaxThreads);
  check_range("window bytes", config.window_bytes, 0, uint64_t{kMaxPrefetchWindowKib} * kKiB);
  check_range("row cache bytes", config.row_cache_bytes, 0, uint64_t{kMaxRowCacheMib} * kMiB);
  if (config.io_queue_depth < 1) throw std::invalid_argument("io_queue_depth must be at least 1");
  check_range("io_queue_depth", static_cast<uint64_t>(config.io_queue_depth), 1, kMaxIoQueueDepth);
  check_range("io_block_bytes", config.io_block_bytes, 0, kMaxIoBlockBytes);
  if ((config.io_block_bytes & (config.io_block_bytes - 1)) != 0) {
    throw std::invalid_argument("io_block_bytes must be 0 or a power of two, got " +
                                std::to_string(config.io_block_bytes));
  }
}

}  // namespace ple
