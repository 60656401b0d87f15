#include "worker_pool.h"

#include <condition_variable>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace ple {

namespace {

class WorkerPool {
 public:
  void run(int count, const std::function<void(int)>& task) {
    std::lock_guard<std::mutex> one_job(job_mutex_);
    grow(count - 1);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = &task;
      next_ = 1;  // the caller takes task 0
      count_ = count;
      unfinished_ = count;
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    execute(0);
    take_tasks();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return unfinished_ == 0; });
    task_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void grow(int workers) {
    while (static_cast<int>(threads_.size()) < workers) {
      try {
        threads_.emplace_back([this] { work(); });
        threads_.back().detach();  // they live as long as the process
      } catch (const std::system_error&) {
        return;  // fewer threads: the caller and the others take more tasks
      }
    }
  }

  void execute(int index) {
    try {
      (*task_)(index);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (--unfinished_ == 0) done_.notify_all();
  }

  // Takes tasks of the current job until none is left.
  void take_tasks() {
    for (;;) {
      int index;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (task_ == nullptr || next_ >= count_) return;
        index = next_++;
      }
      execute(index);
    }
  }

  void work() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
      }
      take_tasks();
    }
  }

  std::mutex job_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  const std::function<void(int)>* task_ = nullptr;
  int next_ = 0, count_ = 0, unfinished_ = 0;
  uint64_t generation_ = 0;
  std::exception_ptr error_;
};

}  // namespace

void run_parallel(int count, const std::function<void(int)>& task) {
  if (count <= 1) {
    if (count == 1) task(0);
    return;
  }
  // Never destroyed: detached workers may still wait on it at exit.
  static WorkerPool* pool = new WorkerPool;
  pool->run(count, task);
}

}  // namespace ple
