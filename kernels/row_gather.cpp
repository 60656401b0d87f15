// The row gather: copies requested rows out of a MappedTable.  Each thread
// copies its slice of the request in request order while the slice is warm;
// what may be cold is copied in ascending address order while a bounded
// amount of MADV_WILLNEED advice is kept ahead of the copy.  See README
// "Prefetch policies" for why.
#include "row_gather.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "direct_reader.h"
#include "fault_guard.h"
#include "interrupt.h"
#include "mapped_table.h"
#include "row_cache.h"
#include "worker_pool.h"

namespace ple {

namespace {

// Below this many rows per thread, handing rows to another thread costs more than it saves.
constexpr int64_t kMinRowsPerThread = 256;

const uintptr_t kPage = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
const int kPageShift = __builtin_ctzll(kPage);

uintptr_t page_of(uintptr_t address) { return address & ~(kPage - 1); }

// A row whose bytes could not be read: its copy raised SIGBUS.
struct RowFault : std::exception {
  explicit RowFault(RowRef row) : row(row) {}
  const char* what() const noexcept override { return "a row could not be read"; }
  RowRef row;
};

struct CopyCounters {
  uint64_t unique_pages = 0, advised_pages = 0, resident_pages = 0,
           evicted_before_copy = 0, max_advised_ahead_bytes = 0,
           major_faults = 0, minor_faults = 0;
};

// An array kept from one gather to the next, grown when a gather needs more;
// its elements are not initialised (the gather writes them before reading).
template <typename T>
class ScratchArray {
 public:
  T* reserve(size_t n) {
    if (n > capacity_) {
      data_.reset(new T[n]);
      capacity_ = n;
    }
    return data_.get();
  }
  T* data() const { return data_.get(); }
  uint64_t bytes() const { return capacity_ * sizeof(T); }

 private:
  std::unique_ptr<T[]> data_;
  size_t capacity_ = 0;
};

// Which pages of the table's mappings this gather has copied or listed,
// for counting distinct pages across threads and duplicated ids.  Each page
// has a 16-bit mark: the number of the last gather that saw it, so that a
// gather starts without clearing anything (the marks are reset once every
// 65,535 gathers).  2 bytes per 4 KiB page of the mappings' span (1/2048 of
// the table's bytes, more where other mappings lie between its files), in
// memory that is backed only where marked.
class PageMarks {
 public:
  PageMarks(uintptr_t begin, uintptr_t end)
      : begin_(page_of(begin)),
        marks_((((end - begin_) >> kPageShift) + 1) * sizeof(uint16_t), /*sparse=*/true) {}

  void start_gather() {
    if (++gather_ == 0) {
      marks_.discard();
      gather_ = 1;
    }
  }
  // Marks the page at `page`; true for the one caller, of any thread, that
  // marked it first in this gather.
  bool mark(uintptr_t page) {
    uint16_t* mark = slot(page);
    if (__atomic_load_n(mark, __ATOMIC_RELAXED) == gather_) return false;
    return __atomic_exchange_n(mark, gather_, __ATOMIC_RELAXED) != gather_;
  }
  void prefetch(uintptr_t page) const { __builtin_prefetch(slot(page), 1); }

 private:
  uint16_t* slot(uintptr_t page) const {
    return reinterpret_cast<uint16_t*>(marks_.data()) + ((page - begin_) >> kPageShift);
  }

  uintptr_t begin_;
  LazyArray marks_;
  uint16_t gather_ = 0;
};

// A slice of the request, one thread's share of the copy in request order:
// its disk-tier rows are rows[begin, end) of the gather's row list.
struct Part {
  int64_t begin = 0, end = 0;
  int64_t copied = 0;  // rows[begin, begin + copied) were copied in request order
  int64_t first_bad = -1;  // position of its first id out of range, if any
  uintptr_t lowest = UINTPTR_MAX, highest = 0;  // its rows' addresses
  CopyCounters counters;
  int64_t rest_begin() const { return begin + copied; }
  int64_t rest() const { return end - rest_begin(); }
};

template <typename T>
uint64_t bytes_of(const std::vector<T>& v) {
  return v.capacity() * sizeof(T);
}

// What a ChunkGather of the sorted path keeps between gathers.
struct ChunkScratch {
  std::vector<uintptr_t> pages;
  ScratchArray<size_t> first_page;
  std::vector<uint8_t> state;
  std::vector<uint8_t> known;  // PageResidency's answers
  std::vector<unsigned char> mincore_vector;

  uint64_t bytes() const {
    return bytes_of(pages) + first_page.bytes() + bytes_of(state) + bytes_of(known) +
           bytes_of(mincore_vector);
  }
};

// The most scratch a gather's arrays keep for the next gather: what a call
// of about 1,000,000 warm rows needs (16 B a row: the row list), or of
// 300,000 cold ones (about 50 B a row with the sorted list and the page
// lists), or of 200,000 direct reads (80 B a row with the read plan).  A
// call that needed more frees all of its scratch when it ends: one huge
// request must not hold hundreds of MiB until the table closes.
constexpr uint64_t kKeptScratchBytes = 16ull << 20;

}  // namespace

struct GatherScratch {
  explicit GatherScratch(const MappedTable& table)
      : marks(table.mapped_begin(), table.mapped_end()) {}

  std::vector<Part> parts;
  ScratchArray<RowRef> rows;    // by position in the request, slice by slice
  ScratchArray<RowRef> sorted;  // the rows left to the sorted path, by address
  ScratchArray<int64_t> bucket_slots, bucket_start;  // sort_by_address's
  std::vector<int64_t> range_first;                  // sort_by_address's
  std::vector<int64_t> chunk_starts;
  std::vector<ChunkScratch> chunks;
  std::vector<CopyCounters> chunk_counters;
  DirectScratch direct;  // with io "direct"
  PageMarks marks;
  // The last gather through this scratch copied every row in request order
  // without a major fault (see kUnsampledRows).
  bool last_gather_warm = false;

