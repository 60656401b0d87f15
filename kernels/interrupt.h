// Stopping a gather before its end: a signal that the thread which started it
// must handle (Ctrl-C in Python), or a table closed under its prefetch.
//
// The native part knows nothing of Python: the thread that starts a gather
// may set a poll function (ScopedPoll) that the gather calls now and then on
// that thread alone (never on the pool's threads, never on a CUDA host
// function's), and that says whether to stop.  While a poll runs, the
// gather's turn at the worker pool holds no other gather back
// (YieldedTurn, worker_pool.h): a poll may wait for other threads.  Another thread may cancel a
// gather through a flag.  Either way every thread of the gather sees it
// within kCheckRows rows and the gather throws Interrupted.
#pragma once

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

namespace ple {

// Thrown out of a gather that was asked to stop.
struct Interrupted : std::runtime_error {
  Interrupted() : std::runtime_error("the gather was interrupted") {}
};

// Returns true when the gather that polls should stop.
using PollFunction = bool (*)();

// Sets the poll function of the calling thread for its life.
class ScopedPoll {
 public:
  explicit ScopedPoll(PollFunction poll);
  ~ScopedPoll();
  ScopedPoll(const ScopedPoll&) = delete;
  ScopedPoll& operator=(const ScopedPoll&) = delete;

 private:
  PollFunction previous_;
};

// How often the thread that started a gather polls, by default: a poll takes
// the GIL, which another Python thread may hold for a few ms.
constexpr auto kPollInterval = std::chrono::milliseconds(50);

// The poll interval of the gathers that start from now on (kPollInterval
// until set).  0 polls at every check, so that a signal already pending when
// a gather starts is handled at its first check, inside the gather: tests
// make their case with it, whatever the machine's speed.
std::chrono::nanoseconds poll_interval();
void set_poll_interval(std::chrono::nanoseconds interval);

// One gather's stop state, shared by its threads.
class Interruption {
 public:
  // Takes the poll function of the calling thread (if it has one);
  // `cancelled`, when not null, is a flag that another thread may set.
  explicit Interruption(const std::atomic<bool>* cancelled = nullptr);

  // Throws Interrupted when the gather should stop; on the thread that made
  // this object, polls first when the poll interval has passed since this
  // object was made or last polled.
  void check();
  // Like check, but records the request to stop instead of throwing (for a
  // thread that waits for others and must not leave before they are done).
  void poll_if_due();
  bool stop_requested() const {
    return stopped_.load(std::memory_order_relaxed) ||
           (cancelled_ != nullptr && cancelled_->load(std::memory_order_relaxed));
  }
  // Throws Interrupted when stop was requested: a gather that a poll asked
  // to stop must not return as if it had not been.
  void throw_if_stopped() const {
    if (stop_requested()) throw Interrupted();
  }

 private:
  const std::atomic<bool>* cancelled_;
  PollFunction poll_;
  std::thread::id owner_;
  std::chrono::nanoseconds interval_;
  std::chrono::steady_clock::time_point next_poll_;  // the owner's alone
  std::atomic<bool> stopped_{false};
};

}  // namespace ple
