#include "io_engines.h"

#include <linux/aio_abi.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mapped_table.h"  // OsError

// Newer than the oldest headers this builds with; the kernel says at setup
// whether it knows them.
#ifndef IORING_SETUP_SINGLE_ISSUER
#define IORING_SETUP_SINGLE_ISSUER (1U << 12)
#endif
#ifndef IORING_SETUP_DEFER_TASKRUN
#define IORING_SETUP_DEFER_TASKRUN (1U << 13)
#endif

namespace ple {

namespace {

// Incremented in every forked child: an engine made under another
// generation belongs to the parent.
std::atomic<uint64_t> fork_generation{0};
const int engines_stay_with_the_parent =
    ::pthread_atfork(nullptr, nullptr, [] { fork_generation.fetch_add(1); });

// "direct I/O: <call>: <error>", for an OsError out of a gather.
std::string errno_text(const std::string& call, int code) {
  return "direct I/O: " + call + ": " + std::strerror(code);
}

// ------------------------------------------------------------------ io_uring

class IoUring final : public IoEngine {
 public:
  explicit IoUring(int depth) : IoEngine(depth) {
    io_uring_params params{};
    // One thread submits and reaps (SINGLE_ISSUER), and completions run
    // when it reaps (DEFER_TASKRUN), not as interrupts of whatever it does:
    // the least CPU per read.  Kernels before 6.1 refuse the flags.
    params.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
    fd_ = static_cast<int>(::syscall(__NR_io_uring_setup, depth, &params));
    if (fd_ < 0 && errno == EINVAL) {
      params = io_uring_params{};
      fd_ = static_cast<int>(::syscall(__NR_io_uring_setup, depth, &params));
    }
    if (fd_ < 0) throw OsError(errno_text("io_uring_setup", errno));
    try {
      map_rings(params);
      require_read_op();
    } catch (...) {
      release();
      throw;
    }
  }

  ~IoUring() override { release(); }

  void submit(const IoRead* reads, int count) override {
    uint32_t tail = *sq_tail_;  // this thread is the only producer
    for (int i = 0; i < count; ++i, ++tail) {
      const uint32_t index = tail & sq_mask_;
      io_uring_sqe& sqe = sqes_[index];
      std::memset(&sqe, 0, sizeof(sqe));
      sqe.opcode = IORING_OP_READ;
      sqe.fd = reads[i].fd;
      sqe.off = reads[i].offset;
      sqe.addr = reinterpret_cast<uintptr_t>(reads[i].buffer);
      sqe.len = reads[i].length;
      sqe.user_data = reads[i].tag;
      sq_array_[index] = index;
    }
    __atomic_store_n(sq_tail_, tail, __ATOMIC_RELEASE);
    unsubmitted_ += count;
  }

  int reap(IoDone* done, int most, int wanted, int wait_ms) override {
    if (unsubmitted_ > 0 || ready() < static_cast<uint32_t>(wanted)) enter(wanted, wait_ms);
    uint32_t head = *cq_head_;  // this thread is the only consumer
    const uint32_t tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
    int n = 0;
    for (; head != tail && n < most; ++head, ++n) {
      const io_uring_cqe& cqe = cqes_[head & cq_mask_];
      done[n] = {static_cast<uint32_t>(cqe.user_data), cqe.res};
    }
    __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
    return n;
  }

 private:
  uint32_t ready() const { return __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE) - *cq_head_; }

