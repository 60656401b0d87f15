#include "doorbell_gather.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include "mapped_table.h"
#include "worker_pool.h"

namespace ple {

namespace {

using Clock = std::chrono::steady_clock;

// After a ring it answered or a wake, the doorbell thread spins for
// kSpinFor: graphs replayed back to back ring again sooner, and each ring is
// then answered within a microsecond of the GPU's write.  It also spins while
// a replay whose wake-up node left the ring to it has not rung, for at most
// kReplayFor a replay; then it sleeps until a wake-up node wakes it, looking
// at the rings every kSleepCheck meanwhile (a safety net that takes a few us
// of CPU a check: no ring is ever left unanswered for longer).
constexpr auto kSpinFor = std::chrono::microseconds(500);
constexpr auto kReplayFor = std::chrono::milliseconds(100);
constexpr auto kSleepCheck = std::chrono::milliseconds(100);
// A wake-up node that found the thread asleep waits this long for its ring
// and answers it.  The ring follows the ids' copy, which the node runs
// beside, so it comes within microseconds; were the driver to run the node
// before the copy instead, the node hands the ring to the thread after this
// long rather than hold the copy (and the driver's host-function thread)
// back for ever.
constexpr auto kNodeWait = std::chrono::microseconds(500);
// A wake-up node that answered its ring wakes the thread when the replay
// before began less than this long ago: replays that come this close
// together are answered faster by the spinning thread.
constexpr auto kCloseReplays = kSpinFor;

// The graph sets `ring` to 1 once the ids are staged; whoever answers sets it
// back to 0, gathers, and sets `done` to 1; the graph waits for done == 1 and
// sets it to 0.  A graph's replays run one after another, so a ring always
// finds done at 0.  The two words sit on cache lines of their own: the GPU
// writes one while the host writes the other.
struct alignas(64) DoorbellWords {
  std::atomic<uint32_t> ring{0};
  alignas(64) std::atomic<uint32_t> done{0};
};

// One captured gather.  Never freed: a graph may be replayed, and its wake-up
// node run, as long as the process lives.
struct DoorbellJob {
  DoorbellJob(const HostGatherJob& gather, DoorbellWords* words) : gather(gather), words(words) {}

  HostGatherJob gather;
  DoorbellWords* words;
  // The replays whose wake-up node has run, and the rings answered.  A
  // replay's node runs before its ring is answered or after, never with
  // another replay of the graph between (a graph's replays run one after
  // another, each whole), so while replays > answered a replay is in flight.
  std::atomic<uint64_t> replays{0}, answered{0};
  DoorbellJob* next = nullptr;  // the job captured before it
  // The doorbell thread's own: the replay it last saw in flight, and since when.
  uint64_t in_flight = 0;
  Clock::time_point in_flight_since;
};

// Process-wide counts (DoorbellCounts).
std::atomic<uint64_t> by_thread{0}, by_node{0}, handed_over{0}, thread_wakes{0};

// Answers `job`'s ring if it is rung and no other thread took it: gathers,
// then raises done.  Whether this call answered it.
bool answer_ring(DoorbellJob& job, std::atomic<uint64_t>& count) {
  DoorbellWords& words = *job.words;
  if (words.ring.load(std::memory_order_acquire) != 1 ||
      words.ring.exchange(0, std::memory_order_acq_rel) != 1) {
    return false;
  }
  run_host_gather(job.gather);  // never throws
  job.answered.fetch_add(1);
  words.done.store(1, std::memory_order_release);
  count.fetch_add(1, std::memory_order_relaxed);
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

void futex_wait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::nanoseconds timeout) {
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  struct timespec relative = {static_cast<time_t>(seconds.count()),
                              static_cast<long>((timeout - seconds).count())};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, &relative,
            nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>& word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr,
            0);
}

// The doorbell thread and the jobs it watches.  Never destroyed, and the
// thread never joined: wake-up nodes and the thread may answer rings while
// the process exits, and what they use must outlive its static objects.
// Nothing here is a lock, so a fork leaves nothing held in the child.
class Doorbell {
 public:
  // Starts the thread in this process unless it runs: before anything of a
  // capture that needs it is enqueued, so that a thread that cannot start
  // leaves no ring unanswered.
  void ensure_thread() {
    const pid_t self = ::getpid();
    pid_t owner = owner_.load();
    // None yet, or the parent's (a forked child has its object, not its thread).
    if (owner == self || !owner_.compare_exchange_strong(owner, self)) return;
    try {
      std::thread([this] { serve(); }).detach();
    } catch (...) {
      owner_.store(0);
      throw;
    }
  }

