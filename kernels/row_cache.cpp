#include "row_cache.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <utility>

namespace ple {

LazyArray::LazyArray(uint64_t bytes, bool sparse) {
  if (bytes == 0) return;
  const int flags = MAP_PRIVATE | MAP_ANONYMOUS | (sparse ? MAP_NORESERVE : 0);
  void* mapped = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (mapped == MAP_FAILED) throw std::bad_alloc();
  data_ = static_cast<uint8_t*>(mapped);
  bytes_ = bytes;
}

LazyArray::~LazyArray() {
  if (data_ != nullptr) ::munmap(data_, bytes_);
}

void LazyArray::discard() {
  if (data_ != nullptr) ::madvise(data_, bytes_, MADV_DONTNEED);
}

void LazyArray::swap(LazyArray& other) noexcept {
  std::swap(data_, other.data_);
  std::swap(bytes_, other.bytes_);
}

namespace {

// The index starts this small (1 KiB) and doubles while it would be more than half full.
constexpr int kFirstIndexBits = 8;

int64_t* ids_of(const LazyArray& slots) { return reinterpret_cast<int64_t*>(slots.data()); }
uint32_t* entries_of(const LazyArray& index) { return reinterpret_cast<uint32_t*>(index.data()); }

}  // namespace

uint64_t RowCache::home(int64_t id) const {
  // Fibonacci hashing: the top bits of the product spread consecutive ids.
  return (static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull) >> (64 - index_bits_);
}

uint64_t RowCache::find(int64_t id) const {
  const uint64_t mask = index_size_ - 1;
  const uint32_t* index = entries_of(index_);
  const int64_t* slot_ids = ids_of(slot_ids_);
  uint64_t i = home(id);
  while (index[i] != 0 && slot_ids[index[i] - 1] != id) i = (i + 1) & mask;
  return i;
}

void RowCache::erase_at(uint64_t hole) {
  const uint64_t mask = index_size_ - 1;
  uint32_t* index = entries_of(index_);
  const int64_t* slot_ids = ids_of(slot_ids_);
  for (uint64_t j = (hole + 1) & mask; index[j] != 0; j = (j + 1) & mask) {
    // The entry at j may fill the hole unless its home lies cyclically in (hole, j].
    const uint64_t k = home(slot_ids[index[j] - 1]);
    const bool stays = hole <= j ? (hole < k && k <= j) : (hole < k || k <= j);
    if (stays) continue;
    index[hole] = index[j];
    hole = j;
  }
  index[hole] = 0;
}

bool RowCache::grow_index() {
  const int bits = index_size_ == 0 ? kFirstIndexBits : index_bits_ + 1;
  LazyArray grown;
  try {
    grown = LazyArray((uint64_t{1} << bits) * sizeof(uint32_t));
  } catch (const std::bad_alloc&) {
    return false;
  }
  grown.swap(index_);  // grown now holds the old index, unmapped on return
  const uint32_t* old = entries_of(grown);
  const uint64_t old_size = index_size_;
  index_size_ = uint64_t{1} << bits;
  index_bits_ = bits;
  uint32_t* index = entries_of(index_);
  for (uint64_t i = 0; i < old_size; ++i) {
    if (old[i] != 0) index[find(ids_of(slot_ids_)[old[i] - 1])] = old[i];
  }
  return true;
}

void RowCache::forget_rows() {
  arena_.discard();
  slot_ids_.discard();
  referenced_.discard();
  index_ = LazyArray();
  index_size_ = 0;
  index_bits_ = 0;
  used_ = 0;
  hand_ = 0;
}

void RowCache::configure(uint64_t budget_bytes, int64_t row_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t rows = row_bytes > 0 ? budget_bytes / static_cast<uint64_t>(row_bytes) : 0;
  // More rows than the index can number: a budget that cannot be had, like
  // one that cannot be mapped (mapping it would succeed where memory is
  // overcommitted, yet hold fewer rows than asked).
  if (rows > static_cast<uint64_t>(kMaxRows)) throw std::bad_alloc();
  const int64_t capacity = static_cast<int64_t>(rows);
  if (capacity == capacity_.load() && row_bytes == row_bytes_) return;
  // Everything that can fail comes first: a budget that cannot be had leaves
  // the cache as it was.  Nothing is touched: no page becomes resident here.
  LazyArray arena, slot_ids, referenced;
  if (capacity > 0) {
    arena = LazyArray(static_cast<uint64_t>(capacity) * row_bytes);
    slot_ids = LazyArray(static_cast<uint64_t>(capacity) * sizeof(int64_t));
    referenced = LazyArray(static_cast<uint64_t>(capacity));
  }
  arena_.swap(arena);
  slot_ids_.swap(slot_ids);
  referenced_.swap(referenced);
  row_bytes_ = row_bytes;
  index_ = LazyArray();
  index_size_ = 0;
  index_bits_ = 0;
  used_ = 0;
  hand_ = 0;
  capacity_ = capacity;
}  // the old mappings are unmapped here

void RowCache::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (capacity_.load() == 0) return;
  forget_rows();  // and gives the pages back: a cleared cache holds no memory
}

bool RowCache::lookup(int64_t id, uint8_t* out) {
  if (used_ == 0) return false;
  const uint32_t entry = entries_of(index_)[find(id)];
  if (entry == 0) return false;
  const int64_t slot = entry - 1;
  std::memcpy(out, arena_.data() + slot * row_bytes_, row_bytes_);
  referenced_.data()[slot] = 1;
  return true;
}

void RowCache::insert(int64_t id, const uint8_t* row) {
  const int64_t capacity = capacity_.load();
  if (capacity == 0) return;
  if (used_ > 0 && entries_of(index_)[find(id)] != 0) return;
  int64_t* slot_ids = ids_of(slot_ids_);
  uint8_t* referenced = referenced_.data();
  int64_t slot;
  if (used_ < capacity) {
    // Slots fill in order before any eviction; the index stays at most half full.
    if (static_cast<uint64_t>(used_ + 1) * 2 > index_size_ && !grow_index()) return;
    slot = used_++;
  } else {
    while (referenced[hand_]) {
      referenced[hand_] = 0;
      hand_ = (hand_ + 1) % capacity;
    }
    slot = hand_;
    hand_ = (hand_ + 1) % capacity;
    erase_at(find(slot_ids[slot]));
  }
  std::memcpy(arena_.data() + slot * row_bytes_, row, row_bytes_);
  slot_ids[slot] = id;
  referenced[slot] = 0;
  entries_of(index_)[find(id)] = static_cast<uint32_t>(slot + 1);
}

}  // namespace ple