  // Submits what is queued and waits up to wait_ms until `wanted`
  // completions are ready (with DEFER_TASKRUN, completions only become
  // ready here).
  void enter(int wanted, int wait_ms) {
    __kernel_timespec timeout{0, static_cast<long long>(wait_ms) * 1000000};
    io_uring_getevents_arg arg{};
    arg.ts = reinterpret_cast<uintptr_t>(&timeout);
    const uint32_t have = ready();
    const unsigned wait_for = wait_ms > 0 && have < static_cast<uint32_t>(wanted) ? wanted - have : 0;
    const long submitted = ::syscall(__NR_io_uring_enter, fd_, unsubmitted_, wait_for,
                                     IORING_ENTER_GETEVENTS | IORING_ENTER_EXT_ARG, &arg,
                                     sizeof(arg));
    if (submitted >= 0) {
      unsubmitted_ -= static_cast<uint32_t>(submitted);
      return;
    }
    // Timed out or interrupted: the caller looks again.  Out of resources
    // for more requests (EAGAIN, EBUSY): those stay queued, for the next call.
    if (errno == ETIME || errno == EINTR || errno == EAGAIN || errno == EBUSY) return;
    throw OsError(errno_text("io_uring_enter", errno));
  }

  void map_rings(const io_uring_params& p) {
    // Completions are waited for with a timeout (EXT_ARG, 5.11), and both
    // rings share one mapping (SINGLE_MMAP, 5.4).
    if (!(p.features & IORING_FEAT_EXT_ARG) || !(p.features & IORING_FEAT_SINGLE_MMAP)) {
      throw OsError("direct I/O: io_uring lacks wait timeouts here (IORING_FEAT_EXT_ARG, Linux 5.11)");
    }
    ring_bytes_ = std::max<size_t>(p.sq_off.array + p.sq_entries * sizeof(uint32_t),
                                   p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe));
    ring_ = ::mmap(nullptr, ring_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_,
                   IORING_OFF_SQ_RING);
    if (ring_ == MAP_FAILED) {
      ring_ = nullptr;
      throw OsError(errno_text("mmap of the io_uring rings", errno));
    }
    sqes_bytes_ = p.sq_entries * sizeof(io_uring_sqe);
    void* sqes = ::mmap(nullptr, sqes_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                        fd_, IORING_OFF_SQES);
    if (sqes == MAP_FAILED) throw OsError(errno_text("mmap of the io_uring entries", errno));
    sqes_ = static_cast<io_uring_sqe*>(sqes);
    auto* base = static_cast<uint8_t*>(ring_);
    sq_tail_ = reinterpret_cast<uint32_t*>(base + p.sq_off.tail);
    sq_mask_ = *reinterpret_cast<uint32_t*>(base + p.sq_off.ring_mask);
    sq_array_ = reinterpret_cast<uint32_t*>(base + p.sq_off.array);
    cq_head_ = reinterpret_cast<uint32_t*>(base + p.cq_off.head);
    cq_tail_ = reinterpret_cast<uint32_t*>(base + p.cq_off.tail);
    cq_mask_ = *reinterpret_cast<uint32_t*>(base + p.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(base + p.cq_off.cqes);
  }

  // IORING_OP_READ came with Linux 5.6, as did the probe that says so.
  void require_read_op() {
    std::vector<uint8_t> memory(sizeof(io_uring_probe) + 256 * sizeof(io_uring_probe_op), 0);
    auto* probe = reinterpret_cast<io_uring_probe*>(memory.data());
    if (::syscall(__NR_io_uring_register, fd_, IORING_REGISTER_PROBE, probe, 256) < 0 ||
        probe->ops_len <= IORING_OP_READ ||
        !(probe->ops[IORING_OP_READ].flags & IO_URING_OP_SUPPORTED)) {
      throw OsError("direct I/O: io_uring cannot read here (IORING_OP_READ, Linux 5.6)");
    }
  }

  void release() {
    if (sqes_ != nullptr) ::munmap(sqes_, sqes_bytes_);
    if (ring_ != nullptr) ::munmap(ring_, ring_bytes_);
    if (fd_ >= 0) ::close(fd_);
    sqes_ = nullptr;
    ring_ = nullptr;
    fd_ = -1;
  }

