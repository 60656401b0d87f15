// The doorbell's protocol on the CPU (tests/test_doorbell_protocol.py builds
// and runs this): kernels/doorbell_gather.cpp as it is, with the CUDA driver
// and the gather replaced.  Threads stand for the GPU, one a graph, and for
// the driver's thread that runs host functions: each replay posts its
// wake-up node to that thread, writes the ring (after a copy's few
// microseconds, or, "serialized", only once the node has returned, as a
// driver that ran the node before the copy would), waits for done with a
// deadline (a wait past it is a hang), lowers done, and waits for its node
// to end, as a graph's replay ends.  Every replay must be gathered exactly
// once, by one answerer at a time.  Prints one JSON line a phase: who
// answered its rings.
#include "../kernels/doorbell_gather.cpp"

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <random>

namespace ple {

const Driver& driver() {
  static const Driver none;
  return none;
}

void check(CUresult result, const char* what) {
  if (result != 0) throw std::runtime_error(what);
}

CapturePoint Driver::capture_point(CUstream) const { throw std::runtime_error("no driver"); }

bool Driver::add_dependencies_of(CUgraphNode, std::vector<CUgraphNode>&) const { return false; }

void page_lock(void*, size_t) {}

constexpr int kMaxGraphs = 8;
std::atomic<uint64_t> gathers[kMaxGraphs];
std::atomic<int> gathering[kMaxGraphs];
std::atomic<uint64_t> overlapping{0};

// A gather of `job.n` microseconds for graph `job.handle`.
void run_host_gather(const HostGatherJob& job) {
  if (gathering[job.handle].fetch_add(1) != 0) overlapping.fetch_add(1);
  const auto end = Clock::now() + std::chrono::microseconds(job.n);
  while (Clock::now() < end) cpu_relax();
  gathers[job.handle].fetch_add(1);
  gathering[job.handle].fetch_sub(1);
}

}  // namespace ple

namespace {

using ple::Clock;

[[noreturn]] void fail(const char* what, int graph, uint64_t replay) {
  std::printf("{\"failure\": \"%s\", \"graph\": %d, \"replay\": %llu}\n", what, graph,
              static_cast<unsigned long long>(replay));
  std::fflush(stdout);
  std::_Exit(1);
}

// The driver's host-function thread: runs the nodes posted to it in order.
class HostFunctionThread {
 public:
  HostFunctionThread() {
    std::thread([this] {
      for (;;) {
        std::function<void()> next;
        {
          std::unique_lock<std::mutex> lock(mutex_);
          posted_.wait(lock, [&] { return !queue_.empty(); });
          next = std::move(queue_.front());
          queue_.pop_front();
        }
        next();
      }
    }).detach();
  }

  void post(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(fn));
    }
    posted_.notify_one();
  }

 private:
  std::mutex mutex_;
  std::condition_variable posted_;
  std::deque<std::function<void()>> queue_;
};

HostFunctionThread& host_functions = *new HostFunctionThread;

template <typename Ready>
void wait_for(Ready ready, const char* what, int graph, uint64_t replay) {
  const auto deadline = Clock::now() + std::chrono::seconds(3);
  while (!ready()) {
    if (Clock::now() > deadline) fail(what, graph, replay);
    std::this_thread::yield();
  }
}

struct Graph {
  int index;
  ple::DoorbellWords words;
  ple::DoorbellJob* job;
  uint64_t replays = 0;

  Graph(int index, int gather_us) : index(index) {
    ple::HostGatherJob gather{index, 0, nullptr, gather_us, {0, 0}, nullptr, nullptr};
    job = new ple::DoorbellJob(gather, &words);
    ple::doorbell.ensure_thread();
    ple::doorbell.watch(job);
  }

  // One replay: its wake-up node beside the copy and the ring.
  void replay(bool serialized, int copy_us) {
    const uint64_t replay = ++replays;
    std::atomic<bool> node_done{false};
    host_functions.post([&] {
      ple::wake_for_replay(job);
      node_done.store(true);
    });
    if (serialized) {
      wait_for([&] { return node_done.load(); }, "the node never returned", index, replay);
    } else {
      const auto copied = Clock::now() + std::chrono::microseconds(copy_us);
      while (Clock::now() < copied) ple::cpu_relax();
    }
    words.ring.store(1, std::memory_order_release);
    wait_for([&] { return words.done.load(std::memory_order_acquire) == 1; },
             "no answer: the stream would wait for ever", index, replay);
    words.done.store(0, std::memory_order_relaxed);
    wait_for([&] { return node_done.load(); }, "the node never returned", index, replay);
    if (ple::gathers[index].load() != replay) fail("not one gather a replay", index, replay);
  }
};

void report(const char* phase, const ple::DoorbellCounts& before, uint64_t replays) {
  const ple::DoorbellCounts now = ple::doorbell_counts();
  std::printf(
      "{\"phase\": \"%s\", \"replays\": %llu, \"by_thread\": %llu, \"by_node\": %llu, "
      "\"handed_over\": %llu, \"thread_wakes\": %llu}\n",
      phase, static_cast<unsigned long long>(replays),
      static_cast<unsigned long long>(now.by_thread - before.by_thread),
      static_cast<unsigned long long>(now.by_node - before.by_node),
      static_cast<unsigned long long>(now.handed_over - before.handed_over),
      static_cast<unsigned long long>(now.thread_wakes - before.thread_wakes));
  std::fflush(stdout);
}

void pause_us(int us) { std::this_thread::sleep_for(std::chrono::microseconds(us)); }

// One graph replayed `count` times, each after `pause` us.
void phase(const char* name, Graph& graph, int count, int pause, bool serialized = false) {
  pause_us(5000);  // past the spin of whatever came before
  const ple::DoorbellCounts before = ple::doorbell_counts();
  for (int i = 0; i < count; ++i) {
    pause_us(pause);
    graph.replay(serialized, 5);
  }
  report(name, before, count);
}

}  // namespace

int main() {
  Graph first(0, 3);
  phase("after_pauses", first, 40, 3000);
  phase("back_to_back", first, 200, 0);
  phase("serialized", first, 10, 3000, true);
  ple::set_doorbell_always_spins(true);
  phase("always_spins", first, 40, 3000);
  ple::set_doorbell_always_spins(false);
  phase("after_a_long_pause", first, 3, 250000);

  // Graphs on streams of their own, at once, with every kind of pause
  // (around the spin, the in-flight bound and the sleep's checks), gathers
  // of 0 to 200 us, and now and then a serialized node.
  std::vector<std::unique_ptr<Graph>> graphs;
  for (int g = 1; g < 5; ++g) graphs.push_back(std::make_unique<Graph>(g, (g - 1) * 60));
  const ple::DoorbellCounts before = ple::doorbell_counts();
  std::vector<std::thread> streams;
  std::atomic<uint64_t> replays{0};
  for (auto& graph : graphs) {
    streams.emplace_back([&graph, &replays] {
      std::mt19937 random(graph->index);
      const int pauses[] = {0, 0, 20, 300, 450, 550, 900, 2000, 12000, 130000};
      const auto end = Clock::now() + std::chrono::seconds(3);
      while (Clock::now() < end) {
        pause_us(pauses[random() % 10]);
        graph->replay(random() % 10 == 0, static_cast<int>(random() % 20));
        replays.fetch_add(1);
      }
    });
  }
  for (std::thread& stream : streams) stream.join();
  report("concurrent", before, replays.load());
  if (ple::overlapping.load() != 0) fail("two answerers gathered one ring at once", -1, 0);
  std::printf("{\"done\": true}\n");
  return 0;
}
