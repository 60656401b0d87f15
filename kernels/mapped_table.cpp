#include "mapped_table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "direct_reader.h"

namespace ple {

namespace {

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

}  // namespace

MappedTable::MappedTable(const std::vector<std::string>& paths,
                         const std::vector<int64_t>& shard_file,
                         const std::vector<int64_t>& shard_offset,
                         const std::vector<int64_t>& shard_rows,
                         int64_t row_bytes)
    : row_bytes_(row_bytes),
      prefetch_(row_bytes, [this](const std::vector<int64_t>& ids, ResidentRange resident,
                                  PinnedRows& into, Interruption& stop) {
        prefetch_rows(*this, ids, resident, into, stop);
      }) {
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
  mapped_begin_ = UINTPTR_MAX;
  for (const auto& file : files_) {
    const auto base = reinterpret_cast<uintptr_t>(file.base);
    mapped_begin_ = std::min(mapped_begin_, base);
    mapped_end_ = std::max(mapped_end_, base + file.size);
  }
}

MappedTable::~MappedTable() {
  // The gather in progress ends first: it reads the mappings.
  shut_down();
  direct_files_.reset();
  for (auto& file : files_) unmap_file(file);
}

void MappedTable::shut_down() { prefetch_.shut_down(); }

uint64_t MappedTable::plan_prefetches(uint64_t owner, std::vector<std::vector<int64_t>> chunks,
                                      uint64_t max_bytes, ResidentRange resident) {
  return prefetch_.plan(owner, std::move(chunks), max_bytes, resident);
}

void MappedTable::end_plan(uint64_t owner, std::optional<uint64_t> plan) {
  prefetch_.end_plan(owner, plan);
}

bool MappedTable::planning(uint64_t owner, std::optional<uint64_t> plan) {
  return prefetch_.planning(owner, plan);
}

uint64_t MappedTable::drop_prefetches(std::optional<uint64_t> owner, uint64_t through) {
  return prefetch_.drop_untaken(owner, through);
}

uint64_t MappedTable::prefetched_bytes(std::optional<uint64_t> owner) {
  return prefetch_.held_bytes(owner);
}

void MappedTable::lock_for_fork() {
  configuring_.lock();
  prefetch_.lock_for_fork();
  row_cache_.mutex().lock();
  scratch_pool_.mutex().lock();
  config_mutex_.lock();
}

void MappedTable::unlock_after_fork(bool in_child) {
  config_mutex_.unlock();
  scratch_pool_.mutex().unlock();
  if (in_child) row_cache_.drop_pins();  // prefetches not yet taken then read their rows again
  row_cache_.mutex().unlock();
  prefetch_.unlock_after_fork(in_child);
  configuring_.unlock();
}

void MappedTable::gather(const void* ids, bool ids_are_int64, int64_t n, uint8_t* out,
                         ResidentRange resident, int64_t max_threads, uint64_t owner) {
  uint64_t plan = 0;  // the owner's plan this gather is a forward of: if it fails, it ends it
  try {
    Interruption stop;  // the calling thread's poll, if it has one
    int64_t taken = 0;
    switch (prefetch_.take(ids, ids_are_int64, n, out, resident, stop, taken, owner, plan)) {
      case PrefetchQueue::Taken::kHit:
        ++counters_.prefetch_hits;
        if (taken == n) return;
        break;  // a padded request: its rows after the prefetch's are read here
      case PrefetchQueue::Taken::kMissed:
        ++counters_.prefetch_misses;
        break;
      case PrefetchQueue::Taken::kNothingPending:
        break;
    }
    const size_t id_bytes = ids_are_int64 ? sizeof(int64_t) : sizeof(int32_t);
    gather_rows(*this, static_cast<const uint8_t*>(ids) + taken * id_bytes, ids_are_int64,
                n - taken, out + taken * row_bytes_, resident, /*use_row_cache=*/true, stop,
                max_threads);
  } catch (...) {
    if (plan != 0) prefetch_.end_plan(owner, plan);
    throw;
  }
}

uint64_t MappedTable::prefetch(std::vector<int64_t> ids, ResidentRange resident, uint64_t owner) {
  return prefetch_.push(std::move(ids), resident, owner);
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
  check_config(config);
  std::lock_guard<std::mutex> one_at_a_time(configuring_);
  IoBackend backend = io_backend();
  if (config.io == Io::kDirect) {
    backend = choose_backend();
    // Files opened for a config that then fails stay open for the next one.
    std::lock_guard<std::mutex> lock(config_mutex_);
    if (direct_files_ == nullptr) direct_files_ = std::make_unique<DirectFiles>(files_);
  }
  row_cache_.configure(config.row_cache_bytes, row_bytes_);
  std::lock_guard<std::mutex> lock(config_mutex_);
  io_backend_ = backend;
  config_ = config;
}

const DirectFiles& MappedTable::direct_files() const {
  std::lock_guard<std::mutex> lock(config_mutex_);
  return *direct_files_;
}

uint64_t MappedTable::io_block_bytes() const {
  std::lock_guard<std::mutex> lock(config_mutex_);
  return config_.io == Io::kMmap ? 0 : direct_files_->block(config_.io_block_bytes);
}

IoBackend MappedTable::io_backend() const {
  std::lock_guard<std::mutex> lock(config_mutex_);
  return io_backend_;
}

void MappedTable::drop_page_cache() {
  for (auto& file : files_) {
    // Clean pages still mapped by this process are not dropped by fadvise.
    ::madvise(file.base, file.size, MADV_DONTNEED);
    ::posix_fadvise(file.fd, 0, 0, POSIX_FADV_DONTNEED);
  }
  row_cache_.clear();
}

std::vector<int> MappedTable::duplicate_file_descriptors() const {
  std::vector<int> fds;
  for (const MappedFile& file : files_) {
    int fd = ::fcntl(file.fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) {
      std::string msg = errno_text("cannot duplicate the descriptor of", file.path);
      for (int opened : fds) ::close(opened);
      throw OsError(msg);
    }
    fds.push_back(fd);
  }
  return fds;
}

}  // namespace ple
