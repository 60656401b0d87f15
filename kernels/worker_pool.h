// Threads that stay for the life of the process, so that a gather does not
// pay for starting threads on every call.
#pragma once

#include <cstdint>
#include <functional>

namespace ple {

// Runs task(0) .. task(count - 1) on up to `count` threads (the caller's
// among them) and returns when all are done.  The first exception a task
// throws is rethrown here after every task has finished.  Calls from several
// threads at once take turns.
void run_parallel(int count, const std::function<void(int)>& task);

}  // namespace ple