  // What the arrays sized by the request hold (not the marks, which are
  // sized by the table and backed only where marked).
  uint64_t request_bytes() const {
    uint64_t bytes = bytes_of(parts) + rows.bytes() + sorted.bytes() + bucket_slots.bytes() +
                     bucket_start.bytes() + bytes_of(range_first) + bytes_of(chunk_starts) +
                     bytes_of(chunks) + bytes_of(chunk_counters) + direct.bytes();
    for (const ChunkScratch& chunk : chunks) bytes += chunk.bytes();
    return bytes;
  }
};

GatherScratchPool::GatherScratchPool() = default;
GatherScratchPool::~GatherScratchPool() = default;

std::unique_ptr<GatherScratch> GatherScratchPool::take() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (free_.empty()) return nullptr;
  std::unique_ptr<GatherScratch> scratch = std::move(free_.back());
  free_.pop_back();
  return scratch;
}

void GatherScratchPool::give_back(std::unique_ptr<GatherScratch> scratch) noexcept {
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(std::move(scratch));
  } catch (...) {
    // Out of memory for the pool's list: the scratch goes, the next gather makes one.
  }
}

namespace {

// A gather's scratch, taken from its table's pool for the gather and given
// back after it, unless it grew past kKeptScratchBytes: then it is freed
// (the next gather makes a new one).
class ScratchLease {
 public:
  explicit ScratchLease(MappedTable& table)
      : pool_(table.scratch_pool()), scratch_(pool_.take()) {
    if (!scratch_) scratch_ = std::make_unique<GatherScratch>(table);
    scratch_->marks.start_gather();
  }
  ~ScratchLease() {
    if (scratch_->request_bytes() <= kKeptScratchBytes) pool_.give_back(std::move(scratch_));
  }
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;
  GatherScratch& operator*() const { return *scratch_; }

 private:
  GatherScratchPool& pool_;
  std::unique_ptr<GatherScratch> scratch_;
};

// Rows are far apart, so each copy waits on a page-table walk and a cache
// miss; prefetching the rows this far ahead overlaps those waits.  A
// prefetch of an address whose page is not mapped is dropped: it never faults.
constexpr int64_t kPrefetchRowsAhead = 12;

void prefetch_row(const RowRef& row, const uint8_t* out, int64_t row_bytes) {
  const auto* src = reinterpret_cast<const char*>(row.address);
  const uint8_t* dst = out + row.position * row_bytes;
  __builtin_prefetch(src);
  __builtin_prefetch(src + row_bytes - 1);
  __builtin_prefetch(dst, 1);
  __builtin_prefetch(dst + row_bytes - 1, 1);
}

// Every kCheckRows rows a thread copies, it looks whether the gather should
// stop (and the thread that started it polls, see interrupt.h); at every
// kHandlerCheckRows rows, or kHandlerCheckInterval, whichever comes first, it
// makes sure that the SIGBUS handler is still the guard's (a sigaction call,
// about 0.3 us here): a handler installed in the middle of a gather is
// replaced by the guard's, chained to it, before the thread copies more.
constexpr int64_t kCheckRows = 32;
constexpr int64_t kHandlerCheckRows = 256;
constexpr auto kHandlerCheckInterval = std::chrono::milliseconds(1);

class Checkpoints {
 public:
  explicit Checkpoints(Interruption& stop)
      : stop_(stop), next_handler_check_(std::chrono::steady_clock::now() + kHandlerCheckInterval) {}

  // At row k of a thread's rows, a multiple of kCheckRows; `now` is the time.
  void at(int64_t k, std::chrono::steady_clock::time_point now) {
    stop_.check();
    if (k % kHandlerCheckRows == 0 || now >= next_handler_check_) {
      ensure_fault_handler();
      next_handler_check_ = now + kHandlerCheckInterval;
    }
  }

 private:
  Interruption& stop_;
  std::chrono::steady_clock::time_point next_handler_check_;
};

// The calling thread's page faults so far.
struct ThreadFaults {
  uint64_t major = 0, minor = 0;
  static ThreadFaults now() {
    struct rusage usage;
    ::getrusage(RUSAGE_THREAD, &usage);
    return {static_cast<uint64_t>(usage.ru_majflt), static_cast<uint64_t>(usage.ru_minflt)};
  }
};

// A thread that copies while warm reads its major faults (a getrusage call,
// about 0.6 us here) at least every kWarmBatchRows rows: the pages of rows
// copied between two readings that differ do not count as resident.
constexpr int64_t kWarmBatchRows = 256;

// The copy in request order of one slice starts when the first page of each
// of its first kWarmSampleRows rows is resident (one mincore call a row): a
// cold slice goes to the sorted path at once, without a synchronous fault.
constexpr int64_t kWarmSampleRows = 4;
// A slice of at most kUnsampledRows rows skips the sample when the gather
// before, through the same scratch, copied everything in request order
// without a major fault: a decode step's few rows cost less to copy than the
// mincore calls (about 0.7 us each), and a table that was warm a moment ago
// mostly still is; one that went cold costs a batch of synchronous faults.
constexpr int64_t kUnsampledRows = 64;
// It copies kGuardRows rows under one SIGBUS guard.  A batch that took
// longer than kSlowBatch may have waited for the disk, and the thread reads
// its major faults after it too; the first reading that shows a fault ends
// the copy in request order, so that a slice that turns cold pays a batch of
// synchronous faults at most before its rest is read with advice.  A warm
// batch takes a few us, minor faults included; a major fault, tens.
constexpr int64_t kGuardRows = 16;
constexpr auto kSlowBatch = std::chrono::microseconds(10);
static_assert(kCheckRows % kGuardRows == 0 && kWarmBatchRows % kGuardRows == 0,
              "checkpoints and fault readings fall on batch boundaries");

// Copies rows[0, n) (a slice of the request, in request order) while they
// look warm, and marks their pages in `marks`.
class RequestOrderCopy {
 public:
  // `sample`: look at the first rows' residency before starting.
  RequestOrderCopy(const RowRef* rows, int64_t n, int64_t row_bytes, uint8_t* out,
                   PageMarks& marks, bool sample, bool counts_resident, Interruption& stop)
      : rows_(rows), n_(n), row_bytes_(row_bytes), out_(out), marks_(marks), sample_(sample),
        counts_resident_(counts_resident), checkpoints_(stop) {}

