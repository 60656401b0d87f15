#include "doorbell_gather.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <new>
#include <mutex>
#include <thread>
#include <vector>

#include "mapped_table.h"
#include "worker_pool.h"

namespace ple {

namespace {

// The graph sets `ring` to 1 once the ids are staged; the doorbell thread
// sets it back to 0, gathers, and sets `done` to 1; the graph waits for done
// == 1 and sets it to 0.  A graph's replays run one after another, so a ring
// always finds done at 0.  The two words sit on cache lines of their own:
// the GPU writes one while the host writes the other.
struct alignas(64) DoorbellWords {
  std::atomic<uint32_t> ring{0};
  alignas(64) std::atomic<uint32_t> done{0};
};

struct DoorbellJob {
  DoorbellJob(const HostGatherJob& gather, DoorbellWords* words) : gather(gather), words(words) {}

  HostGatherJob gather;
  DoorbellWords* words;
  // The replays that its wake-up node has seen begin, and the rings
  // answered: a replay's ring comes after its node has run or before, never
  // with another replay of the graph between (a graph's replays run one
  // after another), so a replay whose ring is not answered yet is in flight.
  std::atomic<uint64_t> replays{0}, answered{0};
};

// Answers `job`'s ring if it is rung and no other thread took it: gathers,
// then raises done.  Whether this call answered it.
bool answer_ring(DoorbellJob& job) {
  DoorbellWords& words = *job.words;
  if (words.ring.load(std::memory_order_acquire) != 1 ||
      words.ring.exchange(0, std::memory_order_acq_rel) != 1) {
    return false;
  }
  run_host_gather(job.gather);
  job.answered.fetch_add(1);
  words.done.store(1, std::memory_order_release);
  return true;
}

// Pinned memory for the words of captured gathers.  Like the jobs, the words
// live for the process's life: a graph may be replayed as long as it lives.
class WordSlabs {
 public:
  // Words for one more gather, page-locked and mapped for the device.
  DoorbellWords* take() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!returned_.empty()) {
      DoorbellWords* words = returned_.back();
      returned_.pop_back();
      return words;
    }
    if (next_ == kWordsPerSlab) {
      void* slab = ::mmap(nullptr, kSlabBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (slab == MAP_FAILED) throw std::bad_alloc();
      try {
        page_lock(slab, kSlabBytes);
      } catch (...) {
        ::munmap(slab, kSlabBytes);
        throw;
      }
      slab_ = new (slab) DoorbellWords[kWordsPerSlab];
      next_ = 0;
    }
    return &slab_[next_++];
  }

  // Words that no graph uses (the capture failed), for a later take().
  void give_back(DoorbellWords* words) {
    std::lock_guard<std::mutex> lock(mutex_);
    returned_.push_back(words);
  }

 private:
  static constexpr size_t kSlabBytes = 64 * 1024;
  static constexpr size_t kWordsPerSlab = kSlabBytes / sizeof(DoorbellWords);
  std::mutex mutex_;
  DoorbellWords* slab_ = nullptr;
  size_t next_ = kWordsPerSlab;
  std::vector<DoorbellWords*> returned_;
};

// After a ring or a wake-up, the doorbell thread spins for kSpinFor (graphs
// replayed back to back ring again sooner; a replay after a longer pause
// is answered through its wake-up node, and the spin costs a CPU that long
// after every replay), and for as long as a replay whose wake-up node has
// run has not rung (up to kReplayFor: a graph whose gather comes late in
// it), then sleeps until a wake-up node wakes it.  It looks at the rings
// every kSleepCheck meanwhile, which takes no CPU to speak of, so that a
// ring is answered, and a stop seen, even without a wake.
constexpr auto kSpinFor = std::chrono::microseconds(500);
constexpr auto kReplayFor = std::chrono::milliseconds(100);
constexpr auto kSleepCheck = std::chrono::milliseconds(100);
// A wake-up node that found the thread asleep waits this long for its ring
// (which a graph whose gather comes first rings within microseconds) and
// answers it itself, rather than wait for the thread it woke to get a CPU;
// it holds the driver's host-function thread meanwhile.
constexpr auto kNodeSpin = std::chrono::microseconds(500);

void futex_wait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::nanoseconds timeout) {
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  struct timespec relative = {static_cast<time_t>(seconds.count()),
                              static_cast<long>((timeout - seconds).count())};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, &relative,
            nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>& word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
}

class DoorbellThread {
 public:
  ~DoorbellThread() {
    if (thread_ == nullptr) return;
    if (owner_ != ::getpid()) {
      // A forked child has the parent's object but not its thread: there is
      // nothing to stop or join.
      thread_.release();
      return;
    }
    stopping_.store(true);
    wake();
    thread_->join();
  }

  void watch(std::unique_ptr<DoorbellJob> job) {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(std::move(job));
    job_count_.store(jobs_.size(), std::memory_order_release);
    if (owner_ != ::getpid()) {  // none yet, or the parent's (in a forked child)
      thread_.release();
      owner_ = ::getpid();
      thread_ = std::make_unique<std::thread>([this] { serve(); });
    }
  }

  // Wakes the thread if it sleeps (a wake-up node's call, or a stop);
  // whether it slept.  Either the thread sees the wake before it sleeps, or
  // this sees it asleep: each stores its flag before it loads the other's.
  bool wake() {
    wakes_.fetch_add(1);
    if (!sleeping_.load()) return false;
    futex_wake(wakes_);
    return true;
  }