  int fd_ = -1;
  void* ring_ = nullptr;
  size_t ring_bytes_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  size_t sqes_bytes_ = 0;
  uint32_t* sq_tail_ = nullptr;
  uint32_t sq_mask_ = 0;
  uint32_t* sq_array_ = nullptr;
  uint32_t* cq_head_ = nullptr;
  uint32_t* cq_tail_ = nullptr;
  uint32_t cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;
  uint32_t unsubmitted_ = 0;  // entries in the ring the kernel has not taken yet
};

// ------------------------------------------------------------------ Linux AIO

class Aio final : public IoEngine {
 public:
  explicit Aio(int depth) : IoEngine(depth), iocbs_(depth), events_(depth) {
    if (::syscall(__NR_io_setup, depth, &context_) != 0) {
      const int code = errno;
      throw OsError(errno_text("io_setup", code) +
                    (code == EAGAIN ? " (the system's AIO events, /proc/sys/fs/aio-max-nr, are taken)" : ""));
    }
  }

  ~Aio() override { ::syscall(__NR_io_destroy, context_); }

  void submit(const IoRead* reads, int count) override {
    for (int i = 0; i < count; ++i) {
      iocb& cb = iocbs_[reads[i].tag];
      std::memset(&cb, 0, sizeof(cb));
      cb.aio_lio_opcode = IOCB_CMD_PREAD;
      cb.aio_fildes = static_cast<uint32_t>(reads[i].fd);
      cb.aio_buf = reinterpret_cast<uintptr_t>(reads[i].buffer);
      cb.aio_nbytes = reads[i].length;
      cb.aio_offset = static_cast<int64_t>(reads[i].offset);
      cb.aio_data = reads[i].tag;
      unsubmitted_.push_back(&cb);
    }
  }

  int reap(IoDone* done, int most, int wanted, int wait_ms) override {
    while (!unsubmitted_.empty()) {  // io_submit may take fewer than offered
      const long taken = ::syscall(__NR_io_submit, context_, unsubmitted_.size(), unsubmitted_.data());
      if (taken < 0 && (errno == EAGAIN || errno == EINTR)) break;  // again at the next reap
      if (taken < 0) throw OsError(errno_text("io_submit", errno));
      unsubmitted_.erase(unsubmitted_.begin(), unsubmitted_.begin() + taken);
    }
    timespec timeout{0, static_cast<long>(wait_ms) * 1000000};
    const long got = ::syscall(__NR_io_getevents, context_, wait_ms > 0 ? wanted : 0,
                               std::min(most, depth()), events_.data(), &timeout);
    if (got < 0 && errno == EINTR) return 0;
    if (got < 0) throw OsError(errno_text("io_getevents", errno));
    for (long i = 0; i < got; ++i) done[i] = {static_cast<uint32_t>(events_[i].data), events_[i].res};
    return static_cast<int>(got);
  }

 private:
  aio_context_t context_ = 0;
  std::vector<iocb> iocbs_;  // one per buffer: a read's tag is its buffer
  std::vector<io_event> events_;
  std::vector<iocb*> unsubmitted_;
};

// ------------------------------------------------------------------ pread threads

// `depth` threads, each doing one pread at a time.
class PreadPool final : public IoEngine {
 public:
  explicit PreadPool(int depth) : IoEngine(depth) {
    try {
      for (int i = 0; i < depth; ++i) threads_.emplace_back([this] { work(); });
    } catch (...) {
      stop();  // those started: a std::thread destroyed joinable ends the process
      throw;
    }
  }

  ~PreadPool() override { stop(); }

