// A table of fixed-size rows that lives in memory-mapped checkpoint files.
//
// The rows of a table are the concatenation of one or more shards; each shard
// is a contiguous run of rows at some offset of some file.  Files are mapped
// whole, read-only and shared, and advised MADV_RANDOM so that a fault reads
// one page instead of the device's read-ahead window.  The page cache holds
// whatever the gather brought in; only the row cache (when configured) and
// pending prefetches keep copies of rows.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "interrupt.h"
#include "row_cache.h"

namespace ple {

// An error of the operating system (open, mmap, ...) that Python sees as OSError.
struct OsError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class Policy { kWindow, kDistance, kAll, kNone };

// The most threads a gather may run on (ple.config.MAX_THREADS says the same).
constexpr int kMaxThreads = 256;

Policy parse_policy(const std::string& name);

struct GatherConfig {
  Policy policy = Policy::kWindow;
  uint64_t window_bytes = 4096 * 1024;
  int threads = 1;
  uint64_t row_cache_bytes = 0;
};

// The rows [begin, end) that the device and host tiers hold: the gather
// leaves them to its caller.
struct RowRange {
  int64_t begin = 0, end = 0;
  bool contains(int64_t id) const { return id >= begin && id < end; }
  bool operator==(const RowRange& other) const { return begin == other.begin && end == other.end; }
};

struct MappedFile {
  std::string path;
  int fd = -1;
  uint8_t* base = nullptr;
  uint64_t size = 0;
};

struct Shard {
  const uint8_t* data;  // first byte of the shard's first row
  int64_t rows;
};

// Cumulative counters of every gather on a table; see README "Counters".
struct GatherCounters {
  std::atomic<uint64_t> calls{0}, rows{0}, unique_pages{0}, advised_pages{0},
      resident_pages{0}, evicted_before_copy{0}, max_advised_ahead_bytes{0},
      major_faults{0}, minor_faults{0}, gather_ns{0}, prefetch_hits{0},
      prefetch_misses{0}, row_cache_hits{0}, row_cache_misses{0};

  // By name; bytes_copied is derived (rows x row_bytes).
  std::map<std::string, uint64_t> snapshot(int64_t row_bytes) const;
  void reset();
};

// A gather started ahead of the operator call that will want its rows.
struct PrefetchRequest {
  std::vector<int64_t> ids;
  RowRange resident;
  std::vector<uint8_t> rows;  // filled by the prefetch thread
  bool started = false, done = false;
  bool taken = false;  // a gather waits for it
  std::exception_ptr error;
};

// Prefetches not yet taken, gathered in order on a thread of the table's
// own.  Several may wait: a server enqueues step n's gather on a CUDA stream
// and prefetches step n + 1 before the stream has reached step n.
struct PrefetchQueue {
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<std::shared_ptr<PrefetchRequest>> pending;
  std::unique_ptr<std::thread> worker;  // started by the first prefetch
  bool stopping = false;                // no more prefetches: the table is closing
  std::atomic<bool> cancel{false};      // stops the gather of the running one
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

  GatherConfig config() const;
  void set_config(const GatherConfig& config);

  GatherCounters& counters() { return counters_; }
  RowCache& row_cache() { return row_cache_; }

  // The rows `ids` into `out` (see gather_rows), taken from a pending
  // prefetch of the same ids when there is one (whose rows of resident ids
  // are zeros: the caller fills those either way).
  void gather(const void* ids, bool ids_are_int64, int64_t n, uint8_t* out, RowRange resident);

  // Queues the gather of `ids` on the table's prefetch thread, after the
  // prefetches queued before it; the rows wait for take_prefetched.  When the
  // prefetches not taken would hold more than kMaxPendingPrefetchBytes of
  // rows, the oldest are dropped (the newest is always kept).
  void prefetch(std::vector<int64_t> ids, RowRange resident);

  // When a pending prefetch is of exactly these ids: waits for it (and for
  // those queued before it), copies its rows to `out` and returns true.
  // Otherwise returns false.  Interrupted while it waits: throws Interrupted
  // and leaves the prefetch for a later gather.
  bool take_prefetched(const void* ids, bool ids_are_int64, int64_t n, uint8_t* out,
                       RowRange resident, Interruption& stop);

  // Drops this table's pages from the page cache: unmaps them from this
  // process, then asks the kernel to forget the files' clean pages.  Pages
  // that another mapping holds stay.  Empties the row cache too.
  void drop_page_cache();

  // Stops the prefetch thread (cancelling the gather it runs) and drops the
  // prefetches not yet gathered; gathers waiting for one gather their rows
  // themselves.  For close: later prefetches do nothing.
  void shut_down();

  // Around fork(): takes the table's locks so that the child gets them in a
  // consistent state, then gives them back; in the child, also forgets the
  // prefetch thread, which did not survive the fork, and the prefetches not
  // done (the done ones can still be taken).
  void lock_for_fork();
  void unlock_after_fork(bool in_child);

 private:
  // The prefetch thread's loop: gathers the queued requests in order.
  void run_prefetches();

  std::vector<MappedFile> files_;
  std::vector<Shard> shards_;
  int64_t rows_per_shard_ = 0;
  int64_t num_rows_ = 0;
  int64_t row_bytes_ = 0;
  mutable std::mutex config_mutex_;
  GatherConfig config_;
  GatherCounters counters_;
  RowCache row_cache_;
  PrefetchQueue prefetch_;
};

// Tables are reached from Python and from operators by an integer handle.  A
// gather holds a shared_ptr, so closing a table while it is being gathered
// from only unmaps it when that gather is done.  Unregistering shuts the
// table's prefetches down (MappedTable::shut_down) at once.  A forked child
// inherits every table registered at the fork, usable as in the parent.
int64_t register_table(std::shared_ptr<MappedTable> table);
std::shared_ptr<MappedTable> find_table(int64_t handle);  // throws if unknown
void unregister_table(int64_t handle);

// Copies the rows `ids` (int32 or int64, n of them) into `out`, row i of the
// request at out + i * row_bytes.  Validates every id before writing.  Ids
// in `resident` live in the device and host tiers, which the caller reads:
// their rows in `out` are left as they were, and they are not counted.
// `use_row_cache`: look the rows up in the row cache and keep the ones read
// (false for rows that are about to become resident).  `stop` can end the
// gather early with Interrupted (`out` is then partly written).
void gather_rows(MappedTable& table, const void* ids, bool ids_are_int64,
                 int64_t n, uint8_t* out, RowRange resident, bool use_row_cache,
                 Interruption& stop);

}  // namespace ple
