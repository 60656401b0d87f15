// A host cache of recently gathered disk rows, in front of the disk tier.
//
// It holds whole rows by id in a fixed byte budget and evicts with CLOCK (a
// row read since the hand last passed it gets a second chance).  Rows are
// copied in as the gather read them, so the cache never changes a byte of a
// result; the files must not change under an open table (README "Faults").
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace ple {

class RowCache {
 public:
  RowCache() = default;
  ~RowCache();
  RowCache(const RowCache&) = delete;
  RowCache& operator=(const RowCache&) = delete;

  // Sets the budget and drops every cached row.  0 turns the cache off.  A
  // budget that cannot be had throws std::bad_alloc and changes nothing.
  void configure(uint64_t budget_bytes, int64_t row_bytes);
  void clear();
  bool enabled() const { return capacity_.load() > 0; }

  // lookup and insert expect the caller to hold mutex(): a gather takes it
  // once for all its rows rather than once per row.
  std::mutex& mutex() { return mutex_; }
  // Copies row `id` to `out` when it is cached.
  bool lookup(int64_t id, uint8_t* out);
  // Keeps a copy of row `id` (no-op when it is already cached).
  void insert(int64_t id, const uint8_t* row);

 private:
  void forget_rows();  // empties the slots; the arena stays mapped
  void release_arena();

  std::mutex mutex_;
  int64_t row_bytes_ = 0;
  std::atomic<int64_t> capacity_{0};  // rows; read by enabled() without the lock
  // Anonymous memory of capacity_ rows: a page only becomes resident once a
  // row is written to it, so an unused budget costs nothing.
  uint8_t* arena_ = nullptr;
  std::vector<int64_t> slot_id_;  // the row in each used slot
  std::vector<uint8_t> referenced_;
  std::unordered_map<int64_t, int64_t> slot_of_;  // its size is the slots in use
  int64_t hand_ = 0;
};

}  // namespace ple