  // Returns how many rows were copied, from the first; the others are left
  // to the sorted path.  Pages of batches copied without a major fault count
  // as resident.
  int64_t run() {
    const ThreadFaults before = ThreadFaults::now();
    uint64_t unconfirmed = 0;  // pages marked since the last reading without a major fault
    int64_t k = 0;
    if (!sample_ || looks_warm()) {
      auto batch_start = std::chrono::steady_clock::now();
      while (k < n_) {
        if (k % kCheckRows == 0 && k > 0) checkpoints_.at(k, batch_start);
        const int64_t end = std::min(n_, k + kGuardRows);
        copy_batch(k, end);
        unconfirmed += mark_pages(k, end);
        k = end;
        const auto now = std::chrono::steady_clock::now();
        if (now - batch_start > kSlowBatch || k % kWarmBatchRows == 0) {
          if (ThreadFaults::now().major != before.major) break;
          count_resident(unconfirmed);
          unconfirmed = 0;
        }
        batch_start = now;
      }
    }
    const ThreadFaults after = ThreadFaults::now();
    if (after.major == before.major) count_resident(unconfirmed);
    counters_.major_faults = after.major - before.major;
    counters_.minor_faults = after.minor - before.minor;
    return k;
  }

  const CopyCounters& counters() const { return counters_; }

 private:
  bool looks_warm() const {
    unsigned char resident = 0;
    for (int64_t k = 0; k < std::min(n_, kWarmSampleRows); ++k) {
      void* page = reinterpret_cast<void*>(page_of(rows_[k].address));
      if (::mincore(page, kPage, &resident) != 0 || !(resident & 1)) return false;
    }
    return true;
  }

  void count_resident(uint64_t pages) {
    if (counts_resident_) counters_.resident_pages += pages;
  }

  // Copies rows [begin, end); when one of them cannot be read, finds it
  // (the rows before it are written again) and throws RowFault.
  void copy_batch(int64_t begin, int64_t end) {
    auto copy = [&] {
      for (int64_t k = begin; k < end; ++k) {
        if (k + kPrefetchRowsAhead < n_) {
          const RowRef& ahead = rows_[k + kPrefetchRowsAhead];
          prefetch_row(ahead, out_, row_bytes_);
          marks_.prefetch(page_of(ahead.address));
        }
        std::memcpy(destination(k), source(k), row_bytes_);
      }
    };
    if (run_guarded(copy)) return;
    for (int64_t k = begin; k < end; ++k) {
      if (!guarded_copy(destination(k), source(k), row_bytes_)) throw RowFault(rows_[k]);
    }
  }

  // Marks the pages of rows [begin, end); returns how many this call marked first.
  uint64_t mark_pages(int64_t begin, int64_t end) {
    uint64_t first = 0;
    for (int64_t k = begin; k < end; ++k) {
      const uintptr_t last = page_of(rows_[k].address + row_bytes_ - 1);
      for (uintptr_t page = page_of(rows_[k].address); page <= last; page += kPage) {
        first += marks_.mark(page);
      }
    }
    counters_.unique_pages += first;
    return first;
  }

  uint8_t* destination(int64_t k) const { return out_ + rows_[k].position * row_bytes_; }
  const void* source(int64_t k) const { return reinterpret_cast<const void*>(rows_[k].address); }

  const RowRef* rows_;
  int64_t n_;
  int64_t row_bytes_;
  uint8_t* out_;
  PageMarks& marks_;
  bool sample_;
  bool counts_resident_;  // the policy advises: resident_pages is counted
  Checkpoints checkpoints_;
  CopyCounters counters_;
};

// kCopied: the page was marked earlier in this gather (by the copy in
// request order), so it was copied and is not counted again.
enum PageState : uint8_t { kUnseen, kResident, kCopied, kAdvised, kAdvisedCopied };

bool advised(uint8_t state) { return state == kAdvised || state == kAdvisedCopied; }

// One mincore call answers for a run of requested pages that lie at most
// kMincoreGapPages apart, up to kMincoreSpanPages in all: in the kernel a page
// costs far less than a call, and with one call per page the mincore calls of
// a warm request cost more than its copy.
constexpr uintptr_t kMincoreGapPages = 64;
constexpr uintptr_t kMincoreSpanPages = 4096;

// Residency of a sorted list of pages, asked of mincore a run at a time.
class PageResidency {
 public:
  PageResidency(const std::vector<uintptr_t>& pages, std::vector<uint8_t>& known,
                std::vector<unsigned char>& vec)
      : pages_(pages), known_(known), vec_(vec) {}

  // Forgets every answer: call once the pages are listed.
  void start() {
    known_.assign(pages_.size(), kUnknown);
    vec_.resize(kMincoreSpanPages);
  }

