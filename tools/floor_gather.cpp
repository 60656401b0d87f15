// The floor of a warm gather, for tools/bench_warm.py: the rows of ple's
// gather copied out of the same files, mapped the same way (read-only,
// shared, MADV_RANDOM), with nothing else: no id checks, no counters, no
// fault guard.  Each of THREADS threads (kept for the whole run, spinning
// between calls) copies a contiguous slice of the request in request order,
// prefetching source and destination 12 rows ahead.
//
//   floor_gather THREADS ROW_BYTES ROWS_PER_CALL ROWS_FILE OUT_FILE FILE...
//
// ROWS_FILE holds int64 pairs (index into FILE..., byte offset), ROWS_PER_CALL
// pairs a call.  The calls run once untimed (page tables, caches), then
// timed; prints each timed call's microseconds on one line, and writes the
// last call's rows to OUT_FILE (for a comparison with ple's bytes).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kPrefetchRowsAhead = 12;

void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

void fail(const char* what, const char* path) {
  std::fprintf(stderr, "floor_gather: %s %s: %s\n", what, path, std::strerror(errno));
  std::exit(1);
}

const uint8_t* map_file(const char* path) {
  const int fd = ::open(path, O_RDONLY);
  if (fd < 0) fail("cannot open", path);
  struct stat st;
  if (::fstat(fd, &st) != 0) fail("cannot stat", path);
  void* base = ::mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) fail("cannot mmap", path);
  ::madvise(base, st.st_size, MADV_RANDOM);
  ::close(fd);
  return static_cast<const uint8_t*>(base);
}

void copy_slice(const uint8_t* const* src, int64_t begin, int64_t end, int64_t row_bytes,
                uint8_t* out) {
  for (int64_t i = begin; i < end; ++i) {
    if (i + kPrefetchRowsAhead < end) {
      const uint8_t* ahead = src[i + kPrefetchRowsAhead];
      __builtin_prefetch(ahead);
      __builtin_prefetch(ahead + row_bytes - 1);
      __builtin_prefetch(out + (i + kPrefetchRowsAhead) * row_bytes, 1);
      __builtin_prefetch(out + (i + kPrefetchRowsAhead + 1) * row_bytes - 1, 1);
    }
    std::memcpy(out + i * row_bytes, src[i], row_bytes);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: floor_gather THREADS ROW_BYTES ROWS_PER_CALL ROWS_FILE OUT_FILE FILE...\n");
    return 2;
  }
  const int threads = std::atoi(argv[1]);
  const int64_t row_bytes = std::atoll(argv[2]);
  const int64_t rows = std::atoll(argv[3]);
  std::vector<const uint8_t*> bases;
  for (int i = 6; i < argc; ++i) bases.push_back(map_file(argv[i]));

  FILE* list = std::fopen(argv[4], "rb");
  if (list == nullptr) fail("cannot open", argv[4]);
  std::vector<int64_t> pairs;
  int64_t pair[2];
  while (std::fread(pair, sizeof(pair), 1, list) == 1) pairs.insert(pairs.end(), pair, pair + 2);
  std::fclose(list);
  const int64_t calls = static_cast<int64_t>(pairs.size() / 2) / rows;
  std::vector<const uint8_t*> src(calls * rows);
  for (int64_t i = 0; i < calls * rows; ++i) src[i] = bases.at(pairs[2 * i]) + pairs[2 * i + 1];
  std::vector<uint8_t> out(rows * row_bytes, 1);  // touched: no fault in the timed calls

  // Call c runs when `started` reaches c + 1; each thread adds one to `done`.
  std::atomic<int64_t> started{0}, done{0};
  auto slice = [&](int64_t call, int t) {
    copy_slice(src.data() + call * rows, rows * t / threads, rows * (t + 1) / threads, row_bytes,
               out.data());
  };
  std::vector<std::thread> workers;
  for (int t = 1; t < threads; ++t) {
    workers.emplace_back([&, t] {
      for (int64_t seen = 0;; ++seen) {
        while (started.load(std::memory_order_acquire) == seen) spin_pause();
        const int64_t call = started.load(std::memory_order_acquire) - 1;
        if (call < 0) return;
        slice(call % calls, t);
        done.fetch_add(1, std::memory_order_acq_rel);
      }
    });
  }
  std::vector<double> micros;
  for (int64_t c = 0; c < 2 * calls; ++c) {  // the first `calls` untimed
    const auto start = std::chrono::steady_clock::now();
    done.store(0, std::memory_order_relaxed);
    started.store(c + 1, std::memory_order_release);
    slice(c % calls, 0);
    while (done.load(std::memory_order_acquire) != threads - 1) spin_pause();
    const auto end = std::chrono::steady_clock::now();
    if (c >= calls) micros.push_back(std::chrono::duration<double, std::micro>(end - start).count());
  }
  started.store(0, std::memory_order_release);  // call -1: the workers return
  for (auto& worker : workers) worker.join();

  for (size_t i = 0; i < micros.size(); ++i) std::printf(i ? " %.2f" : "%.2f", micros[i]);
  std::printf("\n");
  FILE* result = std::fopen(argv[5], "wb");
  if (result == nullptr || std::fwrite(out.data(), 1, out.size(), result) != out.size()) {
    fail("cannot write", argv[5]);
  }
  std::fclose(result);
  return 0;
}
