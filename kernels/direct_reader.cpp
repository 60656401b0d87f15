#include "direct_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <numeric>
#include <stdexcept>

#include "gather_config.h"
#include "worker_pool.h"

namespace ple {

static_assert(kMaxIoBlockBytes <= kMaxReadBytes, "a block fits in one read");

namespace {

const uint64_t kPage = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));

// Below this many reads per thread, another thread costs more than it saves.
// A read costs about 6 us of CPU here, most of it the kernel's, whichever
// thread submits it; splitting 18,000 reads over 2 threads took the same CPU
// and 0.8x the time with the CPUs loaded by other processes (each thread
// gets its share of them), and about the same time on idle CPUs.
constexpr size_t kMinReadsPerThread = 1024;
// Nor fewer than this many reads in flight per thread: a thread with a few
// reads wakes for nearly every completion.  On the 16-CPU H200 machine 16
// threads of 4 reads (the default depth of 64 split over its threads) cost
// 23 us of CPU a page, one thread of 64 (the benchmark's own AIO reader) 4.
constexpr int kMinDepthPerThread = 32;

// How long a thread waits for completions before it looks whether the
// gather should stop (interrupt.h polls every 50 ms).
constexpr int kWaitMs = 10;

// A thread waits for this share of its reads in flight to complete before it
// queues more: one kernel call submits and reaps a batch, and a virtual
// disk's doorbell rings once a batch rather than once a read, while the
// queue stays at least 3/4 full.
constexpr int kReapBatchDivisor = 4;

int open_direct(const MappedFile& file) {
  // The table's own descriptor, opened again: the file the table mapped.
  const std::string self = "/proc/self/fd/" + std::to_string(file.fd);
  const int fd = ::open(self.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd >= 0) return fd;
  if (errno == EINVAL) {
    throw OsError(file.path + ": its filesystem refuses O_DIRECT, which io=\"direct\" reads with "
                  "(io=\"mmap\" reads this table through the page cache)");
  }
  throw OsError("cannot open " + file.path + " with O_DIRECT (as " + self + "): " +
                std::strerror(errno));
}

// The offset alignment that direct reads of `fd` need, where the kernel says
// (statx STATX_DIOALIGN, Linux 6.1; 0 where it does not say: tmpfs, older
// kernels).  OsError where it says the file cannot be read directly (a
// filesystem that would quietly read it through the page cache instead).
uint64_t direct_alignment(int fd, const std::string& path) {
#ifdef STATX_DIOALIGN
  struct statx about;
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &about) != 0 ||
      !(about.stx_mask & STATX_DIOALIGN)) {
    return 0;
  }
  if (about.stx_dio_offset_align == 0) {
    throw OsError(path + ": its filesystem cannot read this file with O_DIRECT (statx reports "
                  "no direct I/O alignment), which io=\"direct\" needs");
  }
  if (about.stx_dio_mem_align > kPage || about.stx_dio_offset_align > kMaxReadBytes) {
    throw OsError(path + ": direct reads of it need an alignment of " +
                  std::to_string(about.stx_dio_offset_align) + " bytes (buffers " +
                  std::to_string(about.stx_dio_mem_align) + "), more than io=\"direct\" supports");
  }
  // The rest of a read that came back short starts in the buffer as far in
  // as in the file: both alignments hold for it where it holds for the larger.
  return std::max<uint64_t>(about.stx_dio_offset_align, about.stx_dio_mem_align);
#else
  (void)fd;
  (void)path;
  return 0;
#endif
}

// What every thread of one direct read shares.
struct Plan {
  const DirectFiles& files;
  uint64_t block;
  IoBackend backend;
  int64_t row_bytes;
  uint8_t* out;
  const std::function<int64_t(int64_t)>& id_at;
  std::vector<PlacedRow>& rows;   // in file order
  std::vector<DirectRead>& reads;  // in file order
  uint64_t unique_pages = 0;

