// The windowed row gather: copies requested rows out of a MappedTable in
// ascending address order while keeping a bounded amount of MADV_WILLNEED
// advice ahead of the copy.  See README "Prefetch policies" for why.
#include "row_gather.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "direct_reader.h"
#include "fault_guard.h"
#include "interrupt.h"
#include "mapped_table.h"
#include "worker_pool.h"

namespace ple {

namespace {

// Below this many rows per thread, handing rows to another thread costs more than it saves.
constexpr int64_t kMinRowsPerThread = 256;

const uintptr_t kPage = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));

struct RowRef {
  uintptr_t address;
  int64_t position;  // index in the request
};

// A row whose bytes could not be read: its copy raised SIGBUS.
struct RowFault : std::exception {
  explicit RowFault(RowRef row) : row(row) {}
  const char* what() const noexcept override { return "a row could not be read"; }
  RowRef row;
};

struct ChunkCounters {
  uint64_t unique_pages = 0, advised_pages = 0, resident_pages = 0,
           evicted_before_copy = 0, max_advised_ahead_bytes = 0,
           major_faults = 0, minor_faults = 0;
};

enum PageState : uint8_t { kUnseen, kResident, kAdvised, kAdvisedCopied };

// One mincore call answers for a run of requested pages that lie at most
// kMincoreGapPages apart, up to kMincoreSpanPages in all: in the kernel a page
// costs far less than a call, and with one call per page the mincore calls of
// a warm request cost more than its copy.
constexpr uintptr_t kMincoreGapPages = 64;
constexpr uintptr_t kMincoreSpanPages = 4096;

// Residency of a sorted list of pages, asked of mincore a run at a time.
class PageResidency {
 public:
  explicit PageResidency(const std::vector<uintptr_t>& pages)
      : pages_(pages), known_(pages.size(), kUnknown) {}

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
    vec_.resize(kMincoreSpanPages);
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
  std::vector<uint8_t> known_;
  std::vector<unsigned char> vec_;
};

// A warm request is copied without asking mincore: when the first
// kWarmSamplePages pages of a chunk are all resident, its rows are copied
// kWarmBatchRows at a time for as long as the thread takes no major fault
// (one getrusage per batch, not one mincore per page).
constexpr size_t kWarmSamplePages = 32;
constexpr int64_t kWarmBatchRows = 256;

// Rows are far apart, so each copy waits on a page-table walk and a cache
// miss; prefetching the rows this far ahead overlaps those waits.
constexpr int64_t kPrefetchRowsAhead = 12;

// Every kCheckRows rows a thread copies, it looks whether the gather should
// stop (and the thread that started it polls, see interrupt.h); at every
// kHandlerCheckRows rows, or kHandlerCheckInterval, whichever comes first, it
// makes sure that the SIGBUS handler is still the guard's (a sigaction call,
// about 0.3 us here): a handler installed in the middle of a gather is
// replaced by the guard's, chained to it, before the thread copies more.
constexpr int64_t kCheckRows = 32;
constexpr int64_t kHandlerCheckRows = 256;
constexpr auto kHandlerCheckInterval = std::chrono::milliseconds(1);

uint64_t thread_major_faults() {
  struct rusage usage;
  ::getrusage(RUSAGE_THREAD, &usage);
  return usage.ru_majflt;
}

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

// Gathers rows[0, n), which are sorted by address and share no page with rows
// outside the chunk, on the calling thread.
class ChunkGather {
 public:
  ChunkGather(const RowRef* rows, int64_t n, int64_t row_bytes, uint8_t* out,
              const GatherConfig& config, Interruption& stop)
      : rows_(rows), n_(n), row_bytes_(row_bytes), out_(out), config_(config), stop_(stop),
        next_handler_check_(std::chrono::steady_clock::now() + kHandlerCheckInterval) {
    list_pages();
  }

