// The row gather as host work ordered in a CUDA stream, and the page-locked
// host memory it fills.
//
// cuLaunchHostFunc puts a C function into a stream: it runs after the work
// enqueued before it and before the work enqueued after it, and inside a
// captured CUDA graph it becomes a host node that runs on every replay.  The
// driver is reached with dlopen at run time, so this file needs no CUDA
// toolkit to build and does nothing on a machine without a driver.
//
// A host function must never throw into the driver: failures are written to
// the job's status word (which the decode kernel reads) and kept, by table
// and stream, for the next operator call to raise.  Nor does it call Python:
// the gather it runs has no poll (interrupt.h), so a signal neither reaches
// nor stops it; it finishes, and Python handles the signal when it runs next.
#include <dlfcn.h>
#include <pthread.h>
#include <unistd.h>

#include <atomic>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "host_gather.h"

namespace ple {

namespace {

using CUresult = int;
using CUstream = void*;
using CUcontext = void*;
using CUhostFn = void (*)(void*);

// The few driver entry points this file uses, found at run time.
struct Driver {
  CUresult (*launch_host_func)(CUstream, CUhostFn, void*) = nullptr;
  CUresult (*mem_host_register)(void*, size_t, unsigned) = nullptr;
  CUresult (*mem_host_unregister)(void*) = nullptr;
  CUresult (*exchange_capture_mode)(int*) = nullptr;
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*device_get)(int*, int) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, int) = nullptr;
};

// The process that first used the driver: its forked children cannot.
std::atomic<pid_t> driver_pid{0};

const Driver& driver() {
  static const Driver loaded = [] {
    Driver d;
    void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return d;
    driver_pid.store(::getpid());
    d.launch_host_func = reinterpret_cast<decltype(d.launch_host_func)>(::dlsym(lib, "cuLaunchHostFunc"));
    d.mem_host_register = reinterpret_cast<decltype(d.mem_host_register)>(::dlsym(lib, "cuMemHostRegister_v2"));
    d.mem_host_unregister = reinterpret_cast<decltype(d.mem_host_unregister)>(::dlsym(lib, "cuMemHostUnregister"));
    d.exchange_capture_mode =
        reinterpret_cast<decltype(d.exchange_capture_mode)>(::dlsym(lib, "cuThreadExchangeStreamCaptureMode"));
    d.init = reinterpret_cast<decltype(d.init)>(::dlsym(lib, "cuInit"));
    d.ctx_get_current = reinterpret_cast<decltype(d.ctx_get_current)>(::dlsym(lib, "cuCtxGetCurrent"));
    d.ctx_set_current = reinterpret_cast<decltype(d.ctx_set_current)>(::dlsym(lib, "cuCtxSetCurrent"));
    d.device_get = reinterpret_cast<decltype(d.device_get)>(::dlsym(lib, "cuDeviceGet"));
    d.primary_ctx_retain =
        reinterpret_cast<decltype(d.primary_ctx_retain)>(::dlsym(lib, "cuDevicePrimaryCtxRetain"));
    return d;
  }();
  if (loaded.launch_host_func == nullptr || loaded.mem_host_register == nullptr ||
      loaded.mem_host_unregister == nullptr || loaded.exchange_capture_mode == nullptr ||
      loaded.init == nullptr || loaded.ctx_get_current == nullptr ||
      loaded.ctx_set_current == nullptr || loaded.device_get == nullptr ||
      loaded.primary_ctx_retain == nullptr) {
    throw OsError("cannot load the CUDA driver (libcuda.so.1) or find its entry points");
  }
  return loaded;
}

void check(CUresult result, const char* what) {
  if (result != 0) throw std::runtime_error(std::string(what) + " failed (CUresult " + std::to_string(result) + ")");
}

// Page-locking memory is refused while any stream captures a graph in the
// default (global) mode; like torch's own allocator, this thread switches to
// the relaxed mode for the call, which allows it.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { check(driver().exchange_capture_mode(&mode_), "cuThreadExchangeStreamCaptureMode"); }
  ~RelaxedCaptureMode() { driver().exchange_capture_mode(&mode_); }

 private:
  int mode_ = 2;  // CU_STREAM_CAPTURE_MODE_RELAXED
};

