#include "worker_pool.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>

namespace ple {

namespace {

// A gather runs several jobs back to back (validate, sort, copy) with a few
// us of serial work between them.  Waking a sleeping thread takes tens of us,
// so a worker that finished a job waits this long for the next one before it
// sleeps, and so does the caller for the end of a job.  See README
// "Performance (GPU)" for the measurement.
constexpr auto kSpin = std::chrono::microseconds(50);

// How often a caller waiting for other threads' tasks calls its idle function.
constexpr auto kIdleWait = std::chrono::milliseconds(10);

// Whether this thread is running a job of the pool (as its caller, or as a
// worker): a job it starts then runs on it alone, since the pool takes one
// job at a time.
thread_local bool inside_job = false;

// Waits until ready() or kSpin has passed; whether ready() held.
template <typename Ready>
bool spin_until(Ready ready) {
  const auto until = std::chrono::steady_clock::now() + kSpin;
  for (unsigned i = 1;; ++i) {
    if (ready()) return true;
    if (i % 64 == 0 && std::chrono::steady_clock::now() >= until) return false;
    cpu_relax();
  }
}

// The current job in one word, so that a thread claims a task of the job it
// saw start and of no other: generation | task count | next task.
struct Job {
  static constexpr int kMaxTasks = 0xFFFF;
  uint32_t generation;
  int count, next;
  static Job of(uint64_t word) {
    return {static_cast<uint32_t>(word >> 32), static_cast<int>((word >> 16) & 0xFFFF),
            static_cast<int>(word & 0xFFFF)};
  }
  uint64_t word() const {
    return static_cast<uint64_t>(generation) << 32 | static_cast<uint64_t>(count) << 16 |
           static_cast<uint64_t>(next);
  }
};

class WorkerPool;

// The pool whose turn this thread holds while a call of it runs there.
thread_local WorkerPool* turn_held = nullptr;

class WorkerPool {
 public:
  // At most Job::kMaxTasks tasks: run_parallel splits larger counts.
  // Returns false, having run nothing, when the caller whose turn it is
  // yielded it: the tasks are then the caller's to run.
  bool run(int count, const std::function<void(int)>& task, const std::function<void()>& idle) {
    if (!take_turn()) return false;
    inside_job = true;
    turn_held = this;
    struct Leave {
      WorkerPool& pool;
      ~Leave() {
        inside_job = false;
        turn_held = nullptr;
        pool.end_turn();
      }
    } leave{*this};
    grow(count - 1);
    // Every worker wakes for every job, and those without a task spin too:
    // more spinning threads than CPUs would slow the ones with work.
    spin_.store(workers_ < cpus_, std::memory_order_relaxed);
    task_ = &task;
    error_ = nullptr;
    unfinished_.store(count, std::memory_order_relaxed);
    const uint32_t generation = Job::of(job_.load(std::memory_order_relaxed)).generation + 1;
    {
      // Under the lock: a worker about to sleep on wake_ must not miss it.
      std::lock_guard<std::mutex> lock(mutex_);
      job_.store(Job{generation, count, 0}.word(), std::memory_order_release);
    }
    wake_.notify_all();
    take_tasks(generation);
    auto done = [&] { return unfinished_.load(std::memory_order_acquire) == 0; };
    if (!(spin_.load(std::memory_order_relaxed) && spin_until(done))) {
      std::unique_lock<std::mutex> lock(mutex_);
      while (!done()) {
        if (!idle) {
          done_.wait(lock, done);
        } else if (!done_.wait_for(lock, kIdleWait, done)) {
          lock.unlock();
          idle();
          lock.lock();
        }
      }
    }
    if (error_) std::rethrow_exception(error_);
    return true;
  }

  // Yields the turn (or takes it back, `yielded` false) for YieldedTurn;
  // returns whether it was yielded before.
  bool set_yielded(bool yielded) {
    bool was;
    {
      std::lock_guard<std::mutex> lock(turn_mutex_);
      was = yielded_;
      yielded_ = yielded;
    }
    if (yielded) turn_changed_.notify_all();
    return was;
  }

 private:
  // Waits for the turn; false when its holder yielded it meanwhile.
  bool take_turn() {
    std::unique_lock<std::mutex> lock(turn_mutex_);
    turn_changed_.wait(lock, [this] { return !busy_ || yielded_; });
    if (busy_) return false;
    busy_ = true;
    return true;
  }

  void end_turn() {
    {
      std::lock_guard<std::mutex> lock(turn_mutex_);
      busy_ = false;
    }
    turn_changed_.notify_one();
  }