  bool resident(size_t i) {
    if (known_[i] == kUnknown) ask_from(i);
    return known_[i] == kYes;
  }

 private:
  enum : uint8_t { kUnknown, kYes, kNo };

  void ask_from(size_t i) {
    size_t end = i + 1;
    while (end < pages_.size() && pages_[end] - pages_[end - 1] <= kMincoreGapPages * kPage &&
           pages_[end] - pages_[i] < kMincoreSpanPages * kPage) {
      ++end;
    }
    const uintptr_t length = pages_[end - 1] - pages_[i] + kPage;
    if (::mincore(reinterpret_cast<void*>(pages_[i]), length, vec_.data()) == 0) {
      for (size_t j = i; j < end; ++j) known_[j] = vec_[(pages_[j] - pages_[i]) / kPage] & 1 ? kYes : kNo;
      return;
    }
    // The run crossed a hole between two files' mappings: ask page by page.
    for (size_t j = i; j < end; ++j) {
      const bool ok = ::mincore(reinterpret_cast<void*>(pages_[j]), kPage, vec_.data()) == 0;
      // An error here only costs advice that was not needed.
      known_[j] = ok && (vec_[0] & 1) ? kYes : kNo;
    }
  }

  const std::vector<uintptr_t>& pages_;
  std::vector<uint8_t>& known_;
  std::vector<unsigned char>& vec_;
};

// A chunk of the sorted path copies without asking mincore while it is warm:
// when the first kWarmSamplePages pages of the chunk are all resident, its
// rows are copied kWarmBatchRows at a time for as long as the thread takes
// no major fault (one getrusage per batch, not one mincore per page).
constexpr size_t kWarmSamplePages = 32;

// Collects address-adjacent pages so that a run of them costs one madvise.
class AdviceRun {
 public:
  void add(uintptr_t page) {
    if (length_ != 0 && page != start_ + length_) flush();
    if (length_ == 0) start_ = page;
    length_ += kPage;
  }
  void flush() {
    // A failed advice changes speed, never bytes.
    if (length_ != 0) ::madvise(reinterpret_cast<void*>(start_), length_, MADV_WILLNEED);
    length_ = 0;
  }

 private:
  uintptr_t start_ = 0;
  uintptr_t length_ = 0;
};

// Whether `config` advises pages ahead of the copy at all.
bool advises(const GatherConfig& config) {
  return config.policy != Policy::kNone && config.window_bytes > 0;
}

// Gathers rows[0, n), which are sorted by address and share no page with rows
// outside the chunk, on the calling thread.  Pages that `marks` shows were
// copied earlier in the gather are neither counted nor advised.
class ChunkGather {
 public:
  ChunkGather(const RowRef* rows, int64_t n, int64_t row_bytes, uint8_t* out,
              const GatherConfig& config, PageMarks& marks, ChunkScratch& scratch,
              Interruption& stop)
      : rows_(rows), n_(n), row_bytes_(row_bytes), out_(out), config_(config),
        checkpoints_(stop), pages_(scratch.pages), first_page_(scratch.first_page.reserve(n)),
        state_(scratch.state), residency_(pages_, scratch.known, scratch.mincore_vector) {
    list_pages(marks);
    residency_.start();
  }

  CopyCounters run() {
    const ThreadFaults before = ThreadFaults::now();
    if (!advises(config_)) {
      for (int64_t k = 0; k < n_; ++k) copy_row(k);
    } else if (config_.policy == Policy::kAll) {
      advise_all();
    } else {
      advise_ahead(copy_while_warm());
    }
    const ThreadFaults after = ThreadFaults::now();
    counters_.major_faults = after.major - before.major;
    counters_.minor_faults = after.minor - before.minor;
    return counters_;
  }

 private:
  // The distinct pages under the rows, ascending, and each row's first one;
  // counts those not copied before.
  void list_pages(PageMarks& marks) {
    pages_.clear();
    state_.clear();
    for (int64_t k = 0; k < n_; ++k) {
      const uintptr_t first = page_of(rows_[k].address);
      const uintptr_t last = page_of(rows_[k].address + row_bytes_ - 1);
      const uintptr_t from = pages_.empty() ? first : std::max(first, pages_.back() + kPage);
      for (uintptr_t page = from; page <= last; page += kPage) {
        pages_.push_back(page);
        const bool fresh = marks.mark(page);
        state_.push_back(fresh ? kUnseen : kCopied);
        counters_.unique_pages += fresh;
      }
      // All pages first..last are now the last entries of pages_.
      first_page_[k] = pages_.size() - 1 - (last - first) / kPage;
    }
  }

  // Looks at page i; advises it unless mincore says it is resident.
  void consider(size_t i, AdviceRun& run) {
    if (state_[i] == kCopied) return;
    if (residency_.resident(i)) {
      state_[i] = kResident;
      ++counters_.resident_pages;
      return;
    }
    state_[i] = kAdvised;
    ++counters_.advised_pages;
    advised_ahead_ += kPage;
    run.add(pages_[i]);
  }

  // "all": advise every cold page of the request, then copy (the plain way,
  // kept to compare the others with).
  void advise_all() {
    AdviceRun run;
    for (size_t i = 0; i < pages_.size(); ++i) consider(i, run);
    run.flush();
    counters_.max_advised_ahead_bytes = advised_ahead_;
    for (int64_t k = 0; k < n_; ++k) copy_row(k);
  }

