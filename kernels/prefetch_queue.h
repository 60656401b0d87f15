// A table's prefetches: gathers started ahead of the operator call that will
// want their rows (Table.prefetch), run in order on a thread of the table's
// own.  Several may wait: a server enqueues step n's gather on a CUDA stream
// and prefetches step n + 1 before the stream has reached step n.
//
// Each prefetch has an owner (0: nobody's; a lookahead plan takes a number
// of its own) and a ticket, increasing in the order of the pushes.  An
// owner can ask what its prefetches hold and drop them, and only them: the
// layers of a model that share a table each read ahead for their own
// forwards.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "interrupt.h"
#include "row_cache.h"
#include "row_gather.h"

namespace ple {

// A gather started ahead of the operator call that will want its rows.
struct PrefetchRequest {
  std::vector<int64_t> ids;
  ResidentRange resident;
  uint64_t owner = 0, ticket = 0;
  PinnedRows rows;  // filled by the prefetch thread
  bool started = false, done = false;
  bool taken = false;  // a gather waits for it
  std::atomic<bool> cancel{false};  // stops its gather: dropped, or the queue shut down
  std::exception_ptr error;
};

class PrefetchQueue {
 public:
  // Gathers `ids` into `into` (prefetch_rows: pinned in the row cache, or
  // in its own buffer), leaving the resident ones, on the prefetch thread;
  // `stop` is cancelled when the prefetch is dropped or the queue shut down.
  using Gather = std::function<void(const std::vector<int64_t>& ids, ResidentRange resident,
                                    PinnedRows& into, Interruption& stop)>;

  // What take found.
  enum class Taken {
    kNothingPending,  // no prefetch was waiting
    kMissed,          // prefetches of other ids only, or the one of these ids failed
    kHit,             // the rows of the prefetch's ids were copied out
  };

  // The rows that prefetches not yet taken may hold: layers of a model that
  // share a table each prefetch their own rows for the next step.
  static constexpr uint64_t kMaxPendingBytes = 256ull << 20;

  PrefetchQueue(int64_t row_bytes, Gather gather);
  ~PrefetchQueue();
  PrefetchQueue(const PrefetchQueue&) = delete;
  PrefetchQueue& operator=(const PrefetchQueue&) = delete;

  // Queues the gather of `ids` for `owner` after the prefetches queued
  // before it; its rows wait for take.  When the prefetches not taken would
  // hold more than kMaxPendingBytes of rows, the oldest are dropped (the
  // newest is always kept).  The thread starts with the first prefetch.
  // Returns the prefetch's ticket; after shut_down, does nothing and
  // returns 0.
  uint64_t push(std::vector<int64_t> ids, ResidentRange resident, uint64_t owner);

  // When a pending prefetch's ids are the first of these ids (all of them,
  // or the first ones of a request padded after them, as a CUDA graph pads
  // its batch): waits for it (and for those queued before it) and copies its
  // rows to the start of `out`, setting `rows_taken` to their count; the
  // caller gathers the rest.  Of several, the one of the most ids, then the
  // oldest.  Interrupted while it waits: throws Interrupted and leaves the
  // prefetch for a later gather.
  Taken take(const void* ids, bool ids_are_int64, int64_t n, uint8_t* out,
             ResidentRange resident, Interruption& stop, int64_t& rows_taken);

  // Drops the prefetches of `owner` (every owner's: nullopt) that no gather
  // has taken and whose ticket is at most `through`, cancelling and waiting
  // for the one the thread runs when it is one of them, so that no read of
  // theirs runs after it returns.  Taken ones stay for the gathers that wait
  // for them.  Returns the bytes of rows the dropped ones were to hold.
  uint64_t drop_untaken(std::optional<uint64_t> owner = std::nullopt,
                        uint64_t through = UINT64_MAX);

  // The bytes of rows that the prefetches of `owner` (every owner's:
  // nullopt) that no gather has taken hold, or will hold once read: those
  // waiting, being read, or read.  (A taken one is its gather's, freed once
  // copied out.)
  uint64_t held_bytes(std::optional<uint64_t> owner = std::nullopt);

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
  uint64_t bytes_of(const PrefetchRequest& request) const {
    return request.ids.size() * static_cast<uint64_t>(row_bytes_);
  }

  const int64_t row_bytes_;
  const Gather gather_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::shared_ptr<PrefetchRequest>> pending_;
  std::shared_ptr<PrefetchRequest> running_;  // the one the thread reads, until done
  std::unique_ptr<std::thread> worker_;       // started by the first prefetch
  uint64_t last_ticket_ = 0;
  bool stopping_ = false;  // no more prefetches: the table is closing
};

}  // namespace ple