 private:
  void serve() {
    ::pthread_setname_np(::pthread_self(), "ple-doorbell");
    auto last_active = std::chrono::steady_clock::now();
    uint32_t seen_wakes = wakes_.load();
    while (!stopping_.load(std::memory_order_relaxed)) {
      const uint32_t wakes = wakes_.load();
      if (answer_rings() || wakes != seen_wakes) {
        seen_wakes = wakes;
        last_active = std::chrono::steady_clock::now();
        continue;
      }
      const auto idle = std::chrono::steady_clock::now() - last_active;
      if (idle < kSpinFor || (idle < kReplayFor && replay_in_flight())) {
        cpu_relax();
        continue;
      }
      sleeping_.store(true);
      if (wakes_.load() == seen_wakes && !rung()) futex_wait(wakes_, seen_wakes, kSleepCheck);
      sleeping_.store(false);
    }
  }

  // The jobs captured so far, in the doorbell thread's own list.
  const std::vector<DoorbellJob*>& watched() {
    if (job_count_.load(std::memory_order_acquire) != watched_.size()) {
      std::lock_guard<std::mutex> lock(mutex_);
      for (size_t i = watched_.size(); i < jobs_.size(); ++i) watched_.push_back(jobs_[i].get());
    }
    return watched_;
  }

  // Answers every rung doorbell; whether there was one.
  bool answer_rings() {
    bool answered = false;
    for (DoorbellJob* job : watched()) answered |= answer_ring(*job);
    return answered;
  }

  bool rung() {
    for (DoorbellJob* job : watched()) {
      if (job->words->ring.load(std::memory_order_acquire) == 1) return true;
    }
    return false;
  }

  bool replay_in_flight() {
    for (DoorbellJob* job : watched()) {
      if (job->replays.load() > job->answered.load()) return true;
    }
    return false;
  }

  std::mutex mutex_;
  std::deque<std::unique_ptr<DoorbellJob>> jobs_;  // grows under mutex_
  std::atomic<size_t> job_count_{0};  // jobs_.size(), read without the mutex
  std::vector<DoorbellJob*> watched_;  // the doorbell thread's copy of jobs_
  std::unique_ptr<std::thread> thread_;  // released, never destroyed, in a forked child
  pid_t owner_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<uint32_t> wakes_{0};  // counts wake() calls; the futex word
  std::atomic<bool> sleeping_{false};
};

WordSlabs& word_slabs() {
  static WordSlabs slabs;
  return slabs;
}

DoorbellThread& doorbell_thread() {
  static DoorbellThread thread;
  return thread;
}

std::atomic<bool> refused{false};

// The wake-up node's host function: see doorbell_gather.h.
void wake_for_replay(void* data) {
  DoorbellJob& job = *static_cast<DoorbellJob*>(data);
  const uint64_t replay = job.replays.fetch_add(1) + 1;
  if (job.answered.load() >= replay) return;  // rung and answered before this ran
  // Awake, the thread spins until this replay has rung (replay_in_flight).
  if (!doorbell_thread().wake()) return;
  const auto deadline = std::chrono::steady_clock::now() + kNodeSpin;
  while (job.answered.load() < replay && !answer_ring(job) &&
         std::chrono::steady_clock::now() < deadline) {
    cpu_relax();
  }
}

CUdeviceptr device_address(const std::atomic<uint32_t>& word) {
  CUdeviceptr address = 0;
  check(driver().mem_host_get_device_pointer(&address, const_cast<std::atomic<uint32_t>*>(&word), 0),
        "cuMemHostGetDevicePointer");
  return address;
}

}  // namespace

bool enqueue_doorbell_gather(CUstream stream, const HostGatherJob& job) {
  const Driver& cuda = driver();
  auto doorbell = std::make_unique<DoorbellJob>(job, word_slabs().take());
  CUdeviceptr ring = 0, done = 0;
  CUresult rung = 0;
  try {
    ring = device_address(doorbell->words->ring);
    done = device_address(doorbell->words->done);
    // The default write orders the ids' copy before the ring; a refusal of
    // the first operation leaves the capture as it was, and the words unused.
    rung = cuda.stream_write_value32(stream, ring, 1, kWriteValueDefault);
  } catch (...) {
    word_slabs().give_back(doorbell->words);
    throw;
  }
  if (rung != 0) {
    word_slabs().give_back(doorbell->words);
    refused.store(true);
    return false;
  }
  check(cuda.stream_wait_value32(stream, done, 1, kWaitValueEqual), "cuStreamWaitValue32");
  check(cuda.stream_write_value32(stream, done, 0, kWriteValueDefault), "cuStreamWriteValue32");
  // The wake-up node: a root of the graph, so that it runs as the replay
  // begins, alongside whatever the graph does before the ring.
  const CudaHostNodeParams wake_up{wake_for_replay, doorbell.get()};
  CUgraphNode node = nullptr;
  check(cuda.graph_add_host_node(&node, cuda.capturing_graph(stream), nullptr, 0, &wake_up),
        "cuGraphAddHostNode");
  doorbell_thread().watch(std::move(doorbell));
  return true;
}

bool doorbell_refused() { return refused.load(); }

}  // namespace ple