  // Copies rows from the first while the chunk looks warm (see
  // kWarmSamplePages); returns the first row not copied.  Pages of batches
  // that took no major fault count as resident.
  int64_t copy_while_warm() {
    for (size_t i = 0; i < std::min(pages_.size(), kWarmSamplePages); ++i) {
      if (state_[i] != kCopied && !residency_.resident(i)) return 0;
    }
    int64_t k = 0;
    while (k < n_) {
      const int64_t end = std::min(n_, k + kWarmBatchRows);
      const uint64_t before = ThreadFaults::now().major;
      for (; k < end; ++k) copy_row(k);
      const size_t past = last_page(end - 1) + 1;
      if (ThreadFaults::now().major != before) break;
      for (size_t i = copied_pages_; i < past; ++i) counters_.resident_pages += state_[i] != kCopied;
      copied_pages_ = past;
    }
    copied_pages_ = k > 0 ? last_page(k - 1) + 1 : 0;
    return k;
  }

  // "window": advice while the advised-not-yet-copied bytes stay within the
  // budget.  "distance": advice for pages less than the window ahead of the
  // copy address, however many that is.  From row `first` on; the pages
  // before copied_pages_ are done.
  void advise_ahead(int64_t first) {
    const bool by_budget = config_.policy == Policy::kWindow;
    const uint64_t window = config_.window_bytes;
    size_t next = copied_pages_;     // first page not yet considered
    size_t retired = copied_pages_;  // pages before this one have been copied
    for (int64_t k = first; k < n_; ++k) {
      for (; retired < first_page_[k]; ++retired) {
        if (advised(state_[retired])) advised_ahead_ -= kPage;
      }
      AdviceRun run;
      if (by_budget) {
        while (next < pages_.size() && advised_ahead_ + kPage <= window) consider(next++, run);
      } else {
        const uintptr_t limit = rows_[k].address + window;
        while (next < pages_.size() && pages_[next] < limit) consider(next++, run);
      }
      run.flush();
      counters_.max_advised_ahead_bytes =
          std::max<uint64_t>(counters_.max_advised_ahead_bytes, advised_ahead_);
      copy_row(k);
      // Pages the copy reached before their advice were faulted in by it.
      next = std::max(next, last_page(k) + 1);
    }
  }

  size_t last_page(int64_t k) const {
    return first_page_[k] + ((rows_[k].address & (kPage - 1)) + row_bytes_ - 1) / kPage;
  }

  // Copies row k.  When the row's cold pages were all advised, a major fault
  // during the copy means an advised page was reclaimed before the copy got
  // there and had to be read again (pages still being read count as minor
  // faults, and mincore cannot tell them from reclaimed ones).
  void copy_row(int64_t k) {
    if (k % kCheckRows == 0 && k > 0) checkpoints_.at(k, std::chrono::steady_clock::now());
    const size_t last = last_page(k);
    bool watch = false, all_considered = true;
    for (size_t i = first_page_[k]; i <= last; ++i) {
      watch |= state_[i] == kAdvised;
      all_considered &= state_[i] != kUnseen;
      if (state_[i] == kAdvised) state_[i] = kAdvisedCopied;
    }
    if (k + kPrefetchRowsAhead < n_) prefetch_row(rows_[k + kPrefetchRowsAhead], out_, row_bytes_);
    uint8_t* dst = out_ + rows_[k].position * row_bytes_;
    const void* src = reinterpret_cast<const void*>(rows_[k].address);
    if (!(watch && all_considered)) {
      if (!guarded_copy(dst, src, row_bytes_)) throw RowFault(rows_[k]);
      faults_known_ = false;  // this copy may have faulted
      return;
    }
    // Between two counted copies the thread only asks mincore and advises,
    // which take no major fault: the reading after one is the one before the next.
    const uint64_t before = faults_known_ ? faults_seen_ : ThreadFaults::now().major;
    if (!guarded_copy(dst, src, row_bytes_)) throw RowFault(rows_[k]);
    faults_seen_ = ThreadFaults::now().major;
    faults_known_ = true;
    counters_.evicted_before_copy += faults_seen_ - before;
  }

  const RowRef* rows_;
  int64_t n_;
  int64_t row_bytes_;
  uint8_t* out_;
  GatherConfig config_;
  Checkpoints checkpoints_;
  std::vector<uintptr_t>& pages_;
  size_t* first_page_;
  std::vector<uint8_t>& state_;
  PageResidency residency_;
  uint64_t advised_ahead_ = 0;
  size_t copied_pages_ = 0;  // the pages before this one were copied while warm
  uint64_t faults_seen_ = 0;  // this thread's major faults after the last counted copy
  bool faults_known_ = false;
  CopyCounters counters_;
};

// Slice p of `parts` near-equal slices of [0, n).
int64_t slice_begin(int64_t n, int parts, int p) { return n * p / parts; }

template <typename Id>
int64_t id_at(const void* ids, int64_t i) {
  return static_cast<int64_t>(static_cast<const Id*>(ids)[i]);
}

int64_t id_at(const void* ids, bool ids_are_int64, int64_t i) {
  return ids_are_int64 ? id_at<int64_t>(ids, i) : id_at<int32_t>(ids, i);
}

// How many threads share `rows` rows: at most `threads`, each with at least
// kMinRowsPerThread.
int parts_for(int64_t threads, int64_t rows) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, rows / kMinRowsPerThread)));
}