  // The workers are detached at once: no std::thread of theirs is ever
  // destroyed joinable, at the process's exit or before.  They live as long
  // as the process, and so does the pool they wait on (pool() below).
  void grow(int workers) {
    while (workers_ < workers) {
      try {
        std::thread([this] { work(); }).detach();
      } catch (const std::system_error&) {
        return;  // fewer threads: the caller and the others take more tasks
      }
      ++workers_;
    }
  }

  // Takes tasks of job `generation` until none is left.  task_ stays valid
  // while a claimed task runs: the job cannot end before it.
  void take_tasks(uint32_t generation) {
    uint64_t word = job_.load(std::memory_order_acquire);
    for (;;) {
      Job job = Job::of(word);
      if (job.generation != generation || job.next >= job.count) return;
      ++job.next;
      if (!job_.compare_exchange_weak(word, job.word(), std::memory_order_acq_rel)) continue;
      execute(job.next - 1);
      word = job_.load(std::memory_order_acquire);
    }
  }

  void execute(int index) {
    try {
      (*task_)(index);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
    if (unfinished_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      // Under the lock: a caller about to sleep on done_ must not miss it.
      std::lock_guard<std::mutex> lock(mutex_);
      done_.notify_all();
    }
  }

  void work() {
    ::pthread_setname_np(::pthread_self(), "ple-gather");  // told apart from torch's in profiles
    inside_job = true;  // a worker only ever runs tasks
    uint32_t seen = 0;
    auto current = [&] { return Job::of(job_.load(std::memory_order_acquire)).generation; };
    auto new_job = [&] { return current() != seen; };
    for (;;) {
      if (!(spin_.load(std::memory_order_relaxed) && spin_until(new_job))) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, new_job);
      }
      seen = current();
      take_tasks(seen);
    }
  }

  const int cpus_ = available_cpus();
  // One job at a time: busy_ while a caller holds the turn, yielded_ while
  // that caller lets the others run theirs alone.
  std::mutex turn_mutex_;
  std::condition_variable turn_changed_;
  bool busy_ = false, yielded_ = false;
  std::mutex mutex_;  // for the sleepers, and error_
  std::condition_variable wake_, done_;
  int workers_ = 0;  // started, all detached; changed by the turn's holder alone
  const std::function<void(int)>* task_ = nullptr;
  std::exception_ptr error_;
  std::atomic<uint64_t> job_{0};
  std::atomic<int> unfinished_{0};
  std::atomic<bool> spin_{false};
};

// The pool, made by the first job.  Never destroyed: detached workers may
// still wait on it at exit.  A forked child starts a new one (the old one is
// left as it is: its threads are gone and its locks may be held by them).
std::atomic<WorkerPool*> current_pool{nullptr};

const int forget_pool_in_children =
    ::pthread_atfork(nullptr, nullptr, [] { current_pool.store(nullptr); });

WorkerPool& pool() {
  WorkerPool* pool = current_pool.load(std::memory_order_acquire);
  if (pool != nullptr) return *pool;
  auto* made = new WorkerPool;
  if (current_pool.compare_exchange_strong(pool, made, std::memory_order_acq_rel)) return *made;
  delete made;  // another thread made one first
  return *pool;
}

// Runs the tasks on this thread, with the pool's rule for exceptions.
void run_here(int count, const std::function<void(int)>& task) {
  std::exception_ptr first;
  for (int i = 0; i < count; ++i) {
    try {
      task(i);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

// Runs the tasks on this thread as a job of its own: the calls its tasks
// make run on it too.
void run_alone(int count, const std::function<void(int)>& task) {
  inside_job = true;
  struct Leave {
    ~Leave() { inside_job = false; }
  } leave;
  run_here(count, task);
}

}  // namespace

void run_parallel(int count, const std::function<void(int)>& task,
                  const std::function<void()>& idle) {
  if (count <= 1 || inside_job) return run_here(count, task);
  for (int first = 0; first < count; first += Job::kMaxTasks) {
    const int n = std::min(Job::kMaxTasks, count - first);
    const std::function<void(int)> slice = [&](int i) { task(first + i); };
    if (!pool().run(n, slice, idle)) run_alone(n, slice);
  }
}

// turn_held of a forked child's thread names the parent's pool, whose
// locks the child must not touch.
YieldedTurn::YieldedTurn() {
  if (turn_held != nullptr && turn_held == current_pool.load()) {
    was_yielded_ = turn_held->set_yielded(true);
  }
}

YieldedTurn::~YieldedTurn() {
  if (turn_held != nullptr && turn_held == current_pool.load()) turn_held->set_yielded(was_yielded_);
}

int available_cpus() {
  cpu_set_t set;
  // A fixed cpu_set_t holds 1024 CPUs: a larger host's mask does not fit.
  if (::sched_getaffinity(0, sizeof(set), &set) != 0) {
    return static_cast<int>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
  }
  return CPU_COUNT(&set);
}

}  // namespace ple