// Page-locking needs a current context.  A thread that has not used CUDA yet
// (a host tier placed before any CUDA call, a table closed from another
// thread) gets the primary context of `ordinal`, the one torch uses for that
// device, rather than one on a device the process does not use; the memory
// is registered PORTABLE, so it serves every device.
void ensure_context(int ordinal) {
  CUcontext current = nullptr;
  check(driver().ctx_get_current(&current), "cuCtxGetCurrent");
  if (current != nullptr) return;
  int device = 0;
  check(driver().init(0), "cuInit");
  check(driver().device_get(&device, ordinal), "cuDeviceGet");
  check(driver().primary_ctx_retain(&current, device), "cuDevicePrimaryCtxRetain");
  check(driver().ctx_set_current(current), "cuCtxSetCurrent");
}

struct HostGatherJob {
  int64_t handle;
  uintptr_t stream;
  const int64_t* ids;  // pinned, written by a device-to-host copy ordered before
  int64_t n;
  ResidentRange resident;  // fixed at launch: a captured graph keeps its tiers
  uint8_t* staging;  // pinned, n * row_bytes
  int32_t* status;   // pinned; 0 when the rows in staging are this job's
  bool one_shot;     // eager launch: the job frees itself after it runs
};

std::mutex errors_mutex;
std::map<std::pair<int64_t, uintptr_t>, std::string> pending_errors;

// Jobs captured in a graph run on every replay, for as long as the graph
// lives, which nothing here can know: they are kept for the process's life.
std::mutex captured_mutex;
std::vector<std::unique_ptr<HostGatherJob>> captured_jobs;

// A host function that records an error while another thread forks must not
// leave the child's locks held.
const int locks_survive_fork = ::pthread_atfork(
    [] {
      errors_mutex.lock();
      captured_mutex.lock();
    },
    [] {
      captured_mutex.unlock();
      errors_mutex.unlock();
    },
    [] {
      captured_mutex.unlock();
      errors_mutex.unlock();
    });

void record_error(const HostGatherJob& job, const std::string& what) {
  std::lock_guard<std::mutex> lock(errors_mutex);
  pending_errors[{job.handle, job.stream}] = what;
}

void run_job(void* data) {
  auto* job = static_cast<HostGatherJob*>(data);
  *job->status = 1;
  try {
    std::shared_ptr<MappedTable> table = find_table(job->handle);
    table->gather(job->ids, /*ids_are_int64=*/true, job->n, job->staging, job->resident);
    *job->status = 0;
  } catch (const std::exception& error) {
    record_error(*job, error.what());
  } catch (...) {
    record_error(*job, "unknown error in the host gather");
  }
  if (job->one_shot) delete job;
}

}  // namespace

void register_host_memory(void* data, size_t bytes, int device) {
  ensure_context(device);
  RelaxedCaptureMode relaxed;
  // PORTABLE: pinned for every context; DEVICEMAP: kernels may read it (UVA).
  check(driver().mem_host_register(data, bytes, 0x01 | 0x02), "cuMemHostRegister");
}

void unregister_host_memory(void* data, int device) {
  ensure_context(device);
  RelaxedCaptureMode relaxed;
  check(driver().mem_host_unregister(data), "cuMemHostUnregister");
}

void launch_host_gather(uintptr_t stream, int64_t handle, const int64_t* ids, int64_t n,
                        ResidentRange resident, uint8_t* staging, int32_t* status, bool capturing) {
  auto job = std::make_unique<HostGatherJob>(
      HostGatherJob{handle, stream, ids, n, resident, staging, status, !capturing});
  check(driver().launch_host_func(reinterpret_cast<CUstream>(stream), run_job, job.get()),
        "cuLaunchHostFunc");
  if (capturing) {
    std::lock_guard<std::mutex> lock(captured_mutex);
    captured_jobs.push_back(std::move(job));
  } else {
    job.release();  // run_job frees it
  }
}

bool forked_after_cuda() {
  const pid_t pid = driver_pid.load();
  return pid != 0 && pid != ::getpid();
}

std::string take_host_error(int64_t handle, uintptr_t stream) {
  std::lock_guard<std::mutex> lock(errors_mutex);
  auto it = pending_errors.find({handle, stream});
  if (it == pending_errors.end()) return "";
  std::string what = std::move(it->second);
  pending_errors.erase(it);
  return what;
}

}  // namespace ple