// Checks every id, then lists the rows the disk tier serves (ids outside
// `resident`) with their addresses, in request order: part p of
// scratch.parts lists those of slice p of the request, from the slice's
// first position on (the positions that resident ids leave free stay at the
// slice's end).
template <typename Id>
void validate_and_address(const MappedTable& table, const void* ids, int64_t n,
                          ResidentRange resident, GatherScratch& scratch) {
  const int64_t num_rows = table.num_rows();
  const int parts = static_cast<int>(scratch.parts.size());
  RowRef* rows = scratch.rows.reserve(n);
  run_parallel(parts, [&](int p) {
    Part& part = scratch.parts[p];
    part.begin = part.end = slice_begin(n, parts, p);
    for (int64_t i = part.begin; i < slice_begin(n, parts, p + 1); ++i) {
      const int64_t id = id_at<Id>(ids, i);
      if (id < 0 || id >= num_rows) {
        part.first_bad = i;
        return;
      }
      if (resident.contains(id)) continue;
      const auto address = reinterpret_cast<uintptr_t>(table.row_address(id));
      rows[part.end++] = {address, i};
      part.lowest = std::min(part.lowest, address);
      part.highest = std::max(part.highest, address);
    }
  });
  for (const Part& part : scratch.parts) {
    if (part.first_bad < 0) continue;
    const int64_t i = part.first_bad;
    throw std::out_of_range("row id " + std::to_string(id_at<Id>(ids, i)) + " at position " +
                            std::to_string(i) + " is out of range [0, " +
                            std::to_string(num_rows) + ")");
  }
}

int64_t disk_rows(const GatherScratch& scratch) {
  int64_t rows = 0;
  for (const Part& part : scratch.parts) rows += part.end - part.begin;
  return rows;
}

// Serves the rows the row cache holds and drops them from the parts; one
// lock for all of them.  With `pins` (a prefetch's), a row the cache holds
// is pinned there rather than copied, where the pins' bound allows.
void take_cached(RowCache& cache, const void* ids, bool ids_are_int64, int64_t row_bytes,
                 uint8_t* out, GatherScratch& scratch, PinnedRows* pins) {
  std::lock_guard<std::mutex> lock(cache.mutex());
  RowRef* rows = scratch.rows.data();
  for (Part& part : scratch.parts) {
    int64_t kept = part.begin;
    for (int64_t k = part.begin; k < part.end; ++k) {
      const RowRef row = rows[k];
      const int64_t id = id_at(ids, ids_are_int64, row.position);
      const int64_t slot = pins != nullptr ? cache.pin(id, pins->generation()) : -1;
      if (slot >= 0) {
        pins->hold(row.position, slot);
      } else if (!cache.lookup(id, out + row.position * row_bytes)) {
        rows[kept++] = row;
      }
    }
    part.end = kept;
  }
}

// Keeps the rows read in the row cache; with `pins`, pinned there.
void keep_in_cache(RowCache& cache, const void* ids, bool ids_are_int64, int64_t row_bytes,
                   const uint8_t* out, const GatherScratch& scratch, PinnedRows* pins) {
  std::lock_guard<std::mutex> lock(cache.mutex());
  const RowRef* rows = scratch.rows.data();
  for (const Part& part : scratch.parts) {
    for (int64_t k = part.begin; k < part.end; ++k) {
      const int64_t id = id_at(ids, ids_are_int64, rows[k].position);
      const uint8_t* row = out + rows[k].position * row_bytes;
      if (pins == nullptr) {
        cache.insert(id, row);
        continue;
      }
      const int64_t slot = cache.insert_pinned(id, row, pins->generation());
      if (slot >= 0) pins->hold(rows[k].position, slot);
    }
  }
}

bool address_order(const RowRef& a, const RowRef& b) {
  return a.address != b.address ? a.address < b.address : a.position < b.position;
}

// Sorts the rows that the copy in request order left (each part's rest)
// into scratch.sorted by address and returns their count.  One thread per
// part: each part deals its rows into address buckets (a shift of the
// address, no division); consecutive buckets form at most one range per
// part, and each thread sorts the buckets of one range.  With about
// kRowsPerBucket rows in a bucket the sorts are short.
constexpr int64_t kRowsPerBucket = 32;

int64_t sort_by_address(GatherScratch& scratch) {
  const std::vector<Part>& parts = scratch.parts;
  const int count = static_cast<int>(parts.size());
  int64_t total = 0;
  for (const Part& part : parts) total += part.rest();
  const RowRef* rows = scratch.rows.data();
  RowRef* sorted = scratch.sorted.reserve(total);
  if (total < 4 * kRowsPerBucket) {
    RowRef* next = sorted;
    for (const Part& part : parts) next = std::copy(rows + part.rest_begin(), rows + part.end, next);
    std::sort(sorted, sorted + total, address_order);
    return total;
  }
  uintptr_t lo = UINTPTR_MAX, hi = 0;  // bounds of every disk-tier row: of the rest too
  for (const Part& part : parts) {
    lo = std::min(lo, part.lowest);
    hi = std::max(hi, part.highest);
  }
  // The smallest shift that leaves at most about total / kRowsPerBucket buckets.
  const int wanted_bits = 64 - __builtin_clzll(static_cast<uint64_t>(total / kRowsPerBucket));
  const int span_bits = hi == lo ? 0 : 64 - __builtin_clzll(static_cast<uint64_t>(hi - lo));
  const int shift = std::max(0, span_bits - wanted_bits);
  const int64_t buckets = static_cast<int64_t>((hi - lo) >> shift) + 1;
  auto bucket_of = [&](uintptr_t address) { return static_cast<int64_t>((address - lo) >> shift); };
  // Ranges of 2**range_bits buckets, at most one per part.
  int range_bits = 0;
  while (((buckets - 1) >> range_bits) >= count) ++range_bits;
  const int ranges = static_cast<int>(((buckets - 1) >> range_bits) + 1);
  auto range_end = [&](int r) { return std::min<int64_t>(buckets, int64_t{r + 1} << range_bits); };

  // [part][bucket]: the part's rows in the bucket, then where its next one goes in its range.
  int64_t* slots = scratch.bucket_slots.reserve(static_cast<size_t>(count) * buckets);
  int64_t* bucket_start = scratch.bucket_start.reserve(buckets);  // in its range
  std::vector<int64_t>& range_first = scratch.range_first;        // in `sorted`
  range_first.assign(ranges + 1, 0);
  run_parallel(count, [&](int p) {
    int64_t* own = slots + p * buckets;
    std::fill(own, own + buckets, 0);
    for (int64_t k = parts[p].rest_begin(); k < parts[p].end; ++k) ++own[bucket_of(rows[k].address)];
  });
  run_parallel(ranges, [&](int r) {
    int64_t in_range = 0;
    for (int64_t b = int64_t{r} << range_bits; b < range_end(r); ++b) {
      bucket_start[b] = in_range;
      for (int p = 0; p < count; ++p) {
        const int64_t rows_here = slots[p * buckets + b];
        slots[p * buckets + b] = in_range;
        in_range += rows_here;
      }
    }
    range_first[r + 1] = in_range;
  });
  for (int r = 0; r < ranges; ++r) range_first[r + 1] += range_first[r];
  run_parallel(count, [&](int p) {
    int64_t* next = slots + p * buckets;
    for (int64_t k = parts[p].rest_begin(); k < parts[p].end; ++k) {
      const int64_t b = bucket_of(rows[k].address);
      sorted[range_first[b >> range_bits] + next[b]++] = rows[k];
    }
  });
  run_parallel(ranges, [&](int r) {
    RowRef* range = sorted + range_first[r];
    for (int64_t b = int64_t{r} << range_bits; b < range_end(r); ++b) {
      RowRef* end = b + 1 < range_end(r) ? range + bucket_start[b + 1] : sorted + range_first[r + 1];
      std::sort(range + bucket_start[b], end, address_order);
    }
  });
  return total;
}

