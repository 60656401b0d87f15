// A host cache of recently gathered disk rows, in front of the disk tier.
//
// It holds whole rows by id in a fixed byte budget and evicts with CLOCK (a
// row read since the hand last passed it gets a second chance).  Rows are
// copied in as the gather read them, so the cache never changes a byte of a
// result; the files must not change under an open table (README "Faults").
//
// Memory is resident only as rows fill it: the rows, each slot's id and its
// CLOCK bit live in anonymous mappings of the budget's size that the kernel
// backs with pages only once written (slots fill in order), and the index
// from ids to slots is a hash table, in such a mapping too, that grows with
// the rows it holds (4 bytes an entry, at most half full: 8 to 16 bytes a
// row).  A full cache of rows of B bytes takes about B + 17 to 25 bytes a row.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>

namespace ple {

// Anonymous memory mapped at once and backed by pages only where written;
// reads of pages never written see zeros.
class LazyArray {
 public:
  LazyArray() = default;
  // Throws std::bad_alloc when it cannot be mapped.  `sparse`: most of it
  // will never be written, so the system is not asked to set memory aside
  // for all of it (MAP_NORESERVE).
  explicit LazyArray(uint64_t bytes, bool sparse = false);
  ~LazyArray();
  LazyArray(LazyArray&& other) noexcept { swap(other); }
  LazyArray& operator=(LazyArray&& other) noexcept {
    swap(other);
    return *this;
  }
  uint8_t* data() const { return data_; }
  // Gives the pages back: the memory reads as zeros again.
  void discard();
  void swap(LazyArray& other) noexcept;

 private:
  uint8_t* data_ = nullptr;
  uint64_t bytes_ = 0;
};

class RowCache {
 public:
  // The most rows a cache holds (its index numbers slots in 32 bits): a
  // budget of more rows (256 GiB of 64-byte rows) cannot be had.
  static constexpr int64_t kMaxRows = (int64_t{1} << 32) - 2;

  RowCache() = default;
  RowCache(const RowCache&) = delete;
  RowCache& operator=(const RowCache&) = delete;

  // Sets the budget and drops every cached row.  0 turns the cache off.  A
  // budget that cannot be had (mapped, or numbered: kMaxRows) throws
  // std::bad_alloc and changes nothing.
  void configure(uint64_t budget_bytes, int64_t row_bytes);
  void clear();
  bool enabled() const { return capacity_.load() > 0; }

  // lookup and insert expect the caller to hold mutex(): a gather takes it
  // once for all its rows rather than once per row.
  std::mutex& mutex() { return mutex_; }
  // Copies row `id` to `out` when it is cached.
  bool lookup(int64_t id, uint8_t* out);
  // Keeps a copy of row `id` (no-op when it is already cached, or when the
  // index cannot grow: a cache short of memory only caches less).
  void insert(int64_t id, const uint8_t* row);

 private:
  // Where id is, or would go, in the index: a position whose entry is its
  // slot + 1, or 0.
  uint64_t find(int64_t id) const;
  uint64_t home(int64_t id) const;
  void erase_at(uint64_t position);  // backward-shift deletion: no tombstones
  bool grow_index();
  void forget_rows();  // empties the slots; the mappings stay

  std::mutex mutex_;
  int64_t row_bytes_ = 0;
  std::atomic<int64_t> capacity_{0};  // rows; read by enabled() without the lock
  int64_t used_ = 0;                  // slots that hold a row: 0 .. used_ - 1
  LazyArray arena_;                   // capacity_ rows
  LazyArray slot_ids_;                // int64 per slot: the row it holds
  LazyArray referenced_;              // uint8 per slot: CLOCK's bit
  LazyArray index_;                   // uint32 entries: open addressing, linear probing
  uint64_t index_size_ = 0;           // entries: 0 or a power of two
  int index_bits_ = 0;
  int64_t hand_ = 0;
};

}  // namespace ple
