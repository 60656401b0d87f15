#include "prefetch_queue.h"

#include <pthread.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
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
    plans_.clear();
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
  return drop_locked(lock, owner, through);
}

uint64_t PrefetchQueue::drop_locked(std::unique_lock<std::mutex>& lock,
                                    std::optional<uint64_t> owner, uint64_t through) {
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
  return held_locked(owner);
}

uint64_t PrefetchQueue::held_locked(std::optional<uint64_t> owner) const {
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

uint64_t PrefetchQueue::plan(uint64_t owner, std::vector<std::vector<int64_t>> chunks,
                             uint64_t max_bytes, ResidentRange resident) {
  if (max_bytes == 0 || max_bytes > kMaxPendingBytes) {
    throw std::invalid_argument("a plan's bound is more than 0 and at most " +
                                std::to_string(kMaxPendingBytes) + " bytes, not " +
                                std::to_string(max_bytes));
  }
  std::unique_lock<std::mutex> lock(mutex_);
  // Another thread may plan for the owner while this one waits for a read
  // of the plan it ends: the two never hold rows together.
  do {
    end_plan_locked(lock, owner);
  } while (plans_.count(owner) != 0);
  if (stopping_ || chunks.empty()) return 0;
  Plan& plan = plans_[owner];
  plan.number = ++last_plan_;
  plan.max_bytes = max_bytes;
  for (auto& chunk : chunks) plan.coming.push_back(std::move(chunk));
  const uint64_t number = plan.number;
  read_ahead_locked(owner, resident);
  lock.unlock();
  changed_.notify_all();
  return number;
}

void PrefetchQueue::end_plan(uint64_t owner, std::optional<uint64_t> plan) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (plan) {
    auto it = plans_.find(owner);
    if (it == plans_.end() || it->second.number != *plan) return;
  }
  end_plan_locked(lock, owner);
}

bool PrefetchQueue::planning(uint64_t owner, std::optional<uint64_t> plan) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = plans_.find(owner);
  return it != plans_.end() && (!plan || it->second.number == *plan);
}

void PrefetchQueue::end_plan_locked(std::unique_lock<std::mutex>& lock, uint64_t owner) {
  plans_.erase(owner);
  drop_locked(lock, owner, UINT64_MAX);
}

void PrefetchQueue::forward_plan_locked(std::unique_lock<std::mutex>& lock, uint64_t owner,
                                        const PrefetchRequest* taken, int64_t n,
                                        ResidentRange resident) {
  auto it = plans_.find(owner);
  if (it == plans_.end()) return;
  auto& read = it->second.read;  // never empty: a plan with nothing read is gone
  if (taken == nullptr || taken->owner != owner || taken->ticket != read.front().first ||
      n != read.front().second) {
    end_plan_locked(lock, owner);  // other ids, or another size: not the plan's forward
    return;
  }
  read.pop_front();
  try {
    read_ahead_locked(owner, resident);
  } catch (const std::exception&) {
    // No memory for the next chunk: the plan ends, and the gather goes on.
    end_plan_locked(lock, owner);
  }
  changed_.notify_all();
}

void PrefetchQueue::read_ahead_locked(uint64_t owner, ResidentRange resident) {
  auto it = plans_.find(owner);
  if (it == plans_.end()) return;
  Plan& plan = it->second;
  while (!plan.coming.empty()) {
    const uint64_t held = held_locked(owner);
    const uint64_t bytes = plan.coming.front().size() * static_cast<uint64_t>(row_bytes_);
    if (held != 0 && held + bytes > plan.max_bytes) break;
    const auto n = static_cast<int64_t>(plan.coming.front().size());
    const uint64_t ticket = push_locked(std::move(plan.coming.front()), resident, owner);
    plan.coming.pop_front();
    if (ticket == 0) {  // shutting down
      plan.coming.clear();
      break;
    }
    plan.read.emplace_back(ticket, n);
  }
  if (plan.read.empty()) plans_.erase(it);
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
    plans_.clear();
  }
  mutex_.unlock();
}

uint64_t PrefetchQueue::push(std::vector<int64_t> ids, ResidentRange resident, uint64_t owner) {
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ticket = push_locked(std::move(ids), resident, owner);
  }
  if (ticket != 0) changed_.notify_all();
  return ticket;
}

uint64_t PrefetchQueue::push_locked(std::vector<int64_t> ids, ResidentRange resident,
                                    uint64_t owner) {
  if (stopping_) return 0;
  auto request = std::make_shared<PrefetchRequest>();
  request->ids = std::move(ids);
  request->resident = resident;
  request->owner = owner;
  if (worker_ == nullptr) worker_ = std::make_unique<std::thread>([this] { run(); });
  const uint64_t ticket = request->ticket = ++last_ticket_;
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
                                         int64_t& rows_taken, uint64_t owner, uint64_t& plan) {
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
  // Of two that lead the request: the owner's, then the one of more ids.
  auto better = [&](const PrefetchRequest& a, const PrefetchRequest& b) {
    const bool a_own = owner != 0 && a.owner == owner, b_own = owner != 0 && b.owner == owner;
    if (a_own != b_own) return a_own;
    return a.ids.size() > b.ids.size();
  };
  std::unique_lock<std::mutex> lock(mutex_);
  const auto owners_plan = owner == 0 ? plans_.end() : plans_.find(owner);
  plan = owners_plan == plans_.end() ? 0 : owners_plan->second.number;
  bool others = false;
  std::shared_ptr<PrefetchRequest> request;
  for (const auto& queued : pending_) {
    if (queued->taken) continue;
    if (queued->resident == resident && leads(queued->ids)) {
      if (request == nullptr || better(*queued, *request)) request = queued;
    } else {
      others = true;
    }
  }
  if (request != nullptr) request->taken = true;  // nobody drops it now: the worker will get to it
  if (plan != 0) forward_plan_locked(lock, owner, request.get(), n, resident);
  if (request == nullptr) return others ? Taken::kMissed : Taken::kNothingPending;
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
