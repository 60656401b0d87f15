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
// row).  A full cache of rows of B bytes takes about B + 21 to 29 bytes a row.
//
// A prefetch holds the rows it read ahead in the cache, pinned, until the
// gather that takes them (PinnedRows): a pinned slot is never evicted, so the
// rows of coming chunks survive the chunks gathered meanwhile without a copy
// of their own.  At most half the slots are pinned at once (the CLOCK hand
// then always finds a slot to evict within two turns); a row that finds no
// slot to pin stays in its prefetch's own buffer.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

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

  // Pinning (with mutex() held, like lookup and insert).  A pin is of one
  // generation of the cache: configure and clear start another, in which
  // the earlier pins are gone.
  uint64_t generation() const { return generation_; }
  // The slot of row `id`, pinned, when the cache holds it and `generation`
  // is the cache's; -1 otherwise, or when the pins are at their bound.
  int64_t pin(int64_t id, uint64_t generation);
  // insert, then pin: the slot, or -1 where pin gives -1 (the row may still
  // have been cached, unpinned).
  int64_t insert_pinned(int64_t id, const uint8_t* row, uint64_t generation);
  // Copies the row of a slot pinned in `generation` and takes the pin off;
  // false (nothing copied) when the cache has started another generation.
  bool take_pinned(int64_t slot, uint64_t generation, uint8_t* out);
  void unpin(int64_t slot, uint64_t generation);
  // Slots pinned now (at most half the slots).
  int64_t pinned_slots() const { return pinned_slots_; }
  // Takes every pin off and starts another generation: in a forked child,
  // the prefetches that held pins were on the parent's threads, which the
  // child does not have, so nothing would ever give them back.
  void drop_pins();

 private:
  // Where id is, or would go, in the index: a position whose entry is its
  // slot + 1, or 0.
  uint64_t find(int64_t id) const;
  uint64_t home(int64_t id) const;
  void erase_at(uint64_t position);  // backward-shift deletion: no tombstones
  bool grow_index();
  void forget_rows();  // empties the slots; the mappings stay
  int64_t pin_slot(int64_t slot);  // the slot pinned, or -1 at the bound

  std::mutex mutex_;
  int64_t row_bytes_ = 0;
  std::atomic<int64_t> capacity_{0};  // rows; read by enabled() without the lock
  int64_t used_ = 0;                  // slots that hold a row: 0 .. used_ - 1
  LazyArray arena_;                   // capacity_ rows
  LazyArray slot_ids_;                // int64 per slot: the row it holds
  LazyArray referenced_;              // uint8 per slot: CLOCK's bit
  LazyArray pins_;                    // uint32 per slot: prefetches that hold it
  int64_t pinned_slots_ = 0;          // slots whose pins are not 0
  uint64_t generation_ = 0;           // counts configure and clear calls
  LazyArray index_;                   // uint32 entries: open addressing, linear probing
  uint64_t index_size_ = 0;           // entries: 0 or a power of two
  int index_bits_ = 0;
  int64_t hand_ = 0;
};

// The rows of one prefetch, until a gather takes them or the prefetch is
// dropped: by position, a slot pinned in the row cache, or a row of its own
// buffer (rows of resident ids are neither: the caller fills those).
class PinnedRows {
 public:
  PinnedRows() = default;
  ~PinnedRows() { release(); }
  PinnedRows(const PinnedRows&) = delete;
  PinnedRows& operator=(const PinnedRows&) = delete;

  // Starts holding `n` rows of `row_bytes` for `cache` (null: no row cache,
  // every row in the buffer), in the cache's current generation.  Returns
  // the buffer of n rows that the prefetch's gather writes the rows it reads
  // into, at their positions (keep() then keeps only those not pinned).
  uint8_t* start(RowCache* cache, int64_t n, int64_t row_bytes);
  RowCache* cache() const { return cache_; }
  uint64_t generation() const { return generation_; }
  // Position `position`'s row is in pinned `slot` (cache lock held).
  void hold(int64_t position, int64_t slot) { where_[position] = slot; }
  // Once the gather is done: keeps in the buffer the rows of positions that
  // hold no slot and whose ids (`ids`) lie outside the resident rows
  // [resident_begin, resident_end), and frees the rest.
  void keep(const int64_t* ids, int64_t resident_begin, int64_t resident_end);
  // Copies the rows to `out` (n rows; positions of resident ids are left as
  // they are) and gives the pins back.  False where the row cache started
  // another generation since (configured, or cleared): its slots are gone,
  // and the caller gathers the rows itself.
  bool take(uint8_t* out);
  // Gives the pins back and frees the buffer (a prefetch dropped or failed).
  void release();
  // The positions whose rows are pinned in the row cache.
  int64_t pinned() const;
  // What it holds outside the row cache: the buffer and its positions.
  uint64_t own_bytes() const { return buffer_.capacity() + where_.capacity() * sizeof(int64_t); }

 private:
  // where_: a slot (>= 0), a resident id's position, a position the gather
  // has not pinned (until keep), or the k-th row of the buffer (own(k)).
  static constexpr int64_t kResident = -1;
  static constexpr int64_t kNotPinned = INT64_MIN;
  static int64_t own(int64_t k) { return -2 - k; }

  RowCache* cache_ = nullptr;
  uint64_t generation_ = 0;
  int64_t row_bytes_ = 0;
  std::vector<int64_t> where_;
  std::vector<uint8_t> buffer_;
};

}  // namespace ple