  ChunkCounters run() {
    struct rusage before, after;
    ::getrusage(RUSAGE_THREAD, &before);
    const bool advise = config_.policy != Policy::kNone && config_.window_bytes > 0;
    if (!advise) {
      for (int64_t k = 0; k < n_; ++k) copy_row(k);
    } else if (config_.policy == Policy::kAll) {
      advise_all();
    } else {
      advise_ahead(copy_while_warm());
    }
    ::getrusage(RUSAGE_THREAD, &after);
    counters_.unique_pages = pages_.size();
    counters_.major_faults = after.ru_majflt - before.ru_majflt;
    counters_.minor_faults = after.ru_minflt - before.ru_minflt;
    return counters_;
  }

 private:
  // The distinct pages under the rows, ascending, and each row's first one.
  void list_pages() {
    pages_.reserve(n_);
    first_page_.resize(n_);
    for (int64_t k = 0; k < n_; ++k) {
      const uintptr_t first = rows_[k].address & ~(kPage - 1);
      const uintptr_t last = (rows_[k].address + row_bytes_ - 1) & ~(kPage - 1);
      const uintptr_t from = pages_.empty() ? first : std::max(first, pages_.back() + kPage);
      for (uintptr_t page = from; page <= last; page += kPage) pages_.push_back(page);
      // All pages first..last are now the last entries of pages_.
      first_page_[k] = pages_.size() - 1 - (last - first) / kPage;
    }
    state_.assign(pages_.size(), kUnseen);
    residency_ = std::make_unique<PageResidency>(pages_);
  }

