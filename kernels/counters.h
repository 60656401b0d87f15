// The cumulative counters of every gather on a table: what table.stats()
// returns from the native side.  PLE_GATHER_COUNTERS is their one list, with
// a line each on what they count; bindings.cpp exports it as
// native.COUNTERS, from which ple.COUNTERS (ple/counters.py) is made.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace ple {

// X(name, meaning) for each counter that the native gather adds to.
#define PLE_GATHER_COUNTERS(X)                                                                  \
  X(calls, "native gathers run (a call served by a prefetch counts once, when the prefetch ran)") \
  X(rows, "disk-tier ids those gathers gathered (duplicates counted; resident ids are not)")      \
  X(unique_pages, "distinct file pages under each gather's disk-tier rows, summed over gathers")  \
  X(advised_pages, "pages advised MADV_WILLNEED")                                               \
  X(resident_pages,                                                                             \
    "of unique_pages, those in the page cache before any advice (by mincore) or copied while "  \
    "warm without a major fault (counted by the policies that advise)")                         \
  X(evicted_before_copy,                                                                        \
    "major faults taken copying rows whose cold pages had all been advised: advised pages "     \
    "reclaimed before the copy reached them, and read again")                                   \
  X(max_advised_ahead_bytes,                                                                    \
    "the most bytes advised and not yet copied at any moment of a gather, all threads "         \
    "together (at most the window with \"window\")")                                            \
  X(major_faults, "major page faults of the gathering threads (synchronous reads from disk)")   \
  X(minor_faults, "minor page faults of the gathering threads")                                 \
  X(gather_ns, "wall time inside the native gather, in nanoseconds")                            \
  X(prefetch_hits,                                                                              \
    "gathers served by a table.prefetch of the same ids (or of their first ids)")               \
  X(prefetch_misses,                                                                            \
    "gathers that found pending prefetches of other ids only, or whose prefetch failed")        \
  X(row_cache_hits, "disk-tier ids served by the row cache")                                    \
  X(row_cache_misses, "disk-tier ids the row cache did not hold, read from the files (0 while it is off)") \
  X(prefetch_pinned_rows,                                                                       \
    "rows of prefetches that the row cache held for them, pinned until taken, rather than in a " \
    "buffer of their own (counted when read ahead)")                                            \
  X(direct_reads,                                                                               \
    "O_DIRECT reads of io=\"direct\" gathers (each a run of adjacent distinct blocks, at most "  \
    "64 KiB)")                                                                                  \
  X(direct_read_bytes,                                                                          \
    "bytes those reads returned (whole blocks of table.io_block_bytes; a file's last read ends " \
    "at its end)")

struct GatherCounters {
#define PLE_COUNTER_FIELD(name, meaning) std::atomic<uint64_t> name{0};
  PLE_GATHER_COUNTERS(PLE_COUNTER_FIELD)
#undef PLE_COUNTER_FIELD

  // Every counter by name, and the derived bytes_copied (rows x row_bytes).
  std::map<std::string, uint64_t> snapshot(int64_t row_bytes) const;
  void reset();
};

// (name, meaning) of every counter that snapshot returns, in order: those of
// PLE_GATHER_COUNTERS, then bytes_copied.
std::vector<std::pair<std::string, std::string>> counter_meanings();

}  // namespace ple
