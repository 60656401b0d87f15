// A table of fixed-size rows that lives in memory-mapped checkpoint files.
//
// The rows of a table are the concatenation of one or more shards; each shard
// is a contiguous run of rows at some offset of some file.  Files are mapped
// whole, read-only and shared, and advised MADV_RANDOM so that a fault reads
// one page instead of the device's read-ahead window.  The page cache holds
// whatever the gather brought in; only the row cache (when configured) and
// pending prefetches keep copies of rows.  With io "direct" the gathers read
// the files themselves with O_DIRECT (direct_reader.h) and never touch the
// mappings, which stay so that a config can switch back at any time.
//
// A table also holds what its gathers share: its settings (gather_config.h),
// its counters (counters.h), its row cache (row_cache.h) and its prefetches
// (prefetch_queue.h).  Handles to tables: table_registry.h.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "counters.h"
#include "gather_config.h"
#include "io_engines.h"
#include "prefetch_queue.h"
#include "row_cache.h"
#include "row_gather.h"

namespace ple {

// An error of the operating system (open, mmap, ...) that Python sees as OSError.
struct OsError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct MappedFile {
  std::string path;
  int fd = -1;
  uint8_t* base = nullptr;
  uint64_t size = 0;
};

class DirectFiles;

struct Shard {
  const uint8_t* data;  // first byte of the shard's first row
  int64_t rows;
};

class MappedTable {
 public:
  // shard_file[i] indexes paths; shard_offset[i] is the byte offset of shard
  // i's first row in that file.  Every shard but the last has the same number
  // of rows; the caller has checked the layout, this checks the files.
  MappedTable(const std::vector<std::string>& paths,
              const std::vector<int64_t>& shard_file,
              const std::vector<int64_t>& shard_offset,
              const std::vector<int64_t>& shard_rows, int64_t row_bytes);
  ~MappedTable();
  MappedTable(const MappedTable&) = delete;
  MappedTable& operator=(const MappedTable&) = delete;

  int64_t num_rows() const { return num_rows_; }
  int64_t row_bytes() const { return row_bytes_; }

  const uint8_t* row_address(int64_t id) const {
    int64_t shard = id / rows_per_shard_;
    if (shard >= static_cast<int64_t>(shards_.size())) shard = shards_.size() - 1;
    return shards_[shard].data + (id - shard * rows_per_shard_) * row_bytes_;
  }

  // "<file>, byte <offset>" of an address inside one of the table's files.
  std::string locate(uintptr_t address) const;

  // The addresses from the lowest file mapping's first byte to the highest
  // one's end (other mappings may lie between).
  uintptr_t mapped_begin() const { return mapped_begin_; }
  uintptr_t mapped_end() const { return mapped_end_; }

  GatherConfig config() const;
  // Checks `config` (check_config) and sizes the row cache for it; with io
  // "direct", opens the files for direct reads (once; they stay open while
  // the table lives, for the gathers that still read them) and chooses the
  // backend (choose_backend).  Throws, leaving the settings as they were,
  // when any of that fails.
  void set_config(const GatherConfig& config);

  // For io "direct": the files opened with O_DIRECT and the backend that
  // reads them (set by set_config before any config with io "direct").
  const DirectFiles& direct_files() const;
  IoBackend io_backend() const;
  // The block of the direct reads that the config makes; 0 for io "mmap".
  uint64_t io_block_bytes() const;

  // New descriptors (close-on-exec) of the table's files, in paths' order:
  // the files it maps, whatever names they have by now.  The caller closes them.
  std::vector<int> duplicate_file_descriptors() const;

  GatherCounters& counters() { return counters_; }
  RowCache& row_cache() { return row_cache_; }
  GatherScratchPool& scratch_pool() { return scratch_pool_; }

  // The rows `ids` into `out` (see gather_rows, and its `max_threads`),
  // taken from a pending prefetch of the same ids, or of the first of them,
  // when there is one (PrefetchQueue::take; its rows of resident ids are
  // zeros: the caller fills those either way).  A gather of `owner` (not 0)
  // is a forward of the owner's plan, if it has one (PrefetchQueue::take);
  // one that throws ends that plan.
  void gather(const void* ids, bool ids_are_int64, int64_t n, uint8_t* out, ResidentRange resident,
              int64_t max_threads = 0, uint64_t owner = 0);

  // Queues the gather of `ids` for `owner` on the table's prefetch thread;
  // returns its ticket (PrefetchQueue::push).
  uint64_t prefetch(std::vector<int64_t> ids, ResidentRange resident, uint64_t owner);

  // The plan of `owner`'s next gathers (PrefetchQueue::plan, end_plan, planning).
  uint64_t plan_prefetches(uint64_t owner, std::vector<std::vector<int64_t>> chunks,
                           uint64_t max_bytes, ResidentRange resident);
  void end_plan(uint64_t owner, std::optional<uint64_t> plan = std::nullopt);
  bool planning(uint64_t owner, std::optional<uint64_t> plan = std::nullopt);

  // Drops the prefetches of `owner` (all: nullopt), up to ticket `through`,
  // that no gather has taken; returns their bytes (PrefetchQueue::drop_untaken).
  uint64_t drop_prefetches(std::optional<uint64_t> owner = std::nullopt,
                           uint64_t through = UINT64_MAX);

  // The bytes of rows the prefetches of `owner` (all: nullopt) hold
  // (PrefetchQueue::held_bytes).
  uint64_t prefetched_bytes(std::optional<uint64_t> owner = std::nullopt);

  // Drops this table's pages from the page cache: unmaps them from this
  // process, then asks the kernel to forget the files' clean pages.  Pages
  // that another mapping holds stay.  Empties the row cache too.
  void drop_page_cache();

  // Stops the prefetch thread and drops the prefetches not yet gathered
  // (PrefetchQueue::shut_down).  For close: later prefetches do nothing.
  void shut_down();

  // Around fork(): takes the table's locks so that the child gets them in a
  // consistent state, then gives them back (the prefetch queue's too, see
  // PrefetchQueue::unlock_after_fork); in the child, also takes the row
  // cache's pins off (RowCache::drop_pins).
  void lock_for_fork();
  void unlock_after_fork(bool in_child);

 private:
  std::vector<MappedFile> files_;
  std::vector<Shard> shards_;
  int64_t rows_per_shard_ = 0;
  int64_t num_rows_ = 0;
  int64_t row_bytes_ = 0;
  uintptr_t mapped_begin_ = 0, mapped_end_ = 0;
  // One set_config at a time, so that the row cache and config_ in force
  // are always those of the same config (the last one set).
  std::mutex configuring_;
  mutable std::mutex config_mutex_;
  GatherConfig config_;
  std::unique_ptr<DirectFiles> direct_files_;  // made by the first config with io "direct"
  IoBackend io_backend_ = IoBackend::kPread;
  GatherCounters counters_;
  RowCache row_cache_;
  GatherScratchPool scratch_pool_;
  PrefetchQueue prefetch_;  // last: its thread uses the members above
};

}  // namespace ple
