#include "mapped_table.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <unordered_map>

namespace ple {

namespace {

// The rows that prefetches not yet taken may hold: layers of a model that
// share a table each prefetch their own rows for the next step.
constexpr uint64_t kMaxPendingPrefetchBytes = 256ull << 20;

std::string errno_text(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

MappedFile map_file(const std::string& path) {
  MappedFile file;
  file.path = path;
  file.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (file.fd < 0) throw OsError(errno_text("cannot open", path));
  struct stat st;
  if (::fstat(file.fd, &st) != 0) {
    std::string msg = errno_text("cannot stat", path);
    ::close(file.fd);
    throw OsError(msg);
  }
  file.size = static_cast<uint64_t>(st.st_size);
  if (file.size == 0) {
    ::close(file.fd);
    throw std::invalid_argument(path + ": file is empty");
  }
  void* base = ::mmap(nullptr, file.size, PROT_READ, MAP_SHARED, file.fd, 0);
  if (base == MAP_FAILED) {
    std::string msg = errno_text("cannot mmap", path);
    ::close(file.fd);
    throw OsError(msg);
  }
  // A fault then reads one page, not the device's read-ahead window around it.
  ::madvise(base, file.size, MADV_RANDOM);
  file.base = static_cast<uint8_t*>(base);
  return file;
}

void unmap_file(MappedFile& file) {
  if (file.base != nullptr) ::munmap(file.base, file.size);
  if (file.fd >= 0) ::close(file.fd);
  file.base = nullptr;
  file.fd = -1;
}

std::mutex registry_mutex;
std::unordered_map<int64_t, std::shared_ptr<MappedTable>> registry;
int64_t next_handle = 1;

// fork() copies the locks of the other threads as they are, held or not, and
// none of those threads: before it, this thread takes the registry's lock
// and every registered table's (none of them is held for long, and none is
// held while its holder waits for another), so that the child gets them all
// free and the structures they guard whole.
void lock_tables_for_fork() {
  registry_mutex.lock();
  for (auto& entry : registry) entry.second->lock_for_fork();
}

void unlock_tables_in_parent() {
  for (auto& entry : registry) entry.second->unlock_after_fork(false);
  registry_mutex.unlock();
}

void unlock_tables_in_child() {
  for (auto& entry : registry) entry.second->unlock_after_fork(true);
  registry_mutex.unlock();
}

const int tables_survive_fork =
    ::pthread_atfork(lock_tables_for_fork, unlock_tables_in_parent, unlock_tables_in_child);

}  // namespace

Policy parse_policy(const std::string& name) {
  if (name == "window") return Policy::kWindow;
  if (name == "distance") return Policy::kDistance;
  if (name == "all") return Policy::kAll;
  if (name == "none") return Policy::kNone;
  throw std::invalid_argument("unknown prefetch policy '" + name +
                              "' (expected window, distance, all or none)");
}

namespace {

// Every counter once, with its name: snapshot and reset both walk this.
const std::pair<const char*, std::atomic<uint64_t> GatherCounters::*> kCounterFields[] = {
    {"calls", &GatherCounters::calls},
    {"rows", &GatherCounters::rows},
    {"unique_pages", &GatherCounters::unique_pages},
    {"advised_pages", &GatherCounters::advised_pages},
    {"resident_pages", &GatherCounters::resident_pages},
    {"evicted_before_copy", &GatherCounters::evicted_before_copy},
    {"max_advised_ahead_bytes", &GatherCounters::max_advised_ahead_bytes},
    {"major_faults", &GatherCounters::major_faults},
    {"minor_faults", &GatherCounters::minor_faults},
    {"gather_ns", &GatherCounters::gather_ns},
    {"prefetch_hits", &GatherCounters::prefetch_hits},
    {"prefetch_misses", &GatherCounters::prefetch_misses},
    {"row_cache_hits", &GatherCounters::row_cache_hits},
    {"row_cache_misses", &GatherCounters::row_cache_misses},
};

}  // namespace

std::map<std::string, uint64_t> GatherCounters::snapshot(int64_t row_bytes) const {
  std::map<std::string, uint64_t> values;
  for (const auto& [name, field] : kCounterFields) values[name] = (this->*field).load();
  values["bytes_copied"] = values["rows"] * static_cast<uint64_t>(row_bytes);
  return values;
}

void GatherCounters::reset() {
  for (const auto& [name, field] : kCounterFields) (this->*field).store(0);
}

MappedTable::MappedTable(const std::vector<std::string>& paths,
                         const std::vector<int64_t>& shard_file,
                         const std::vector<int64_t>& shard_offset,
                         const std::vector<int64_t>& shard_rows,
                         int64_t row_bytes)
    : row_bytes_(row_bytes) {
  if (shard_file.empty() || shard_file.size() != shard_offset.size() ||
      shard_file.size() != shard_rows.size()) {
    throw std::invalid_argument("a table needs one file, offset and row count per shard");
  }
  if (row_bytes <= 0) throw std::invalid_argument("row_bytes must be positive");
  try {
    for (const auto& path : paths) files_.push_back(map_file(path));
    for (size_t i = 0; i < shard_file.size(); ++i) {
      const MappedFile& file = files_.at(shard_file[i]);
      const uint64_t begin = static_cast<uint64_t>(shard_offset[i]);
      const uint64_t bytes = static_cast<uint64_t>(shard_rows[i]) * row_bytes;
      if (shard_offset[i] < 0 || shard_rows[i] < 0 || begin + bytes > file.size) {
        throw std::invalid_argument(
            file.path + ": shard " + std::to_string(i) + " (bytes " +
            std::to_string(begin) + " to " + std::to_string(begin + bytes) +
            ") runs past the end of the file (" + std::to_string(file.size) +
            " bytes)");
      }
      shards_.push_back({file.base + begin, shard_rows[i]});
      num_rows_ += shard_rows[i];
    }
  } catch (...) {
    for (auto& file : files_) unmap_file(file);
    throw;
  }
  rows_per_shard_ = shards_.front().rows > 0 ? shards_.front().rows : 1;
}

MappedTable::~MappedTable() {
  // The gather in progress ends first: it reads the mappings.
  shut_down();
  for (auto& file : files_) unmap_file(file);
}

void MappedTable::shut_down() {
  std::unique_ptr<std::thread> worker;
  {
    std::lock_guard<std::mutex> lock(prefetch_.mutex);
    prefetch_.stopping = true;
    prefetch_.cancel.store(true);
    worker = std::move(prefetch_.worker);
  }
  prefetch_.changed.notify_all();
  if (worker != nullptr && worker->joinable()) worker->join();
  // What was not gathered will not be: its gathers read their rows themselves.
  std::lock_guard<std::mutex> lock(prefetch_.mutex);
  for (const auto& request : prefetch_.pending) {
    if (!request->done) {
      request->error = std::make_exception_ptr(Interrupted());
      request->done = true;
    }
  }
  prefetch_.changed.notify_all();
}

void MappedTable::lock_for_fork() {
  prefetch_.mutex.lock();
  row_cache_.mutex().lock();
  config_mutex_.lock();
}

void MappedTable::unlock_after_fork(bool in_child) {
  config_mutex_.unlock();
  row_cache_.mutex().unlock();
  if (in_child) {
    // The thread is the parent's: the child neither joins it nor waits for it.
    (void)prefetch_.worker.release();
    // The condition variable counts the parent's waiters, which the child
    // would wait for: a new one replaces it (the old one is not destroyed,
    // which would wait for them too).
    new (&prefetch_.changed) std::condition_variable;
    auto& pending = prefetch_.pending;
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [](const auto& request) { return !request->done || request->taken; }),
                  pending.end());
  }
  prefetch_.mutex.unlock();
}

