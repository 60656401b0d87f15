#include "gather_config.h"

#include <stdexcept>
#include <string_view>

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

// The entry of kConfigFields named `name`; evaluated at compile time, a
// name not in the table does not compile.
constexpr const ConfigField& config_field(std::string_view name) {
  for (const ConfigField& field : kConfigFields) {
    if (name == field.name) return field;
  }
  throw std::logic_error("no such config field");
}

std::string out_of_range(const ConfigField& field, bool below, const std::string& unit) {
  return std::string(field.name) + " must be " + (below ? "at least " : "at most ") +
         std::to_string(below ? field.least : field.most) + unit;
}

// A count (threads, reads) within its field's range.
void check_count(const ConfigField& field, int64_t count) {
  if (count < field.least || count > field.most) {
    throw std::invalid_argument(out_of_range(field, count < field.least, "") + ", got " +
                                std::to_string(count));
  }
}

// A size in bytes within its field's range, which is in the field's unit,
// and a power of two or 0 where the field says so.
void check_size(const ConfigField& field, uint64_t bytes) {
  const auto unit = static_cast<uint64_t>(field.unit_bytes);
  const bool below = bytes < static_cast<uint64_t>(field.least) * unit;
  if (below || bytes > static_cast<uint64_t>(field.most) * unit) {
    throw std::invalid_argument(out_of_range(field, below, std::string(" ") + field.unit) +
                                ", got " + std::to_string(bytes) + " bytes");
  }
  if (field.power_of_two && (bytes & (bytes - 1)) != 0) {
    throw std::invalid_argument(std::string(field.name) + " must be 0 or a power of two, got " +
                                std::to_string(bytes));
  }
}

}  // namespace

Policy parse_policy(const std::string& name) {
  return find_choice("prefetch policy", kPolicies, name).policy;
}

Io parse_io(const std::string& name) { return find_choice("io mode", kIoModes, name).io; }

void check_config(const GatherConfig& config) {
  constexpr const ConfigField& window = config_field("prefetch_window_kib");
  constexpr const ConfigField& threads = config_field("threads");
  constexpr const ConfigField& row_cache = config_field("row_cache_mib");
  constexpr const ConfigField& depth = config_field("io_queue_depth");
  constexpr const ConfigField& block = config_field("io_block_bytes");
  check_size(window, config.window_bytes);
  check_count(threads, config.threads);
  check_size(row_cache, config.row_cache_bytes);
  check_count(depth, config.io_queue_depth);
  check_size(block, config.io_block_bytes);
}

}  // namespace ple
