// The row gather (row_gather.cpp): copies requested rows out of a
// MappedTable, warm rows in request order, rows that may be cold in
// ascending address order with a bounded amount of MADV_WILLNEED advice
// ahead of the copy.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "interrupt.h"

namespace ple {

class MappedTable;
class PinnedRows;

// A row of a request: its address in the table's mapping (which says the
// file and the offset) and its place in the request.
struct RowRef {
  uintptr_t address;
  int64_t position;  // index in the request
};

// What a gather keeps from one call to the next (its row list, sort buffers,
// page marks): defined in row_gather.cpp.
struct GatherScratch;

// A table's gather scratch, one for each gather that runs at once, so that
// a call allocates nothing once the table has served calls of its size; a
// scratch that a call grew past a bound (kKeptScratchBytes, 16 MiB, in
// row_gather.cpp) is freed when that call ends instead.
class GatherScratchPool {
 public:
  GatherScratchPool();  // both in row_gather.cpp, where GatherScratch is complete
  ~GatherScratchPool();
  GatherScratchPool(const GatherScratchPool&) = delete;
  GatherScratchPool& operator=(const GatherScratchPool&) = delete;

  // A scratch that no other gather holds, or null when none is free (the
  // caller makes one and gives it back after).
  std::unique_ptr<GatherScratch> take();
  void give_back(std::unique_ptr<GatherScratch> scratch) noexcept;
  std::mutex& mutex() { return mutex_; }  // for fork: see MappedTable::lock_for_fork

 private:
  std::mutex mutex_;
  std::vector<std::unique_ptr<GatherScratch>> free_;
};

// The rows [begin, end) that the table's device and host tiers hold
// (Table.resident_range): the gather leaves them to its caller.
struct ResidentRange {
  int64_t begin = 0, end = 0;
  bool contains(int64_t id) const { return id >= begin && id < end; }
  bool operator==(const ResidentRange& other) const {
    return begin == other.begin && end == other.end;
  }
};

// Copies the rows `ids` (int32 or int64, n of them) into `out`, row i of the
// request at out + i * row_bytes.  Validates every id before writing.  Ids
// in `resident` live in the device and host tiers, which the caller reads:
// their rows in `out` are left as they were, and they are not counted.
// `use_row_cache`: look the rows up in the row cache and keep the ones read
// (false for rows that are about to become resident).  `stop` can end the
// gather early with Interrupted (`out` is then partly written).
// `max_threads`, when positive, caps the config's threads for this gather.
void gather_rows(MappedTable& table, const void* ids, bool ids_are_int64, int64_t n,
                 uint8_t* out, ResidentRange resident, bool use_row_cache, Interruption& stop,
                 int64_t max_threads = 0);

// A prefetch's gather of `ids` into `into`: as gather_rows with the row
// cache, except that the rows the cache holds, or takes in once read, stay
// there pinned until the gather that takes them (PinnedRows::take); the
// others, and every row without a row cache, in `into`'s buffer.
void prefetch_rows(MappedTable& table, const std::vector<int64_t>& ids, ResidentRange resident,
                   PinnedRows& into, Interruption& stop);

}  // namespace ple