void MappedTable::gather(const void* ids, bool ids_are_int64, int64_t n, uint8_t* out,
                         RowRange resident) {
  Interruption stop;  // the calling thread's poll, if it has one
  if (take_prefetched(ids, ids_are_int64, n, out, resident, stop)) return;
  gather_rows(*this, ids, ids_are_int64, n, out, resident, /*use_row_cache=*/true, stop);
}

void MappedTable::prefetch(std::vector<int64_t> ids, RowRange resident) {
  auto request = std::make_shared<PrefetchRequest>();
  request->ids = std::move(ids);
  request->resident = resident;
  // What a request's rows take (or will take, once the prefetch thread has them).
  auto bytes_of = [this](const PrefetchRequest& r) { return r.ids.size() * row_bytes_; };
  {
    std::lock_guard<std::mutex> lock(prefetch_.mutex);
    if (prefetch_.stopping) return;
    if (prefetch_.worker == nullptr) {
      prefetch_.worker = std::make_unique<std::thread>([this] { run_prefetches(); });
    }
    auto& pending = prefetch_.pending;
    uint64_t held = bytes_of(*request);
    for (const auto& queued : pending) held += queued->taken ? 0 : bytes_of(*queued);
    // Oldest first; a running one finishes unseen (the worker holds it).
    for (auto it = pending.begin(); held > kMaxPendingPrefetchBytes && it != pending.end();) {
      if ((*it)->taken) {
        ++it;
        continue;
      }
      held -= bytes_of(**it);
      it = pending.erase(it);
    }
    pending.push_back(std::move(request));
  }
  prefetch_.changed.notify_all();
}

