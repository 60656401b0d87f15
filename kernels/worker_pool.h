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
// threads at once take turns; a call from inside a task, or from `idle`,
// runs its tasks on the calling thread alone.  `idle`, when given, is called
// on the calling thread about every 10 ms while it waits for the tasks of
// other threads (it must not throw).
//
// The threads do not survive a fork: in the child a new pool starts with the
// first call (the old one's locks may have been copied locked).
void run_parallel(int count, const std::function<void(int)>& task,
                  const std::function<void()>& idle = {});

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