  void submit(const IoRead* reads, int count) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      work_.insert(work_.end(), reads, reads + count);
    }
    for (int i = 0; i < count; ++i) work_ready_.notify_one();
  }

  int reap(IoDone* done, int most, int wanted, int wait_ms) override {
    std::unique_lock<std::mutex> lock(mutex_);
    done_ready_.wait_for(lock, std::chrono::milliseconds(wait_ms),
                         [&] { return done_.size() >= static_cast<size_t>(wanted); });
    const int n = std::min<int>(most, static_cast<int>(done_.size()));
    std::copy(done_.begin(), done_.begin() + n, done);
    done_.erase(done_.begin(), done_.begin() + n);
    return n;
  }

 private:
  // Stops and joins the threads; each ends after the read it is doing.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    work_ready_.notify_all();
    for (std::thread& thread : threads_) thread.join();
  }

  void work() {
    ::pthread_setname_np(::pthread_self(), "ple-io");  // told apart from torch's in profiles
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      work_ready_.wait(lock, [this] { return stopping_ || !work_.empty(); });
      if (stopping_) return;
      const IoRead read = work_.front();
      work_.pop_front();
      lock.unlock();
      ssize_t got;
      do {
        got = ::pread(read.fd, read.buffer, read.length, static_cast<off_t>(read.offset));
      } while (got < 0 && errno == EINTR);
      const int64_t result = got < 0 ? -static_cast<int64_t>(errno) : got;
      lock.lock();
      done_.push_back({read.tag, result});
      done_ready_.notify_one();
    }
  }

  std::mutex mutex_;
  std::condition_variable work_ready_, done_ready_;
  std::deque<IoRead> work_;
  std::vector<IoDone> done_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;  // last: they use the members above
};

std::unique_ptr<IoEngine> make_engine(IoBackend backend, int depth) {
  switch (backend) {
    case IoBackend::kIoUring:
      return std::make_unique<IoUring>(depth);
    case IoBackend::kAio:
      return std::make_unique<Aio>(depth);
    case IoBackend::kPread:
      break;
  }
  return std::make_unique<PreadPool>(depth);
}

// A thread's engines, one per backend at most, and which are in use.
struct ThreadEngines {
  uint64_t generation = fork_generation.load();
  std::unique_ptr<IoEngine> of[kIoBackends];
  bool in_use[kIoBackends] = {};

  // In a forked child the engines are the parent's: a pool's threads do not
  // exist here and its locks may have been copied held, so nothing of them
  // is touched; their memory stays.
  void leave_if_forked() {
    if (generation == fork_generation.load()) return;
    for (auto& engine : of) engine.release();
    generation = fork_generation.load();
  }
  ~ThreadEngines() { leave_if_forked(); }
};

thread_local ThreadEngines engines;

}  // namespace

const char* backend_name(IoBackend backend) {
  switch (backend) {
    case IoBackend::kIoUring:
      return "io_uring";
    case IoBackend::kAio:
      return "aio";
    case IoBackend::kPread:
      break;
  }
  return "pread";
}

IoBackend choose_backend() {
  int first = 0;
  if (const char* named = std::getenv(kBackendVariable); named != nullptr && *named != '\0') {
    while (first < kIoBackends && std::strcmp(named, backend_name(IoBackend(first))) != 0) ++first;
    if (first == kIoBackends) {
      throw std::invalid_argument(std::string(kBackendVariable) + "='" + named +
                                  "' is not a direct I/O backend (io_uring, aio or pread)");
    }
  }
  for (int b = first; b < kIoBackends - 1; ++b) {
    try {
      make_engine(IoBackend(b), 1);
      return IoBackend(b);
    } catch (const OsError&) {
      // Refused here: the next one.
    }
  }
  return IoBackend::kPread;
}

IoEngine::IoEngine(int depth) : depth_(depth), buffers_(uint64_t{kMaxReadBytes} * depth) {}

ThreadEngine::ThreadEngine(IoBackend backend, int depth) : backend_(backend) {
  engines.leave_if_forked();
  const int b = static_cast<int>(backend);
  if (engines.in_use[b]) {
    own_ = make_engine(backend, depth);
    engine_ = own_.get();
    return;
  }
  std::unique_ptr<IoEngine>& engine = engines.of[b];
  if (engine == nullptr || engine->depth() < depth) {
    engine.reset();  // first: the old one's memory goes before the new one's comes
    engine = make_engine(backend, depth);
  }
  engine_ = engine.get();
  engines.in_use[b] = true;
}

ThreadEngine::~ThreadEngine() {
  if (own_ == nullptr) engines.in_use[static_cast<int>(backend_)] = false;
}

void ThreadEngine::abandon() {
  if (own_ != nullptr) {
    own_.release();
  } else {
    engines.of[static_cast<int>(backend_)].release();
  }
}

}  // namespace ple