  // Places the rows, sorted by address, in their files and lists the reads
  // that cover their blocks: each distinct block once, adjacent blocks of a
  // file in one read of up to kMaxReadBytes.
  void make(const RowRef* by_address, size_t n) {
    const auto& table_files = files.files();
    rows.resize(n);
    reads.clear();
    uint32_t f = 0;
    uint64_t last_page = 0;
    bool counted = false;  // whether last_page is a page of file f
    for (size_t j = 0; j < rows.size(); ++j) {
      const uintptr_t address = by_address[j].address;
      while (address >= table_files[f].base + table_files[f].size) {
        ++f;
        counted = false;
      }
      // The walk goes forward through the files: it needs read_direct's order.
      if (address < table_files[f].base) throw std::logic_error("read_direct: rows out of address order");
      const uint64_t offset = address - table_files[f].base;
      rows[j] = {f, offset, by_address[j].position};

      const uint64_t first = offset / kPage, last = (offset + row_bytes - 1) / kPage;
      const uint64_t fresh = counted ? std::max(first, last_page + 1) : first;
      if (fresh <= last) unique_pages += last - fresh + 1;
      last_page = counted ? std::max(last_page, last) : last;
      counted = true;

      uint64_t from = offset & ~(block - 1);
      const uint64_t to = (offset + row_bytes + block - 1) & ~(block - 1);
      if (!reads.empty() && reads.back().file == f) {
        from = std::max(from, reads.back().offset + reads.back().length);
      }
      while (from < to) {
        DirectRead* previous = reads.empty() ? nullptr : &reads.back();
        if (previous != nullptr && previous->file == f &&
            previous->offset + previous->length == from && previous->length < kMaxReadBytes) {
          const uint64_t more = std::min<uint64_t>(to - from, kMaxReadBytes - previous->length);
          previous->length += static_cast<uint32_t>(more);
          from += more;
        } else {
          const uint64_t length = std::min<uint64_t>(to - from, kMaxReadBytes);
          reads.push_back({f, from, static_cast<uint32_t>(length), j});
          from += length;
        }
      }
    }
  }
};

// Reads reads [begin, end) of a plan with the calling thread's engine, at
// most `share` in flight, and copies their rows out.  Whatever ends it, it
// leaves no read in flight: the kernel writes the engine's buffers until
// each read completes, and the thread's next gather reuses them.
class PartRead {
 public:
  PartRead(const Plan& plan, size_t begin, size_t end, int share, Interruption& stop)
      : plan_(plan), begin_(begin), end_(end), share_(share), stop_(stop),
        engine_(plan.backend, share), slot_read_(share), slot_done_(share),
        done_(share) {}

  ~PartRead() { drain(); }

  DirectCounters run() {
    std::vector<int> free_slots(share_);
    std::iota(free_slots.rbegin(), free_slots.rend(), 0);
    std::vector<IoRead> batch;
    size_t next = begin_, finished = 0;
    while (finished < end_ - begin_) {
      stop_.check();
      batch.swap(again_);
      again_.clear();
      while (!free_slots.empty() && next < end_) {
        const int slot = free_slots.back();
        free_slots.pop_back();
        slot_read_[slot] = next++;
        slot_done_[slot] = 0;
        batch.push_back(io_read(slot));
      }
      if (!batch.empty()) {
        engine_->submit(batch.data(), static_cast<int>(batch.size()));
        in_flight_ += static_cast<int>(batch.size());
        batch.clear();
      }
      const int wanted = std::max(1, in_flight_ / kReapBatchDivisor);
      const int got = engine_->reap(done_.data(), share_, wanted, kWaitMs);
      in_flight_ -= got;
      for (int i = 0; i < got; ++i) {
        if (complete(done_[i].tag, done_[i].result)) {
          ++finished;
          free_slots.push_back(static_cast<int>(done_[i].tag));
        }
      }
    }
    return counters_;
  }

 private:
  IoRead io_read(int slot) const {
    const DirectRead& read = plan_.reads[slot_read_[slot]];
    const uint32_t done = slot_done_[slot];
    return {plan_.files.files()[read.file].fd, read.offset + done, read.length - done,
            engine_->buffer(slot) + done, static_cast<uint32_t>(slot)};
  }

  // A read of `slot` returned `result`: true when its read is done (its rows
  // copied), false when the rest of it was queued again.
  bool complete(uint32_t slot, int64_t result) {
    const DirectRead& read = plan_.reads[slot_read_[slot]];
    const DirectFiles::File& file = plan_.files.files()[read.file];
    if (result == -EINTR || result == -EAGAIN) {
      again_.push_back(io_read(slot));
      return false;
    }
    if (result < 0) {
      throw OsError(where(plan_.rows[read.first_row]) + " could not be read: " +
                    std::strerror(static_cast<int>(-result)) + " (an O_DIRECT read of " +
                    std::to_string(read.length) + " bytes at byte " + std::to_string(read.offset) +
                    ")");
    }
    const uint64_t got = slot_done_[slot] + static_cast<uint64_t>(result);
    // Short of what the file held at open, and on a block boundary (not the
    // file's end): the rest is read again.
    const uint64_t expected = std::min<uint64_t>(read.length, file.size - std::min(file.size, read.offset));
    if (result > 0 && got < expected && got % plan_.files.alignment() == 0) {
      slot_done_[slot] = static_cast<uint32_t>(got);
      again_.push_back(io_read(slot));
      return false;
    }
    copy_rows(read, engine_->buffer(static_cast<int>(slot)), got);
    counters_.reads += 1;
    counters_.read_bytes += got;
    return true;
  }

