#include "counters.h"

namespace ple {

namespace {

constexpr const char* kBytesCopied = "bytes_copied";
constexpr const char* kBytesCopiedMeaning = "rows x row_bytes";

}  // namespace

std::map<std::string, uint64_t> GatherCounters::snapshot(int64_t row_bytes) const {
  std::map<std::string, uint64_t> values;
#define PLE_COUNTER_VALUE(name, meaning) values[#name] = name.load();
  PLE_GATHER_COUNTERS(PLE_COUNTER_VALUE)
#undef PLE_COUNTER_VALUE
  values[kBytesCopied] = values["rows"] * static_cast<uint64_t>(row_bytes);
  return values;
}

void GatherCounters::reset() {
#define PLE_COUNTER_RESET(name, meaning) name.store(0);
  PLE_GATHER_COUNTERS(PLE_COUNTER_RESET)
#undef PLE_COUNTER_RESET
}

std::vector<std::pair<std::string, std::string>> counter_meanings() {
  std::vector<std::pair<std::string, std::string>> list;
#define PLE_COUNTER_MEANING(name, meaning) list.emplace_back(#name, meaning);
  PLE_GATHER_COUNTERS(PLE_COUNTER_MEANING)
#undef PLE_COUNTER_MEANING
  list.emplace_back(kBytesCopied, kBytesCopiedMeaning);
  return list;
}

}  // namespace ple
