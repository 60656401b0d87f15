#include "prefetch_queue.h"

#include <pthread.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <utility>

namespace ple {

PrefetchQueue::PrefetchQueue(int64_t row_bytes, Gather gather)
    : row_bytes_(row_bytes), gather_(std::move(gather)) {}

PrefetchQueue::~PrefetchQueue() { shut_down(); }

void PrefetchQueue::shut_down() {
  std::unique_ptr<std::thread> worker;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    for (const auto& request : pending_) request->cancel.store(true);
    if (running_ != nullptr) running_->cancel.store(true);
    worker = std::move(worker_);
  }
  changed_.notify_all();
  if (worker != nullptr && worker->joinable()) worker->join();
  // What was not gathered will not be: its gathers read their rows themselves.
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& request : pending_) {
    if (!request->done) {
      request->error = std::make_exception_ptr(Interrupted());
      request->done = true;
    }
  }
  changed_.notify_all();
}

uint64_t PrefetchQueue::drop_untaken(std::optional<uint64_t> owner, uint64_t through) {
  std::unique_lock<std::mutex> lock(mutex_);
  std::shared_ptr<PrefetchRequest> running;
  uint64_t dropped = 0;
  for (auto it = pending_.begin(); it != pending_.end();) {
    const PrefetchRequest& request = **it;
    if (request.taken || (owner && request.owner != *owner) || request.ticket > through) {
      ++it;
      continue;
    }
    if (request.started && !request.done) running = *it;
    dropped += bytes_of(request);
    it = pending_.erase(it);  // out of the queue, no gather can take it now
  }
  // One that push dropped while the thread read it is still being read.
  if (running_ != nullptr && !running_->taken && (!owner || running_->owner == *owner) &&
      running_->ticket <= through) {
    running = running_;
  }
  if (running != nullptr) {
    running->cancel.store(true);
    changed_.wait(lock, [&] { return running->done; });
  }
  return dropped;
}

uint64_t PrefetchQueue::held_bytes(std::optional<uint64_t> owner) {
  std::lock_guard<std::mutex> lock(mutex_);
  uint64_t held = 0;
  for (const auto& request : pending_) {
    if (!request->taken && (!owner || request->owner == *owner)) held += bytes_of(*request);
  }
  // A running one that push dropped holds its rows until its gather stops.
  if (running_ != nullptr && (!owner || running_->owner == *owner) &&
      std::find(pending_.begin(), pending_.end(), running_) == pending_.end()) {
    held += bytes_of(*running_);
  }
  return held;
}

void PrefetchQueue::lock_for_fork() { mutex_.lock(); }

void PrefetchQueue::unlock_after_fork(bool in_child) {
  if (in_child) {
    // The thread is the parent's: the child neither joins it nor waits for it.
    (void)worker_.release();
    running_.reset();
    // The condition variable counts the parent's waiters, which the child
    // would wait for: a new one replaces it (the old one is not destroyed,
    // which would wait for them too).
    new (&changed_) std::condition_variable;
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                  [](const auto& request) { return !request->done || request->taken; }),
                   pending_.end());
  }
  mutex_.unlock();
}

uint64_t PrefetchQueue::push(std::vector<int64_t> ids, ResidentRange resident, uint64_t owner) {
  auto request = std::make_shared<PrefetchRequest>();
  request->ids = std::move(ids);
  request->resident = resident;
  request->owner = owner;
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return 0;
    if (worker_ == nullptr) worker_ = std::make_unique<std::thread>([this] { run(); });
    ticket = request->ticket = ++last_ticket_;
    uint64_t held = bytes_of(*request);
    for (const auto& queued : pending_) held += queued->taken ? 0 : bytes_of(*queued);
    // Oldest first; a running one is cancelled (no gather can take it now).
    for (auto it = pending_.begin(); held > kMaxPendingBytes && it != pending_.end();) {
      if ((*it)->taken) {
        ++it;
        continue;
      }
      held -= bytes_of(**it);
      (*it)->cancel.store(true);
      it = pending_.erase(it);
    }
    pending_.push_back(std::move(request));
  }
  changed_.notify_all();
  return ticket;
}

void PrefetchQueue::run() {
  ::pthread_setname_np(::pthread_self(), "ple-prefetch");  // told apart from torch's in profiles
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    std::shared_ptr<PrefetchRequest> next;
    changed_.wait(lock, [&] {
      for (const auto& request : pending_) {
        if (!request->started) {
          next = request;
          break;
        }
      }
      return stopping_ || next != nullptr;
    });
    if (stopping_) return;
    next->started = true;
    running_ = next;
    lock.unlock();
    std::exception_ptr error;
    try {
      Interruption stop(&next->cancel);
      gather_(next->ids, next->resident, next->rows, stop);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    next->error = error;
    next->done = true;
    running_.reset();
    if (error || std::find(pending_.begin(), pending_.end(), next) == pending_.end()) {
      next->rows.release();  // failed, or dropped while it ran: nobody takes its rows
    }
    changed_.notify_all();
  }
}

PrefetchQueue::Taken PrefetchQueue::take(const void* ids, bool ids_are_int64, int64_t n,
                                         uint8_t* out, ResidentRange resident, Interruption& stop,
                                         int64_t& rows_taken) {
  rows_taken = 0;
  // Whether a prefetch's ids (int64) are the first of the request's; a
  // request of int32 ids is compared value by value.
  auto leads = [&](const std::vector<int64_t>& queued) {
    const auto m = static_cast<int64_t>(queued.size());
    if (m == 0 || m > n) return false;
    if (ids_are_int64) return std::memcmp(queued.data(), ids, m * sizeof(int64_t)) == 0;
    const auto* narrow = static_cast<const int32_t*>(ids);
    return std::equal(queued.begin(), queued.end(), narrow);
  };
  std::unique_lock<std::mutex> lock(mutex_);
  bool others = false;
  std::shared_ptr<PrefetchRequest> request;
  for (const auto& queued : pending_) {
    if (queued->taken) continue;
    if (queued->resident == resident && leads(queued->ids)) {
      if (request == nullptr || queued->ids.size() > request->ids.size()) request = queued;
    } else {
      others = true;
    }
  }
  if (request == nullptr) return others ? Taken::kMissed : Taken::kNothingPending;
  request->taken = true;  // nobody drops it now: the worker will get to it
  while (!changed_.wait_for(lock, kPollInterval, [&] { return request->done; })) {
    lock.unlock();
    try {
      stop.check();
    } catch (...) {
      lock.lock();
      request->taken = false;  // a later gather of these ids may take it
      throw;
    }
    lock.lock();
  }
  pending_.erase(std::find(pending_.begin(), pending_.end(), request));
  lock.unlock();
  // The caller's own gather raises the error, or reads rows whose pins the
  // row cache lost (configured or cleared meanwhile).
  if (request->error || !request->rows.take(out)) return Taken::kMissed;
  rows_taken = static_cast<int64_t>(request->ids.size());
  return Taken::kHit;
}

}  // namespace ple