  void watch(DoorbellJob* job) {
    job->next = jobs_.load();
    while (!jobs_.compare_exchange_weak(job->next, job)) {
    }
  }

  // Whether the thread sleeps, or is about to: a wake-up node that finds it
  // so answers its ring itself.  The node has counted its replay before it
  // asks, and the thread says it sleeps before it looks for replays in
  // flight (both sequentially consistent): either the thread sees the
  // replay and stays awake for it, or the node sees the thread asleep.
  bool asleep() const { return sleeping_.load(); }

  // Wakes the thread if it sleeps; it then spins for kSpinFor, and while a
  // replay is in flight.  Either the thread sees the wake before it sleeps,
  // or this sees it asleep: each stores its word before it loads the other's.
  void wake() {
    wakes_.fetch_add(1);
    if (sleeping_.load()) futex_wake(wakes_);
  }

  // Turned off, the thread sleeps after its spin as ever; turned on, it is
  // woken to spin.
  void set_always_spins(bool spin) {
    always_spins_.store(spin);
    if (spin) wake();
  }

 private:
  void serve() {
    ::pthread_setname_np(::pthread_self(), "ple-doorbell");
    auto last_active = Clock::now();
    uint32_t seen_wakes = wakes_.load();
    for (;;) {
      if (answer_rings()) {
        last_active = Clock::now();
        continue;
      }
      const uint32_t wakes = wakes_.load();
      if (wakes != seen_wakes) {
        seen_wakes = wakes;
        last_active = Clock::now();
        continue;
      }
      const auto now = Clock::now();
      if (now - last_active < kSpinFor || replay_in_flight(now) ||
          always_spins_.load(std::memory_order_relaxed)) {
        cpu_relax();
        continue;
      }
      sleeping_.store(true);
      if (wakes_.load() == seen_wakes && !rung() && !replay_in_flight(now)) {
        futex_wait(wakes_, seen_wakes, kSleepCheck);
      }
      sleeping_.store(false);
    }
  }

  // Answers every rung doorbell; whether there was one.
  bool answer_rings() {
    bool answered = false;
    for (DoorbellJob* job = jobs_.load(); job != nullptr; job = job->next) {
      answered |= answer_ring(*job, by_thread);
    }
    return answered;
  }

  bool rung() const {
    for (DoorbellJob* job = jobs_.load(); job != nullptr; job = job->next) {
      if (job->words->ring.load(std::memory_order_acquire) == 1) return true;
    }
    return false;
  }

  // Whether a replay whose wake-up node left its ring to this thread has not
  // rung yet, for less than kReplayFor (a replay still waiting after that is
  // answered by the checks of the sleep).
  bool replay_in_flight(Clock::time_point now) {
    bool any = false;
    for (DoorbellJob* job = jobs_.load(); job != nullptr; job = job->next) {
      const uint64_t replays = job->replays.load();
      if (replays <= job->answered.load()) continue;
      if (job->in_flight != replays) {
        job->in_flight = replays;
        job->in_flight_since = now;
        any = true;
      } else if (now - job->in_flight_since < kReplayFor) {
        any = true;
      }
    }
    return any;
  }

  std::atomic<DoorbellJob*> jobs_{nullptr};  // the last captured; each links the one before
  std::atomic<pid_t> owner_{0};  // the process whose thread serves: 0 before the first capture
  std::atomic<uint32_t> wakes_{0};  // counts wake() calls; the futex word
  std::atomic<bool> sleeping_{false};
  std::atomic<bool> always_spins_{false};
};

Doorbell& doorbell = *new Doorbell;
WordSlabs& word_slabs = *new WordSlabs;

std::atomic<bool> refused{false};

// When the last wake-up node began, in steady-clock ns.
std::atomic<int64_t> last_replay_ns{0};

int64_t ns(Clock::duration duration) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(duration).count();
}

