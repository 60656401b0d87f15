// A table's prefetches: gathers started ahead of the operator call that will
// want their rows (Table.prefetch), run in order on a thread of the table's
// own.  Several may wait: a server enqueues step n's gather on a CUDA stream
// and prefetches step n + 1 before the stream has reached step n.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "interrupt.h"
#include "row_gather.h"

namespace ple {

// A gather started ahead of the operator call that will want its rows.
struct PrefetchRequest {
  std::vector<int64_t> ids;
  ResidentRange resident;
  std::vector<uint8_t> rows;  // filled by the prefetch thread
  bool started = false, done = false;
  bool taken = false;  // a gather waits for it
  std::exception_ptr error;
};

class PrefetchQueue {
 public:
  // Gathers `ids` into `out` (ids.size() rows of row_bytes), leaving the
  // resident ones, on the prefetch thread; `stop` is cancelled by shut_down.
  using Gather = std::function<void(const std::vector<int64_t>& ids, ResidentRange resident,
                                    uint8_t* out, Interruption& stop)>;

  // What take found.
  enum class Taken {
    kNothingPending,  // no prefetch was waiting
    kMissed,          // prefetches of other ids only, or the one of these ids failed
    kHit,             // the rows were copied out
  };

  // The rows that prefetches not yet taken may hold: layers of a model that
  // share a table each prefetch their own rows for the next step.
  static constexpr uint64_t kMaxPendingBytes = 256ull << 20;

  PrefetchQueue(int64_t row_bytes, Gather gather);
  ~PrefetchQueue();
  PrefetchQueue(const PrefetchQueue&) = delete;
  PrefetchQueue& operator=(const PrefetchQueue&) = delete;

  // Queues the gather of `ids` after the prefetches queued before it; its
  // rows wait for take.  When the prefetches not taken would hold more than
  // kMaxPendingBytes of rows, the oldest are dropped (the newest is always
  // kept).  The thread starts with the first prefetch.  After shut_down,
  // does nothing.
  void push(std::vector<int64_t> ids, ResidentRange resident);

  // When a pending prefetch is of exactly these ids: waits for it (and for
  // those queued before it) and copies its rows to `out`.  Interrupted while
  // it waits: throws Interrupted and leaves the prefetch for a later gather.
  Taken take(const void* ids, bool ids_are_int64, int64_t n, uint8_t* out,
             ResidentRange resident, Interruption& stop);

  // Drops the prefetches that no gather has taken (a lookahead that ended),
  // cancelling and waiting for the one the thread runs when it is one of
  // them, so that no read of theirs runs after it returns.  Taken ones stay
  // for the gathers that wait for them.
  void drop_untaken();

  // Stops the thread (cancelling the gather it runs) and drops the
  // prefetches not yet gathered; gathers waiting for one gather their rows
  // themselves.
  void shut_down();

  // Around fork(): takes the queue's lock so that the child gets it in a
  // consistent state, then gives it back; in the child, also forgets the
  // thread, which did not survive the fork, and the prefetches not done (the
  // done ones can still be taken).
  void lock_for_fork();
  void unlock_after_fork(bool in_child);

 private:
  // The thread's loop: gathers the queued requests in order.
  void run();

  const int64_t row_bytes_;
  const Gather gather_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::shared_ptr<PrefetchRequest>> pending_;
  std::unique_ptr<std::thread> worker_;  // started by the first prefetch
  bool stopping_ = false;                // no more prefetches: the table is closing
  std::atomic<bool> cancel_{false};      // stops the gather of the running one
};

}  // namespace ple