  // Copies the bytes of `read` (`got` of them came) that rows need; a row
  // whose bytes lie past `got` is in a file that is shorter now.
  void copy_rows(const DirectRead& read, const uint8_t* buffer, uint64_t got) {
    const int64_t row_bytes = plan_.row_bytes;
    const uint64_t end = read.offset + read.length, valid_end = read.offset + got;
    for (size_t j = read.first_row; j < plan_.rows.size(); ++j) {
      const PlacedRow& row = plan_.rows[j];
      if (row.file != read.file || row.offset >= end) break;
      const uint64_t from = std::max(row.offset, read.offset);
      const uint64_t to = std::min(row.offset + row_bytes, end);
      if (to > valid_end) throw OsError(where(row) + " could not be read (" + why_short(read, got) + ")");
      std::memcpy(plan_.out + row.position * row_bytes + (from - row.offset),
                  buffer + (from - read.offset), to - from);
    }
  }

  // Why `read` returned only `got` bytes: the file is shorter now, or (a
  // disk or filesystem that ends reads early) what the read returned.
  std::string why_short(const DirectRead& read, uint64_t got) const {
    const DirectFiles::File& file = plan_.files.files()[read.file];
    struct stat now;
    if (::fstat(file.fd, &now) == 0 && static_cast<uint64_t>(now.st_size) < file.size) {
      return "the file is now " + std::to_string(now.st_size) + " bytes, shorter than the " +
             std::to_string(file.size) + " it had when the table was opened";
    }
    return "an O_DIRECT read of " + std::to_string(read.length) + " bytes at byte " +
           std::to_string(read.offset) + " returned " + std::to_string(got);
  }

  // "<file>, byte <offset>: row <id>", as the mmap gather names a row.
  std::string where(const PlacedRow& row) const {
    return plan_.files.files()[row.file].path + ", byte " + std::to_string(row.offset) +
           ": row " + std::to_string(plan_.id_at(row.position));
  }

  void drain() noexcept {
    try {
      while (in_flight_ > 0) in_flight_ -= engine_->reap(done_.data(), share_, in_flight_, 100);
    } catch (...) {
      // The engine cannot say when its reads end: it must never be used again.
      engine_.abandon();
    }
  }

  const Plan& plan_;
  size_t begin_, end_;
  int share_;
  Interruption& stop_;
  ThreadEngine engine_;
  std::vector<size_t> slot_read_;     // per buffer: the read it holds
  std::vector<uint32_t> slot_done_;   // per buffer: the bytes already read
  std::vector<IoDone> done_;
  std::vector<IoRead> again_;  // the rest of reads that came back short, to queue again
  int in_flight_ = 0;
  DirectCounters counters_;
};

}  // namespace

DirectFiles::DirectFiles(const std::vector<MappedFile>& files) {
  uint64_t alignment = 0;
  bool told = true;  // whether the kernel said every file's alignment
  try {
    for (const MappedFile& mapped : files) {
      files_.push_back({mapped.path, open_direct(mapped), mapped.size,
                        reinterpret_cast<uintptr_t>(mapped.base)});
      const uint64_t needed = direct_alignment(files_.back().fd, mapped.path);
      told = told && needed != 0;
      alignment = std::max(alignment, needed);
    }
  } catch (...) {
    for (const File& file : files_) ::close(file.fd);
    throw;
  }
  std::sort(files_.begin(), files_.end(),
            [](const File& a, const File& b) { return a.base < b.base; });
  alignment_ = told ? alignment : std::max(alignment, kPage);
}

DirectFiles::~DirectFiles() {
  for (const File& file : files_) ::close(file.fd);
}

DirectCounters read_direct(const DirectFiles& files, uint64_t block, IoBackend backend, int depth,
                           int threads, int64_t row_bytes, const RowRef* by_address, size_t n,
                           DirectScratch& scratch, uint8_t* out,
                           const std::function<int64_t(int64_t)>& id_at, Interruption& stop) {
  Plan plan{files, block, backend, row_bytes, out, id_at, scratch.placed, scratch.reads};
  plan.make(by_address, n);
  stop.check();
  const size_t reads = plan.reads.size();
  const int parts = static_cast<int>(std::max<size_t>(
      1, std::min<size_t>({static_cast<size_t>(threads),
                           static_cast<size_t>(depth / kMinDepthPerThread),
                           reads / kMinReadsPerThread})));
  std::vector<DirectCounters> results(parts);
  // A part's reads end where a read ends, so no two threads copy the same
  // bytes of a row (a row split between two reads may be copied by two).
  run_parallel(
      parts,
      [&](int p) {
        const int share = depth / parts + (p < depth % parts ? 1 : 0);
        PartRead part(plan, reads * p / parts, reads * (p + 1) / parts, share, stop);
        results[p] = part.run();
      },
      [&] { stop.poll_if_due(); });
  DirectCounters total;
  total.unique_pages = plan.unique_pages;
  for (const DirectCounters& r : results) {
    total.reads += r.reads;
    total.read_bytes += r.read_bytes;
  }
  return total;
}

}  // namespace ple