// The wake-up node's host function (doorbell_gather.h).  It must not throw,
// nor wait for ever: the driver's host-function thread runs it.
void wake_for_replay(void* data) {
  DoorbellJob& job = *static_cast<DoorbellJob*>(data);
  const uint64_t replay = job.replays.fetch_add(1) + 1;
  const int64_t began = ns(Clock::now().time_since_epoch());
  const int64_t before = last_replay_ns.exchange(began, std::memory_order_relaxed);
  if (!doorbell.asleep()) return;  // the thread sees the replay in flight and answers it
  const auto deadline = Clock::now() + kNodeWait;
  while (job.answered.load() < replay && !answer_ring(job, by_node)) {
    if (Clock::now() >= deadline) {
      handed_over.fetch_add(1, std::memory_order_relaxed);
      doorbell.wake();
      return;
    }
    cpu_relax();
  }
  if (began - before < ns(kCloseReplays)) {
    thread_wakes.fetch_add(1, std::memory_order_relaxed);
    doorbell.wake();
  }
}

CUdeviceptr device_address(const std::atomic<uint32_t>& word) {
  CUdeviceptr address = 0;
  check(driver().mem_host_get_device_pointer(&address, const_cast<std::atomic<uint32_t>*>(&word), 0),
        "cuMemHostGetDevicePointer");
  return address;
}

// What the wake-up node of a gather whose ids' copy has just been captured
// depends on: what the nodes of the capture's frontier (the copy) depend on,
// so that it runs beside the copy; the frontier itself (it then runs beside
// the ring) where the driver cannot say.
std::vector<CUgraphNode> wake_up_dependencies(const CapturePoint& point) {
  std::vector<CUgraphNode> before;
  for (CUgraphNode node : point.frontier) {
    if (!driver().add_dependencies_of(node, before)) return point.frontier;
  }
  return before;
}

}  // namespace

bool enqueue_doorbell_gather(CUstream stream, const HostGatherJob& job) {
  const Driver& cuda = driver();
  doorbell.ensure_thread();
  DoorbellWords* words = word_slabs.take();
  CUdeviceptr ring = 0, done = 0;
  CUresult rung = 0;
  CapturePoint point;
  std::vector<CUgraphNode> wake_up_after;
  try {
    ring = device_address(words->ring);
    done = device_address(words->done);
    point = cuda.capture_point(stream);
    wake_up_after = wake_up_dependencies(point);
    // The default write orders the ids' copy before the ring; a refusal of
    // the first operation leaves the capture as it was, and the words unused.
    rung = cuda.stream_write_value32(stream, ring, 1, kWriteValueDefault);
  } catch (...) {
    word_slabs.give_back(words);
    throw;
  }
  if (rung != 0) {
    word_slabs.give_back(words);
    refused.store(true);
    return false;
  }
  // Watched from the ring on: whatever fails below, the thread answers it.
  auto* doorbell_job = new DoorbellJob(job, words);
  doorbell.watch(doorbell_job);
  check(cuda.stream_wait_value32(stream, done, 1, kWaitValueEqual), "cuStreamWaitValue32");
  check(cuda.stream_write_value32(stream, done, 0, kWriteValueDefault), "cuStreamWriteValue32");
  // Added to the graph, not to the stream's dependencies: nothing waits for it
  // but the replay's end.
  const CudaHostNodeParams wake_up{wake_for_replay, doorbell_job};
  CUgraphNode node = nullptr;
  check(cuda.graph_add_host_node(&node, point.graph, wake_up_after.data(), wake_up_after.size(),
                                 &wake_up),
        "cuGraphAddHostNode");
  return true;
}

bool doorbell_refused() { return refused.load(); }

DoorbellCounts doorbell_counts() {
  return {by_thread.load(), by_node.load(), handed_over.load(), thread_wakes.load()};
}

void set_doorbell_always_spins(bool spin) { doorbell.set_always_spins(spin); }

}  // namespace ple
