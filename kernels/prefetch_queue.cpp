#include "prefetch_queue.h"

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
    cancel_.store(true);
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

void PrefetchQueue::drop_untaken() {
  std::unique_lock<std::mutex> lock(mutex_);
  std::shared_ptr<PrefetchRequest> running;
  for (auto it = pending_.begin(); it != pending_.end();) {
    if ((*it)->taken) {
      ++it;
      continue;
    }
    if ((*it)->started && !(*it)->done) running = *it;
    it = pending_.erase(it);  // out of the queue, no gather can take it now
  }
  if (running == nullptr) return;
  cancel_.store(true);
  changed_.wait(lock, [&] { return running->done; });
  if (!stopping_) cancel_.store(false);  // shut_down's cancel stays
}

void PrefetchQueue::lock_for_fork() { mutex_.lock(); }

void PrefetchQueue::unlock_after_fork(bool in_child) {
  if (in_child) {
    // The thread is the parent's: the child neither joins it nor waits for it.
    (void)worker_.release();
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

void PrefetchQueue::push(std::vector<int64_t> ids, ResidentRange resident) {
  auto request = std::make_shared<PrefetchRequest>();
  request->ids = std::move(ids);
  request->resident = resident;
  // What a request's rows take (or will take, once the thread has them).
  auto bytes_of = [this](const PrefetchRequest& r) { return r.ids.size() * row_bytes_; };
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    if (worker_ == nullptr) worker_ = std::make_unique<std::thread>([this] { run(); });
    uint64_t held = bytes_of(*request);
    for (const auto& queued : pending_) held += queued->taken ? 0 : bytes_of(*queued);
    // Oldest first; a running one finishes unseen (the worker holds it).
    for (auto it = pending_.begin(); held > kMaxPendingBytes && it != pending_.end();) {
      if ((*it)->taken) {
        ++it;
        continue;
      }
      held -= bytes_of(**it);
      it = pending_.erase(it);
    }
    pending_.push_back(std::move(request));
  }
  changed_.notify_all();
}

void PrefetchQueue::run() {
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
    lock.unlock();
    std::exception_ptr error;
    try {
      next->rows.resize(next->ids.size() * row_bytes_);
      Interruption stop(&cancel_);  // by shut_down
      gather_(next->ids, next->resident, next->rows.data(), stop);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    next->error = error;
    next->done = true;
    changed_.notify_all();
  }
}

PrefetchQueue::Taken PrefetchQueue::take(const void* ids, bool ids_are_int64, int64_t n,
                                         uint8_t* out, ResidentRange resident, Interruption& stop) {
  // Prefetched ids are int64; a request of int32 ids is compared value by value.
  auto same_ids = [&](const std::vector<int64_t>& queued) {
    if (static_cast<int64_t>(queued.size()) != n) return false;
    if (ids_are_int64) return std::memcmp(queued.data(), ids, n * sizeof(int64_t)) == 0;
    const auto* narrow = static_cast<const int32_t*>(ids);
    return std::equal(queued.begin(), queued.end(), narrow);
  };
  std::unique_lock<std::mutex> lock(mutex_);
  bool others = false;
  std::shared_ptr<PrefetchRequest> request;
  for (const auto& queued : pending_) {
    if (queued->taken) continue;
    if (queued->resident == resident && same_ids(queued->ids)) {
      request = queued;
      break;
    }
    others = true;
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
  if (request->error) return Taken::kMissed;  // the caller's own gather raises the error
  std::memcpy(out, request->rows.data(), request->rows.size());
  return Taken::kHit;
}

}  // namespace ple