// Splits sorted rows into at most `chunks` chunks of similar size whose
// pages do not overlap, so that no page is advised or counted twice; their
// first rows, and n last.
void chunk_starts(const RowRef* rows, int64_t n, int64_t row_bytes, int chunks,
                  std::vector<int64_t>& starts) {
  starts.assign(1, 0);
  for (int64_t c = 1; c < chunks; ++c) {
    int64_t start = std::max(n * c / chunks, starts.back() + 1);
    while (start < n && page_of(rows[start].address) <= page_of(rows[start - 1].address + row_bytes - 1)) {
      ++start;
    }
    if (start >= n) break;
    starts.push_back(start);
  }
  starts.push_back(n);
}

// Copies each part's rows in request order while they look warm (not with
// "all", which advises every cold page before copying).  `was_warm`: the
// gather before was (GatherScratch::last_gather_warm).
void copy_in_request_order(MappedTable& table, const GatherConfig& config, GatherScratch& scratch,
                           bool was_warm, uint8_t* out, Interruption& stop) {
  const bool advising = advises(config);
  run_parallel(
      static_cast<int>(scratch.parts.size()),
      [&](int p) {
        Part& part = scratch.parts[p];
        if (part.end == part.begin) return;
        const bool sample = !(was_warm && part.end - part.begin <= kUnsampledRows);
        RequestOrderCopy copy(scratch.rows.data() + part.begin, part.end - part.begin,
                              table.row_bytes(), out, scratch.marks, sample, advising, stop);
        part.copied = copy.run();
        part.counters = copy.counters();
      },
      [&] { stop.poll_if_due(); });
  scratch.last_gather_warm = std::all_of(scratch.parts.begin(), scratch.parts.end(), [](const Part& part) {
    return part.rest() == 0 && part.counters.major_faults == 0;
  });
}

// Copies the rows that the copy in request order left, sorted by address and
// split among up to `threads` threads, with the policy's advice.
void copy_sorted(MappedTable& table, const GatherConfig& config, int64_t threads,
                 GatherScratch& scratch, uint8_t* out, Interruption& stop) {
  const int64_t total = sort_by_address(scratch);
  if (total == 0) return;
  stop.check();
  const int64_t row_bytes = table.row_bytes();
  const RowRef* sorted = scratch.sorted.data();
  std::vector<int64_t>& starts = scratch.chunk_starts;
  chunk_starts(sorted, total, row_bytes, parts_for(threads, total), starts);
  const int chunks = static_cast<int>(starts.size()) - 1;
  // The window bounds the bytes at risk of reclaim for the whole gather: its
  // pages are shared out among the threads.
  auto chunk_config = [&](int c) {
    GatherConfig share = config;
    if (config.policy == Policy::kWindow) {
      const uint64_t pages = config.window_bytes / kPage;
      share.window_bytes = (pages / chunks + (static_cast<uint64_t>(c) < pages % chunks)) * kPage;
    }
    return share;
  };
  if (scratch.chunks.size() < static_cast<size_t>(chunks)) scratch.chunks.resize(chunks);
  scratch.chunk_counters.resize(chunks);
  run_parallel(
      chunks,
      [&](int c) {
        ChunkGather gather(sorted + starts[c], starts[c + 1] - starts[c], row_bytes, out,
                           chunk_config(c), scratch.marks, scratch.chunks[c], stop);
        scratch.chunk_counters[c] = gather.run();
      },
      [&] { stop.poll_if_due(); });
}

// Copies the parts' rows out of the files: in request order while they are
// warm, the rest sorted by address.
void copy_from_disk(MappedTable& table, const GatherConfig& config, int64_t threads,
                    GatherScratch& scratch, const void* ids, bool ids_are_int64, uint8_t* out,
                    Interruption& stop) {
  ensure_fault_handler();
  // False until this gather shows otherwise (and so after one that throws).
  const bool was_warm = std::exchange(scratch.last_gather_warm, false);
  try {
    if (config.policy != Policy::kAll) {
      copy_in_request_order(table, config, scratch, was_warm, out, stop);
    }
    copy_sorted(table, config, threads, scratch, out, stop);
  } catch (const RowFault& fault) {
    throw OsError(table.locate(fault.row.address) + ": row " +
                  std::to_string(id_at(ids, ids_are_int64, fault.row.position)) +
                  " could not be read (the file is shorter than when the table was opened, "
                  "or the disk failed to read the page)");
  }
}