  // Looks at page i; advises it unless mincore says it is resident.
  void consider(size_t i, AdviceRun& run) {
    if (residency_->resident(i)) {
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
      if (!residency_->resident(i)) return 0;
    }
    int64_t k = 0;
    while (k < n_) {
      const int64_t end = std::min(n_, k + kWarmBatchRows);
      const uint64_t before = thread_major_faults();
      for (; k < end; ++k) copy_row(k);
      const size_t past = last_page(end - 1) + 1;
      if (thread_major_faults() != before) break;
      counters_.resident_pages += past - copied_pages_;
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
        if (state_[retired] >= kAdvised) advised_ahead_ -= kPage;
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

  // A prefetch of an address whose page is not mapped is dropped: it never faults.
  void prefetch_row(const RowRef& row) const {
    const auto* src = reinterpret_cast<const char*>(row.address);
    const uint8_t* dst = out_ + row.position * row_bytes_;
    __builtin_prefetch(src);
    __builtin_prefetch(src + row_bytes_ - 1);
    __builtin_prefetch(dst, 1);
    __builtin_prefetch(dst + row_bytes_ - 1, 1);
  }

  size_t last_page(int64_t k) const {
    return first_page_[k] + ((rows_[k].address & (kPage - 1)) + row_bytes_ - 1) / kPage;
  }

  // Copies row k.  When the row's cold pages were all advised, a major fault
  // during the copy means an advised page was reclaimed before the copy got
  // there and had to be read again (pages still being read count as minor
  // faults, and mincore cannot tell them from reclaimed ones).
  void copy_row(int64_t k) {
    if (k % kCheckRows == 0 && k > 0) checkpoint(k);
    const size_t last = last_page(k);
    bool watch = false, all_considered = true;
    for (size_t i = first_page_[k]; i <= last; ++i) {
      watch |= state_[i] == kAdvised;
      all_considered &= state_[i] != kUnseen;
      if (state_[i] == kAdvised) state_[i] = kAdvisedCopied;
    }
    if (k + kPrefetchRowsAhead < n_) prefetch_row(rows_[k + kPrefetchRowsAhead]);
    uint8_t* dst = out_ + rows_[k].position * row_bytes_;
    const void* src = reinterpret_cast<const void*>(rows_[k].address);
    if (!(watch && all_considered)) {
      if (!guarded_copy(dst, src, row_bytes_)) throw RowFault(rows_[k]);
      faults_known_ = false;  // this copy may have faulted
      return;
    }
    // Between two counted copies the thread only asks mincore and advises,
    // which take no major fault: the reading after one is the one before the next.
    const uint64_t before = faults_known_ ? faults_seen_ : thread_major_faults();
    if (!guarded_copy(dst, src, row_bytes_)) throw RowFault(rows_[k]);
    faults_seen_ = thread_major_faults();
    faults_known_ = true;
    counters_.evicted_before_copy += faults_seen_ - before;
  }

  // See kCheckRows.
  void checkpoint(int64_t k) {
    stop_.check();
    const auto now = std::chrono::steady_clock::now();
    if (k % kHandlerCheckRows == 0 || now >= next_handler_check_) {
      ensure_fault_handler();
      next_handler_check_ = now + kHandlerCheckInterval;
    }
  }

  const RowRef* rows_;
  int64_t n_;
  int64_t row_bytes_;
  uint8_t* out_;
  GatherConfig config_;
  Interruption& stop_;
  std::chrono::steady_clock::time_point next_handler_check_;
  std::vector<uintptr_t> pages_;
  std::vector<size_t> first_page_;
  std::vector<uint8_t> state_;
  std::unique_ptr<PageResidency> residency_;
  uint64_t advised_ahead_ = 0;
  size_t copied_pages_ = 0;  // the pages before this one were copied while warm
  uint64_t faults_seen_ = 0;  // this thread's major faults after the last counted copy
  bool faults_known_ = false;
  ChunkCounters counters_;
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
// `resident`) with their addresses, in request order.  Each thread writes its
// slice's rows in place; the gaps that resident ids leave are closed after.
template <typename Id>
void validate_and_address(const MappedTable& table, const void* ids, int64_t n,
                          ResidentRange resident, int parts, std::vector<RowRef>& rows) {
  const int64_t num_rows = table.num_rows();
  std::vector<int64_t> first_bad(parts, -1);
  std::vector<int64_t> kept(parts, 0);
  rows.resize(n);
  run_parallel(parts, [&](int p) {
    int64_t next = slice_begin(n, parts, p);
    for (int64_t i = slice_begin(n, parts, p); i < slice_begin(n, parts, p + 1); ++i) {
      const int64_t id = id_at<Id>(ids, i);
      if (id < 0 || id >= num_rows) {
        first_bad[p] = i;
        return;
      }
      if (!resident.contains(id)) rows[next++] = {reinterpret_cast<uintptr_t>(table.row_address(id)), i};
    }
    kept[p] = next - slice_begin(n, parts, p);
  });
  for (const int64_t i : first_bad) {
    if (i < 0) continue;
    throw std::out_of_range("row id " + std::to_string(id_at<Id>(ids, i)) + " at position " +
                            std::to_string(i) + " is out of range [0, " +
                            std::to_string(num_rows) + ")");
  }
  int64_t end = kept[0];
  for (int p = 1; p < parts; ++p) {
    const int64_t begin = slice_begin(n, parts, p);
    if (end != begin) std::copy(rows.begin() + begin, rows.begin() + begin + kept[p], rows.begin() + end);
    end += kept[p];
  }
  rows.resize(end);
}

// Serves the rows the row cache holds and drops them from `rows`; one lock
// for all of them.
void take_cached(RowCache& cache, const void* ids, bool ids_are_int64, int64_t row_bytes,
                 uint8_t* out, std::vector<RowRef>& rows) {
  std::lock_guard<std::mutex> lock(cache.mutex());
  size_t kept = 0;
  for (const RowRef& row : rows) {
    if (!cache.lookup(id_at(ids, ids_are_int64, row.position), out + row.position * row_bytes)) {
      rows[kept++] = row;
    }
  }
  rows.resize(kept);
}

void keep_in_cache(RowCache& cache, const void* ids, bool ids_are_int64, int64_t row_bytes,
                   const uint8_t* out, const std::vector<RowRef>& rows) {
  std::lock_guard<std::mutex> lock(cache.mutex());
  for (const RowRef& row : rows) {
    cache.insert(id_at(ids, ids_are_int64, row.position), out + row.position * row_bytes);
  }
}

bool address_order(const RowRef& a, const RowRef& b) {
  return a.address != b.address ? a.address < b.address : a.position < b.position;
}

// Sorts rows by address with `parts` threads: each slice of the request is
// dealt into address buckets (a shift of the address, no division), then each
// thread sorts the buckets of its run one by one.  With about
// kRowsPerBucket rows in a bucket the sorts are short.
constexpr int64_t kRowsPerBucket = 32;

void sort_by_address(std::vector<RowRef>& rows, int parts) {
  const int64_t n = rows.size();
  if (n < 4 * kRowsPerBucket) {
    std::sort(rows.begin(), rows.end(), address_order);
    return;
  }
  uintptr_t lo = UINTPTR_MAX, hi = 0;
  for (const RowRef& row : rows) {
    lo = std::min(lo, row.address);
    hi = std::max(hi, row.address);
  }
  // The smallest shift that leaves at most about n / kRowsPerBucket buckets.
  const int wanted_bits = 64 - __builtin_clzll(static_cast<uint64_t>(n / kRowsPerBucket));
  const int span_bits = hi == lo ? 0 : 64 - __builtin_clzll(static_cast<uint64_t>(hi - lo));
  const int shift = std::max(0, span_bits - wanted_bits);
  const int64_t buckets = static_cast<int64_t>((hi - lo) >> shift) + 1;
  auto bucket_of = [&](uintptr_t address) { return static_cast<int64_t>((address - lo) >> shift); };

  std::vector<int64_t> slots(static_cast<size_t>(parts) * buckets, 0);  // [part][bucket]
  run_parallel(parts, [&](int p) {
    for (int64_t i = slice_begin(n, parts, p); i < slice_begin(n, parts, p + 1); ++i) {
      ++slots[p * buckets + bucket_of(rows[i].address)];
    }
  });
  std::vector<int64_t> bucket_begin(buckets + 1);
  int64_t total = 0;
  for (int64_t b = 0; b < buckets; ++b) {
    bucket_begin[b] = total;
    for (int p = 0; p < parts; ++p) {
      const int64_t count = slots[p * buckets + b];
      slots[p * buckets + b] = total;  // from count to where the part's rows go
      total += count;
    }
  }
  bucket_begin[buckets] = n;
  std::vector<RowRef> dealt(n);
  run_parallel(parts, [&](int p) {
    int64_t* next = &slots[p * buckets];
    for (int64_t i = slice_begin(n, parts, p); i < slice_begin(n, parts, p + 1); ++i) {
      dealt[next[bucket_of(rows[i].address)]++] = rows[i];
    }
  });
  run_parallel(parts, [&](int p) {
    for (int64_t b = buckets * p / parts; b < buckets * (p + 1) / parts; ++b) {
      std::sort(dealt.begin() + bucket_begin[b], dealt.begin() + bucket_begin[b + 1], address_order);
    }
  });
  rows.swap(dealt);
}

// Splits sorted rows into at most `chunks` chunks of similar size whose
// pages do not overlap, so that no page is advised or counted twice.
std::vector<int64_t> chunk_starts(const std::vector<RowRef>& rows, int64_t row_bytes,
                                  int chunks) {
  const int64_t n = rows.size();
  std::vector<int64_t> starts{0};
  for (int64_t c = 1; c < chunks; ++c) {
    int64_t start = std::max(n * c / chunks, starts.back() + 1);
    while (start < n && ((rows[start].address & ~(kPage - 1)) <=
                         ((rows[start - 1].address + row_bytes - 1) & ~(kPage - 1)))) {
      ++start;
    }
    if (start >= n) break;
    starts.push_back(start);
  }
  starts.push_back(n);
  return starts;
}

// Copies `rows` (the disk tier's, in request order) out of the files, sorted
// by address and split among up to `threads` threads; their counters.
std::vector<ChunkCounters> copy_from_disk(MappedTable& table, const GatherConfig& config,
                                          int64_t threads, std::vector<RowRef>& rows,
                                          const void* ids, bool ids_are_int64, uint8_t* out,
                                          Interruption& stop) {
  const int64_t row_bytes = table.row_bytes();
  const int parts = parts_for(threads, static_cast<int64_t>(rows.size()));
  sort_by_address(rows, parts);
  stop.check();
  const std::vector<int64_t> starts = chunk_starts(rows, row_bytes, parts);
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
  std::vector<ChunkCounters> results(chunks);
  ensure_fault_handler();
  try {
    run_parallel(
        chunks,
        [&](int c) {
          ChunkGather gather(rows.data() + starts[c], starts[c + 1] - starts[c], row_bytes, out,
                             chunk_config(c), stop);
          results[c] = gather.run();
        },
        [&] { stop.poll_if_due(); });
  } catch (const RowFault& fault) {
    throw OsError(table.locate(fault.row.address) + ": row " +
                  std::to_string(id_at(ids, ids_are_int64, fault.row.position)) +
                  " could not be read (the file is shorter than when the table was opened, "
                  "or the disk failed to read the page)");
  }
  return results;
}

// Reads `rows` from the files with O_DIRECT instead (GatherConfig.io "direct").
DirectCounters read_from_files(MappedTable& table, const GatherConfig& config,
                               const std::vector<RowRef>& rows, const void* ids,
                               bool ids_are_int64, uint8_t* out, Interruption& stop) {
  std::vector<DirectRow> direct(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) direct[i] = {rows[i].address, rows[i].position};
  return read_direct(table.direct_files(), table.io_backend(), config.io_queue_depth,
                     config.threads, table.row_bytes(), direct, out,
                     [&](int64_t position) { return id_at(ids, ids_are_int64, position); }, stop);
}

}  // namespace

void gather_rows(MappedTable& table, const void* ids, bool ids_are_int64, int64_t n,
                 uint8_t* out, ResidentRange resident, bool use_row_cache, Interruption& stop) {
  const auto t0 = std::chrono::steady_clock::now();
  const GatherConfig config = table.config();
  int64_t threads = config.threads;
  if (config.policy == Policy::kWindow && config.window_bytes >= kPage) {
    // Every thread keeps its share of the window's pages ahead: at least one.
    threads = std::min<int64_t>(threads, config.window_bytes / kPage);
  }
  std::vector<RowRef> rows;
  if (ids_are_int64) {
    validate_and_address<int64_t>(table, ids, n, resident, parts_for(threads, n), rows);
  } else {
    validate_and_address<int32_t>(table, ids, n, resident, parts_for(threads, n), rows);
  }
  const int64_t row_bytes = table.row_bytes();
  const uint64_t disk_rows = rows.size();
  RowCache& cache = table.row_cache();
  const bool cached = use_row_cache && cache.enabled();  // once: the config may change meanwhile
  if (cached) take_cached(cache, ids, ids_are_int64, row_bytes, out, rows);
  const uint64_t cache_hits = disk_rows - rows.size();
  std::vector<ChunkCounters> results;
  DirectCounters direct;
  if (!rows.empty() && config.io == Io::kDirect) {
    direct = read_from_files(table, config, rows, ids, ids_are_int64, out, stop);
  } else if (!rows.empty()) {
    results = copy_from_disk(table, config, threads, rows, ids, ids_are_int64, out, stop);
  }
  // A poll that asked to stop while the last rows were copied still stops
  // the gather: its caller raises what the poll found.
  stop.throw_if_stopped();
  if (cached) keep_in_cache(cache, ids, ids_are_int64, row_bytes, out, rows);

  GatherCounters& counters = table.counters();
  uint64_t max_ahead = 0;
  for (const ChunkCounters& r : results) {
    counters.unique_pages += r.unique_pages;
    counters.advised_pages += r.advised_pages;
    counters.resident_pages += r.resident_pages;
    counters.evicted_before_copy += r.evicted_before_copy;
    counters.major_faults += r.major_faults;
    counters.minor_faults += r.minor_faults;
    max_ahead += r.max_advised_ahead_bytes;  // threads together: at most their sum
  }
  uint64_t seen = counters.max_advised_ahead_bytes.load();
  while (max_ahead > seen && !counters.max_advised_ahead_bytes.compare_exchange_weak(seen, max_ahead)) {
  }
  counters.unique_pages += direct.unique_pages;
  counters.direct_reads += direct.reads;
  counters.direct_read_bytes += direct.read_bytes;
  if (cached) {
    counters.row_cache_hits += cache_hits;
    counters.row_cache_misses += rows.size();
  }
  counters.calls += 1;
  counters.rows += disk_rows;
  counters.gather_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now() - t0)
                            .count();
}

}  // namespace ple
