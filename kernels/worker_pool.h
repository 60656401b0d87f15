// Threads that stay for the life of the process, so that a gather does not
// pay for starting threads on every call, nor (while there are no more of
// them than CPUs) for waking them between the steps of one.
#pragma once

#include <cstdint>
#include <functional>

namespace ple {

// Runs task(0) .. task(count - 1) on up to `count` threads (the caller's
// among them) and returns when all are done.  The first exception a task
// throws is rethrown here after every task has finished.  Calls from several
// threads at once take turns, except while the caller whose turn it is has
// yielded it (YieldedTurn): then they run their tasks on their own threads
// alone.  A call from inside a task, or from `idle`, runs its tasks on the
// calling thread alone.  `idle`, when given, is called on the calling
// thread about every 10 ms while it waits for the tasks of other threads
// (it must not throw).
//
// The threads do not survive a fork: in the child a new pool starts with the
// first call (the old one's locks may have been copied locked).
void run_parallel(int count, const std::function<void(int)>& task,
                  const std::function<void()>& idle = {});

// While it lives, the calling thread's turn at the pool (if a call of it
// is running: the thread is in one of its tasks, or in its `idle`) holds no
// other caller back.  For code that may wait for anything, such as a
// Python signal handler that joins a thread whose gather waits for its turn.
class YieldedTurn {
 public:
  YieldedTurn();
  ~YieldedTurn();
  YieldedTurn(const YieldedTurn&) = delete;
  YieldedTurn& operator=(const YieldedTurn&) = delete;

 private:
  bool was_yielded_ = false;
};

// The CPUs the calling thread may run on (its affinity mask; the online
// CPUs where the mask cannot be read), which is what the pool sizes itself by.
int available_cpus();

// Tells the core that this thread spins, and lets its sibling run.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace ple
