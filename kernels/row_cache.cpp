#include "row_cache.h"

#include <sys/mman.h>

#include <cstring>
#include <new>

namespace ple {

RowCache::~RowCache() { release_arena(); }

void RowCache::release_arena() {
  if (arena_ != nullptr) ::munmap(arena_, static_cast<uint64_t>(capacity_.load()) * row_bytes_);
  arena_ = nullptr;
  capacity_ = 0;
}

void RowCache::forget_rows() {
  slot_id_.assign(capacity_.load(), 0);
  referenced_.assign(capacity_.load(), 0);
  slot_of_.clear();
  hand_ = 0;
}

void RowCache::configure(uint64_t budget_bytes, int64_t row_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t capacity = row_bytes > 0 ? static_cast<int64_t>(budget_bytes / row_bytes) : 0;
  if (capacity == capacity_.load() && row_bytes == row_bytes_) return;
  // Everything that can fail comes first: a budget that cannot be had leaves
  // the cache as it was.
  std::vector<int64_t> slot_id(capacity, 0);
  std::vector<uint8_t> referenced(capacity, 0);
  std::unordered_map<int64_t, int64_t> slot_of;
  slot_of.reserve(capacity);
  uint8_t* arena = nullptr;
  if (capacity > 0) {
    void* mapped = ::mmap(nullptr, static_cast<uint64_t>(capacity) * row_bytes, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) throw std::bad_alloc();
    arena = static_cast<uint8_t*>(mapped);
  }
  release_arena();
  arena_ = arena;
  row_bytes_ = row_bytes;
  slot_id_.swap(slot_id);
  referenced_.swap(referenced);
  slot_of_.swap(slot_of);
  hand_ = 0;
  capacity_ = capacity;
}

void RowCache::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (capacity_.load() == 0) return;
  // Give the pages back too: a cleared cache holds no memory.
  ::madvise(arena_, static_cast<uint64_t>(capacity_.load()) * row_bytes_, MADV_DONTNEED);
  forget_rows();
}

bool RowCache::lookup(int64_t id, uint8_t* out) {
  auto it = slot_of_.find(id);
  if (it == slot_of_.end()) return false;
  std::memcpy(out, arena_ + it->second * row_bytes_, row_bytes_);
  referenced_[it->second] = 1;
  return true;
}

void RowCache::insert(int64_t id, const uint8_t* row) {
  const int64_t capacity = capacity_.load();
  if (capacity == 0 || slot_of_.count(id) != 0) return;
  int64_t slot;
  if (static_cast<int64_t>(slot_of_.size()) < capacity) {
    slot = static_cast<int64_t>(slot_of_.size());  // slots fill in order before any eviction
  } else {
    while (referenced_[hand_]) {
      referenced_[hand_] = 0;
      hand_ = (hand_ + 1) % capacity;
    }
    slot = hand_;
    hand_ = (hand_ + 1) % capacity;
    slot_of_.erase(slot_id_[slot]);
  }
  std::memcpy(arena_ + slot * row_bytes_, row, row_bytes_);
  slot_id_[slot] = id;
  referenced_[slot] = 0;
  slot_of_.emplace(id, slot);
}

}  // namespace ple
