// The row gather as host work ordered in a CUDA stream, and the page-locked
// host memory it fills.
//
// cuLaunchHostFunc puts a C function into a stream: it runs after the work
// enqueued before it and before the work enqueued after it.  Eager calls use
// it; a captured gather rings a doorbell instead (doorbell_gather.h), and a
// host node only where the driver lacks or refuses stream memory operations
// or PLE_GRAPH_GATHER=host_func asks for it.
//
// A host gather must never throw into the driver: failures are written to
// the job's status word (which the decode kernel reads) and kept, by table
// and stream, for the next operator call to raise.  Nor does it call Python:
// the gather it runs has no poll (interrupt.h), so a signal neither reaches
// nor stops it; it finishes, and Python handles the signal when it runs next.
#include "host_gather.h"

#include <pthread.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "doorbell_gather.h"
#include "worker_pool.h"

namespace ple {

namespace {

// By (table, stream).  A captured gather's errors are kept under stream 0,
// for the next call on any stream: a graph replays on whatever stream it is
// launched on, not on the one it was captured on.  Never destroyed: a replay
// may fail while the process exits, after its static objects are gone.
std::mutex errors_mutex;
auto& pending_errors = *new std::map<std::pair<int64_t, uintptr_t>, std::string>;

// A host function that records an error while another thread forks must not
// leave the child's lock held.
const int lock_survives_fork = ::pthread_atfork([] { errors_mutex.lock(); },
                                                [] { errors_mutex.unlock(); },
                                                [] { errors_mutex.unlock(); });

void record_error(const HostGatherJob& job, const std::string& what) {
  std::lock_guard<std::mutex> lock(errors_mutex);
  pending_errors[{job.handle, job.stream}] = what;
}

void run_eager_job(void* data) {
  std::unique_ptr<HostGatherJob> job(static_cast<HostGatherJob*>(data));
  run_host_gather(*job);
}

void run_captured_job(void* data) { run_host_gather(*static_cast<HostGatherJob*>(data)); }

// The job as it is kept for replays: its errors under stream 0 (see pending_errors).
HostGatherJob for_replays(HostGatherJob job) {
  job.stream = 0;
  return job;
}

bool doorbell_wanted() {
  const char* choice = std::getenv("PLE_GRAPH_GATHER");
  return driver().has_stream_memory_ops() && driver().can_add_captured_nodes() &&
         !doorbell_refused() &&
         (choice == nullptr || std::strcmp(choice, "host_func") != 0);
}

// The most threads a host gather runs on: one CPU is left to the thread
// that waits for the stream, since a synchronize spins (a reason, not a
// measurement: docs/performance.md says why the one made was biased).
int64_t host_gather_threads() {
  static const int64_t threads = std::max(1, available_cpus() - 1);
  return threads;
}

}  // namespace

void run_host_gather(const HostGatherJob& job) {
  *job.status = 1;
  try {
    std::shared_ptr<MappedTable> table = find_table(job.handle);
    table->gather(job.ids, /*ids_are_int64=*/true, job.n, job.staging, job.resident,
                  host_gather_threads(), job.owner);
    *job.status = 0;
  } catch (const std::exception& error) {
    record_error(job, error.what());
  } catch (...) {
    record_error(job, "unknown error in the host gather");
  }
}

void launch_host_gather(const HostGatherJob& job, bool capturing) {
  const auto stream = reinterpret_cast<CUstream>(job.stream);
  if (!capturing) {
    auto eager = std::make_unique<HostGatherJob>(job);
    check(driver().launch_host_func(stream, run_eager_job, eager.get()), "cuLaunchHostFunc");
    eager.release();  // run_eager_job frees it
    return;
  }
  if (doorbell_wanted() && enqueue_doorbell_gather(stream, for_replays(job))) return;
  // Kept for the process's life, never freed: the graph runs it on every
  // replay for as long as the graph lives, which nothing here can know.
  auto captured = std::make_unique<HostGatherJob>(for_replays(job));
  check(driver().launch_host_func(stream, run_captured_job, captured.get()), "cuLaunchHostFunc");
  captured.release();
}

std::string graph_gather_mechanism() { return doorbell_wanted() ? "doorbell" : "host_func"; }

void register_host_memory(void* data, size_t bytes, int device) {
  ensure_context(device);
  page_lock(data, bytes);
}

void unregister_host_memory(void* data, int device) {
  ensure_context(device);
  page_unlock(data);
}

std::string take_host_error(int64_t handle, uintptr_t stream) {
  std::lock_guard<std::mutex> lock(errors_mutex);
  auto it = pending_errors.find({handle, stream});
  if (it == pending_errors.end()) it = pending_errors.find({handle, 0});
  if (it == pending_errors.end()) return "";
  std::string what = std::move(it->second);
  pending_errors.erase(it);
  return what;
}

}  // namespace ple
