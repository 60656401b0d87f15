#include "interrupt.h"

#include "worker_pool.h"

namespace ple {

namespace {

thread_local PollFunction thread_poll = nullptr;

std::atomic<int64_t> poll_interval_ns{
    std::chrono::duration_cast<std::chrono::nanoseconds>(kPollInterval).count()};

}  // namespace

std::chrono::nanoseconds poll_interval() {
  return std::chrono::nanoseconds(poll_interval_ns.load(std::memory_order_relaxed));
}

void set_poll_interval(std::chrono::nanoseconds interval) {
  poll_interval_ns.store(interval.count(), std::memory_order_relaxed);
}

ScopedPoll::ScopedPoll(PollFunction poll) : previous_(thread_poll) { thread_poll = poll; }

ScopedPoll::~ScopedPoll() { thread_poll = previous_; }

Interruption::Interruption(const std::atomic<bool>* cancelled)
    : cancelled_(cancelled),
      poll_(thread_poll),
      owner_(std::this_thread::get_id()),
      interval_(poll_interval()),
      next_poll_(std::chrono::steady_clock::now() + interval_) {}

void Interruption::poll_if_due() {
  if (poll_ == nullptr || stopped_.load(std::memory_order_relaxed) ||
      std::this_thread::get_id() != owner_) {
    return;
  }
  const auto now = std::chrono::steady_clock::now();
  if (now < next_poll_) return;
  {
    // A poll may wait for anything (a Python signal handler that joins a
    // gathering thread): no other gather waits for this one's turn at the
    // pool meanwhile.
    YieldedTurn yielded;
    if (poll_()) stopped_.store(true, std::memory_order_relaxed);
  }
  next_poll_ = std::chrono::steady_clock::now() + interval_;
}

void Interruption::check() {
  poll_if_due();
  throw_if_stopped();
}

}  // namespace ple
