// A table's prefetches: gathers started ahead of the operator call that will
// want their rows (Table.prefetch), run in order on a thread of the table's
// own.  Several may wait: a server enqueues step n's gather on a CUDA stream
// and prefetches step n + 1 before the stream has reached step n.
//
// Each prefetch has an owner (0: nobody's; a layer, or a planner, takes a
// number of its own) and a ticket, increasing in the order of the pushes.
// An owner can ask what its prefetches hold and drop them, and only them:
// the layers of a model that share a table each read ahead for their own
// forwards.
//
// An owner may have a plan: the chunks of ids of its coming gathers (a
// prompt's prefill chunks), read ahead in order while what the owner's
// prefetches hold fits the plan's byte bound.  A plan advances inside the
// gathers themselves, when they run: eagerly on the calling thread, in a
// CUDA stream's host function, on a captured graph's replays.  So a
// compiled or captured forward needs no bookkeeping of its own.  A gather of
// the owner that takes the plan's next chunk (exactly: its ids, and no
// more) lets the next chunks be read; any other gather of the owner (other
// ids, another size) and one that fails end the plan, dropping what it read
// ahead.
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
#include <unordered_map>
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

  // Starts the plan of `owner`: `chunks` are the ids of its next gathers,
  // in order, read ahead while the owner's prefetches hold at most
  // `max_bytes` (at least one chunk: the next).  Ends the owner's plan
  // before, if it has one (end_plan).  `resident`: the tiers' rows, as for
  // push; the chunks read once gathers run take those gathers' own.
  // Returns the plan's number, for end_plan and planning; 0 after
  // shut_down, or without chunks.  Throws std::invalid_argument for a
  // bound outside (0, kMaxPendingBytes].
  uint64_t plan(uint64_t owner, std::vector<std::vector<int64_t>> chunks, uint64_t max_bytes,
                ResidentRange resident);

  // Ends the plan of `owner` when it is plan `plan` (any: nullopt), and
  // then drops the owner's prefetches that no gather has taken, waiting for
  // the one being read (drop_untaken).  With nullopt, drops them even where
  // the owner has no plan.
  void end_plan(uint64_t owner, std::optional<uint64_t> plan = std::nullopt);

  // Whether the owner's plan `plan` (any: nullopt) has chunks to come:
  // read ahead and not yet gathered, or still to be read.
  bool planning(uint64_t owner, std::optional<uint64_t> plan = std::nullopt);

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
  // oldest, those of `owner` first.  Interrupted while it waits: throws
  // Interrupted and leaves the prefetch for a later gather.  When `owner`
  // (not 0) has a plan, the gather is one of its forwards: the plan
  // advances when the prefetch taken is its next chunk and `n` that
  // chunk's size, and ends otherwise; `plan` is set to its number (0: no
  // plan), for ending that plan alone if the gather fails after.
  Taken take(const void* ids, bool ids_are_int64, int64_t n, uint8_t* out,
             ResidentRange resident, Interruption& stop, int64_t& rows_taken,
             uint64_t owner, uint64_t& plan);

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
  // thread, which did not survive the fork, the prefetches not done (the
  // done ones can still be taken) and the plans (their owners' gathers take
  // what they read; end_plan drops the rest).
  void lock_for_fork();
  void unlock_after_fork(bool in_child);

 private:
  // An owner's coming gathers: the chunks still to read, and those read
  // ahead and not yet gathered, by ticket and size.
  struct Plan {
    uint64_t number = 0;
    uint64_t max_bytes = 0;
    std::deque<std::vector<int64_t>> coming;
    std::deque<std::pair<uint64_t, int64_t>> read;  // (ticket, ids)
  };

  // The thread's loop: gathers the queued requests in order.
  void run();
  uint64_t bytes_of(const PrefetchRequest& request) const {
    return request.ids.size() * static_cast<uint64_t>(row_bytes_);
  }
  // push and held_bytes, the lock held (push_locked's caller notifies).
  uint64_t push_locked(std::vector<int64_t> ids, ResidentRange resident, uint64_t owner);
  uint64_t held_locked(std::optional<uint64_t> owner) const;
  // drop_untaken, the lock held by `lock`, which its wait releases meanwhile.
  uint64_t drop_locked(std::unique_lock<std::mutex>& lock, std::optional<uint64_t> owner,
                       uint64_t through);
  // A gather of `owner` (its plan's forward, if it has one) that took
  // `taken` (null: nothing) for `n` ids: the plan advances when that is its
  // next chunk, and ends otherwise (the lock held by `lock`, released while
  // it waits for a read it drops).
  void forward_plan_locked(std::unique_lock<std::mutex>& lock, uint64_t owner,
                           const PrefetchRequest* taken, int64_t n, ResidentRange resident);
  // Pushes the plan's next chunks while they fit its bound (the lock held);
  // a plan left with nothing to come is forgotten.
  void read_ahead_locked(uint64_t owner, ResidentRange resident);
  // Forgets the owner's plan and drops its prefetches (the lock held by
  // `lock`, released while it waits for the one being read).
  void end_plan_locked(std::unique_lock<std::mutex>& lock, uint64_t owner);

  const int64_t row_bytes_;
  const Gather gather_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::shared_ptr<PrefetchRequest>> pending_;
  std::shared_ptr<PrefetchRequest> running_;  // the one the thread reads, until done
  std::unique_ptr<std::thread> worker_;       // started by the first prefetch
  std::unordered_map<uint64_t, Plan> plans_;  // by owner
  uint64_t last_ticket_ = 0, last_plan_ = 0;
  bool stopping_ = false;  // no more prefetches: the table is closing
};

}  // namespace ple
