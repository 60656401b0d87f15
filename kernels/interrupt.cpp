#include "interrupt.h"

#include "worker_pool.h"

namespace ple {

namespace {

thread_local PollFunction thread_poll = nullptr;

}  // namespace

ScopedPoll::ScopedPoll(PollFunction poll) : previous_(thread_poll) { thread_poll = poll; }

ScopedPoll::~ScopedPoll() { thread_poll = previous_; }

Interruption::Interruption(const std::atomic<bool>* cancelled)
    : cancelled_(cancelled),
      poll_(thread_poll),
      owner_(std::this_thread::get_id()),
      next_poll_(std::chrono::steady_clock::now() + kPollInterval) {}

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
  next_poll_ = std::chrono::steady_clock::now() + kPollInterval;
}

void Interruption::check() {
  poll_if_due();
  throw_if_stopped();
}

}  // namespace ple