void MappedTable::run_prefetches() {
  std::unique_lock<std::mutex> lock(prefetch_.mutex);
  for (;;) {
    std::shared_ptr<PrefetchRequest> next;
    prefetch_.changed.wait(lock, [&] {
      for (const auto& request : prefetch_.pending) {
        if (!request->started) {
          next = request;
          break;
        }
      }
      return prefetch_.stopping || next != nullptr;
    });
    if (prefetch_.stopping) return;
    next->started = true;
    lock.unlock();
    std::exception_ptr error;
    try {
      next->rows.resize(next->ids.size() * row_bytes_);
      Interruption stop(&prefetch_.cancel);  // by shut_down
      gather_rows(*this, next->ids.data(), true, next->ids.size(), next->rows.data(),
                  next->resident, /*use_row_cache=*/true, stop);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    next->error = error;
    next->done = true;
    prefetch_.changed.notify_all();
  }
}

bool MappedTable::take_prefetched(const void* ids, bool ids_are_int64, int64_t n, uint8_t* out,
                                  RowRange resident, Interruption& stop) {
  // Prefetched ids are int64; a request of int32 ids is compared value by value.
  auto same_ids = [&](const std::vector<int64_t>& queued) {
    if (static_cast<int64_t>(queued.size()) != n) return false;
    if (ids_are_int64) return std::memcmp(queued.data(), ids, n * sizeof(int64_t)) == 0;
    const auto* narrow = static_cast<const int32_t*>(ids);
    return std::equal(queued.begin(), queued.end(), narrow);
  };
  std::unique_lock<std::mutex> lock(prefetch_.mutex);
  auto& pending = prefetch_.pending;
  bool others = false;
  std::shared_ptr<PrefetchRequest> request;
  for (const auto& queued : pending) {
    if (queued->taken) continue;
    if (queued->resident == resident && same_ids(queued->ids)) {
      request = queued;
      break;
    }
    others = true;
  }
  if (request == nullptr) {
    if (others) ++counters_.prefetch_misses;
    return false;
  }
  request->taken = true;  // nobody drops it now: the worker will get to it
  while (!prefetch_.changed.wait_for(lock, kPollInterval, [&] { return request->done; })) {
    lock.unlock();
    try {
      stop.check();
    } catch (...) {
      lock.lock();
      request->taken = false;  // a later gather of these ids may take it
      throw;
    }
    lock.lock();
  }
  pending.erase(std::find(pending.begin(), pending.end(), request));
  lock.unlock();
  if (request->error) {
    ++counters_.prefetch_misses;
    return false;  // the caller's own gather raises the error
  }
  std::memcpy(out, request->rows.data(), request->rows.size());
  ++counters_.prefetch_hits;
  return true;
}

std::string MappedTable::locate(uintptr_t address) const {
  for (const auto& file : files_) {
    const auto base = reinterpret_cast<uintptr_t>(file.base);
    if (address >= base && address < base + file.size) {
      return file.path + ", byte " + std::to_string(address - base);
    }
  }
  return "an address outside the table's files";
}

GatherConfig MappedTable::config() const {
  std::lock_guard<std::mutex> lock(config_mutex_);
  return config_;
}

void MappedTable::set_config(const GatherConfig& config) {
  if (config.threads < 1) throw std::invalid_argument("threads must be at least 1");
  if (config.threads > kMaxThreads) {
    throw std::invalid_argument("threads must be at most " + std::to_string(kMaxThreads) + ", got " +
                                std::to_string(config.threads));
  }
  row_cache_.configure(config.row_cache_bytes, row_bytes_);
  std::lock_guard<std::mutex> lock(config_mutex_);
  config_ = config;
}

void MappedTable::drop_page_cache() {
  for (auto& file : files_) {
    // Clean pages still mapped by this process are not dropped by fadvise.
    ::madvise(file.base, file.size, MADV_DONTNEED);
    ::posix_fadvise(file.fd, 0, 0, POSIX_FADV_DONTNEED);
  }
  row_cache_.clear();
}

int64_t register_table(std::shared_ptr<MappedTable> table) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  const int64_t handle = next_handle++;
  registry.emplace(handle, std::move(table));
  return handle;
}

std::shared_ptr<MappedTable> find_table(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry.find(handle);
  if (it == registry.end()) {
    throw std::invalid_argument("no open ple table has handle " + std::to_string(handle) +
                                " (closed, or never opened)");
  }
  return it->second;
}

void unregister_table(int64_t handle) {
  std::shared_ptr<MappedTable> table;  // shut down and destroyed outside the lock
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry.find(handle);
    if (it == registry.end()) return;
    table = std::move(it->second);
    registry.erase(it);
  }
  table->shut_down();
}

}  // namespace ple