void add_counters(GatherCounters& counters, const CopyCounters& r) {
  counters.unique_pages += r.unique_pages;
  counters.advised_pages += r.advised_pages;
  counters.resident_pages += r.resident_pages;
  counters.evicted_before_copy += r.evicted_before_copy;
  counters.major_faults += r.major_faults;
  counters.minor_faults += r.minor_faults;
}

// Reads the rows left in `scratch` from the files with O_DIRECT instead
// (GatherConfig.io "direct").
DirectCounters read_from_files(MappedTable& table, const GatherConfig& config,
                               GatherScratch& scratch, const void* ids, bool ids_are_int64,
                               uint8_t* out, Interruption& stop) {
  const int64_t total = sort_by_address(scratch);
  const DirectFiles& files = table.direct_files();
  return read_direct(files, files.block(config.io_block_bytes), table.io_backend(),
                     config.io_queue_depth, config.threads, table.row_bytes(),
                     scratch.sorted.data(), static_cast<size_t>(total), scratch.direct, out,
                     [&](int64_t position) { return id_at(ids, ids_are_int64, position); }, stop);
}

// gather_rows, and prefetch_rows with the prefetch's `pins`.
void gather_into(MappedTable& table, const void* ids, bool ids_are_int64, int64_t n,
                 uint8_t* out, ResidentRange resident, bool use_row_cache, Interruption& stop,
                 int64_t max_threads, PinnedRows* pins) {
  const auto t0 = std::chrono::steady_clock::now();
  GatherConfig config = table.config();
  if (max_threads > 0) config.threads = static_cast<int>(std::min<int64_t>(config.threads, max_threads));
  int64_t threads = config.threads;
  if (config.policy == Policy::kWindow && config.window_bytes >= kPage) {
    // Every thread keeps its share of the window's pages ahead: at least one.
    threads = std::min<int64_t>(threads, config.window_bytes / kPage);
  }
  ScratchLease lease(table);
  GatherScratch& scratch = *lease;
  scratch.parts.assign(parts_for(threads, n), Part{});
  scratch.chunk_counters.clear();
  if (ids_are_int64) {
    validate_and_address<int64_t>(table, ids, n, resident, scratch);
  } else {
    validate_and_address<int32_t>(table, ids, n, resident, scratch);
  }
  const int64_t row_bytes = table.row_bytes();
  const uint64_t rows = disk_rows(scratch);
  RowCache& cache = table.row_cache();
  const bool cached = use_row_cache && cache.enabled();  // once: the config may change meanwhile
  if (pins != nullptr && pins->cache() != &cache) pins = nullptr;  // every row in its buffer
  if (cached) take_cached(cache, ids, ids_are_int64, row_bytes, out, scratch, pins);
  const uint64_t misses = disk_rows(scratch);
  DirectCounters direct;
  if (misses > 0 && config.io == Io::kDirect) {
    direct = read_from_files(table, config, scratch, ids, ids_are_int64, out, stop);
  } else if (misses > 0) {
    copy_from_disk(table, config, threads, scratch, ids, ids_are_int64, out, stop);
  }
  // A poll that asked to stop while the last rows were copied still stops
  // the gather: its caller raises what the poll found.
  stop.throw_if_stopped();
  if (cached) keep_in_cache(cache, ids, ids_are_int64, row_bytes, out, scratch, pins);

  GatherCounters& counters = table.counters();
  uint64_t max_ahead = 0;
  for (const Part& part : scratch.parts) add_counters(counters, part.counters);
  for (const CopyCounters& r : scratch.chunk_counters) {
    add_counters(counters, r);
    max_ahead += r.max_advised_ahead_bytes;  // threads together: at most their sum
  }
  uint64_t seen = counters.max_advised_ahead_bytes.load();
  while (max_ahead > seen && !counters.max_advised_ahead_bytes.compare_exchange_weak(seen, max_ahead)) {
  }
  counters.unique_pages += direct.unique_pages;
  counters.direct_reads += direct.reads;
  counters.direct_read_bytes += direct.read_bytes;
  if (cached) {
    counters.row_cache_hits += rows - misses;
    counters.row_cache_misses += misses;
  }
  counters.calls += 1;
  counters.rows += rows;
  counters.gather_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now() - t0)
                            .count();
}

}  // namespace

void gather_rows(MappedTable& table, const void* ids, bool ids_are_int64, int64_t n,
                 uint8_t* out, ResidentRange resident, bool use_row_cache, Interruption& stop,
                 int64_t max_threads) {
  gather_into(table, ids, ids_are_int64, n, out, resident, use_row_cache, stop, max_threads,
              nullptr);
}

void prefetch_rows(MappedTable& table, const std::vector<int64_t>& ids, ResidentRange resident,
                   PinnedRows& into, Interruption& stop) {
  RowCache& cache = table.row_cache();
  const auto n = static_cast<int64_t>(ids.size());
  uint8_t* staged = into.start(cache.enabled() ? &cache : nullptr, n, table.row_bytes());
  gather_into(table, ids.data(), /*ids_are_int64=*/true, n, staged, resident,
              /*use_row_cache=*/true, stop, 0, &into);
  into.keep(ids.data(), resident.begin, resident.end);
  table.counters().prefetch_pinned_rows += into.pinned();
}

}  // namespace ple
