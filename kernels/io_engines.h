// Ways to keep many O_DIRECT reads in flight from one thread: io_uring
// (through the kernel's own interface: io_uring_setup, io_uring_enter and the
// rings mapped from its descriptor; no library), Linux AIO (io_setup,
// io_submit, io_getevents), or a pool of threads doing pread.  The direct
// reader (direct_reader.h) uses whichever the table chose (choose_backend).
//
// An engine belongs to one thread (ThreadEngine): a gather's threads each
// drive their own, and concurrent gathers never share one.  An engine owns
// `depth` buffers of kMaxReadBytes, aligned for O_DIRECT, one per read in
// flight.  Engines do not cross fork(): the child's first direct read on a
// thread makes a new one (the parent's ring, AIO context and threads are the
// parent's).
#pragma once

#include <cstdint>
#include <memory>

#include "row_cache.h"  // LazyArray

namespace ple {

// In the order choose_backend tries them.
enum class IoBackend { kIoUring, kAio, kPread };
constexpr int kIoBackends = 3;

// "io_uring", "aio", "pread".
const char* backend_name(IoBackend backend);

// The largest single read, and so the size of each buffer: a run of adjacent
// blocks longer than this is read in several reads.
constexpr uint32_t kMaxReadBytes = 64 * 1024;

// The environment variable that names the first backend to try ("io_uring",
// "aio" or "pread"): the ones before it are not tried.  For hosts where
// io_uring is allowed but unwanted (audited, or known to misbehave), and for
// the tests, which run each backend.  Unset: io_uring first.
constexpr const char* kBackendVariable = "PLE_IO_BACKEND";

// The first backend, from the one kBackendVariable names, that this process
// can set up (io_uring is refused by seccomp in many containers, EPERM, and
// by kernel.io_uring_disabled; AIO by some sandboxes, ENOSYS); pread always
// works.  std::invalid_argument for an unknown name in the variable.
IoBackend choose_backend();

struct IoRead {
  int fd;
  uint64_t offset;  // aligned for O_DIRECT, as are length and buffer
  uint32_t length;
  uint8_t* buffer;
  uint32_t tag;
};

struct IoDone {
  uint32_t tag;
  int64_t result;  // bytes read, or -errno
};

class IoEngine {
 public:
  explicit IoEngine(int depth);
  virtual ~IoEngine() = default;
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  int depth() const { return depth_; }
  // Buffer `slot` (0 .. depth - 1), kMaxReadBytes, page aligned.
  uint8_t* buffer(int slot) const { return buffers_.data() + static_cast<uint64_t>(slot) * kMaxReadBytes; }

  // Starts `reads`; the caller never has more than depth() in flight.
  virtual void submit(const IoRead* reads, int count) = 0;
  // Up to `most` completions of the reads started; waits up to `wait_ms`
  // for `wanted` of them (fewer, maybe 0, when they did not come in that
  // time; 0 wanted: only what is there).  OsError when the kernel refuses
  // the call itself (a read's own error is its result).
  virtual int reap(IoDone* done, int most, int wanted, int wait_ms) = 0;

 private:
  int depth_;
  LazyArray buffers_;  // backed by pages only where reads have filled them
};

// The calling thread's engine of `backend` with at least `depth` buffers,
// for the life of this object: the thread's own, made (or remade larger) on
// first use, or, while the thread's own is in use further up its stack (a
// Python signal handler that gathers in the middle of a gather), one made
// for this object alone.  OsError when it cannot be set up.
class ThreadEngine {
 public:
  ThreadEngine(IoBackend backend, int depth);
  ~ThreadEngine();
  ThreadEngine(const ThreadEngine&) = delete;
  ThreadEngine& operator=(const ThreadEngine&) = delete;

  IoEngine& operator*() const { return *engine_; }
  IoEngine* operator->() const { return engine_; }
  // For an engine that may still have reads in flight: it is never used
  // again, nor destroyed (its buffers stay, for the kernel to write).
  void abandon();

 private:
  IoBackend backend_;
  std::unique_ptr<IoEngine> own_;  // when the thread's engine was in use
  IoEngine* engine_;
};

}  // namespace ple
