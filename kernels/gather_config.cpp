#include "gather_config.h"

#include <stdexcept>

namespace ple {

Policy parse_policy(const std::string& name) {
  std::string names;
  for (const PolicyName& known : kPolicies) {
    if (name == known.name) return known.policy;
    names += names.empty() ? "" : ", ";
    names += known.name;
  }
  throw std::invalid_argument("unknown prefetch policy '" + name + "' (expected one of " + names +
                              ")");
}

namespace {

void check_range(const char* what, uint64_t value, uint64_t least, uint64_t most) {
  if (value < least || value > most) {
    throw std::invalid_argument(std::string(what) + " must be " +
                                (value < least ? "at least " + std::to_string(least)
                                               : "at most " + std::to_string(most)) +
                                ", got " + std::to_string(value));
  }
}

}  // namespace

void check_config(const GatherConfig& config) {
  if (config.threads < 1) throw std::invalid_argument("threads must be at least 1");
  check_range("threads", static_cast<uint64_t>(config.threads), 1, kMaxThreads);
  check_range("window bytes", config.window_bytes, 0, uint64_t{kMaxPrefetchWindowKib} * kKiB);
  check_range("row cache bytes", config.row_cache_bytes, 0, uint64_t{kMaxRowCacheMib} * kMiB);
}

}  // namespace ple
