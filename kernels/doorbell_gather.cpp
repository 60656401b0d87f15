#include "doorbell_gather.h"

#include <pthread.h>
#include <sys/mman.h>
#include <sys/prctl.h>
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
  HostGatherJob gather;
  DoorbellWords* words;
};

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

// After a ring, the doorbell thread spins for kSpinFor (a decode loop's next
// step usually comes sooner), then looks every kNearPoll until kNearFor has
// passed without a ring, then every kFarPoll: a replay after a pause waits
// at most that long for its gather to start.
constexpr auto kSpinFor = std::chrono::milliseconds(2);
constexpr auto kNearPoll = std::chrono::microseconds(20);
constexpr auto kNearFor = std::chrono::milliseconds(200);
constexpr auto kFarPoll = std::chrono::milliseconds(1);

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

 private:
  void serve() {
    ::prctl(PR_SET_TIMERSLACK, 1UL);  // sleeps of kNearPoll, not of the default 50 us slack
    auto last_ring = std::chrono::steady_clock::now();
    while (!stopping_.load(std::memory_order_relaxed)) {
      if (answer_rings()) {
        last_ring = std::chrono::steady_clock::now();
        continue;
      }
      const auto idle = std::chrono::steady_clock::now() - last_ring;
      if (idle < kSpinFor) {
        cpu_relax();
      } else {
        std::this_thread::sleep_for(idle < kNearFor ? kNearPoll : std::chrono::microseconds(kFarPoll));
      }
    }
  }

  // Gathers for every rung doorbell; whether there was one.
  bool answer_rings() {
    if (job_count_.load(std::memory_order_acquire) != watched_.size()) {
      std::lock_guard<std::mutex> lock(mutex_);
      for (size_t i = watched_.size(); i < jobs_.size(); ++i) watched_.push_back(jobs_[i].get());
    }
    bool rung = false;
    for (DoorbellJob* job : watched_) {
      if (job->words->ring.load(std::memory_order_acquire) != 1) continue;
      job->words->ring.store(0, std::memory_order_relaxed);
      run_host_gather(job->gather);
      job->words->done.store(1, std::memory_order_release);
      rung = true;
    }
    return rung;
  }

  std::mutex mutex_;
  std::deque<std::unique_ptr<DoorbellJob>> jobs_;  // grows under mutex_
  std::atomic<size_t> job_count_{0};  // jobs_.size(), read without the mutex
  std::vector<DoorbellJob*> watched_;  // the doorbell thread's copy of jobs_
  std::unique_ptr<std::thread> thread_;  // released, never destroyed, in a forked child
  pid_t owner_ = 0;
  std::atomic<bool> stopping_{false};
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

CUdeviceptr device_address(const std::atomic<uint32_t>& word) {
  CUdeviceptr address = 0;
  check(driver().mem_host_get_device_pointer(&address, const_cast<std::atomic<uint32_t>*>(&word), 0),
        "cuMemHostGetDevicePointer");
  return address;
}

}  // namespace

bool enqueue_doorbell_gather(CUstream stream, const HostGatherJob& job) {
  const Driver& cuda = driver();
  auto doorbell = std::make_unique<DoorbellJob>(DoorbellJob{job, word_slabs().take()});
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
  doorbell_thread().watch(std::move(doorbell));
  return true;
}

bool doorbell_refused() { return refused.load(); }

}  // namespace ple
