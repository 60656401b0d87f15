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
uint32_t* pins_of(const LazyArray& pins) { return reinterpret_cast<uint32_t*>(pins.data()); }

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
  pins_.discard();
  pinned_slots_ = 0;
  ++generation_;
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
  LazyArray arena, slot_ids, referenced, pins;
  if (capacity > 0) {
    arena = LazyArray(static_cast<uint64_t>(capacity) * row_bytes);
    slot_ids = LazyArray(static_cast<uint64_t>(capacity) * sizeof(int64_t));
    referenced = LazyArray(static_cast<uint64_t>(capacity));
    pins = LazyArray(static_cast<uint64_t>(capacity) * sizeof(uint32_t));
  }
  arena_.swap(arena);
  slot_ids_.swap(slot_ids);
  referenced_.swap(referenced);
  pins_.swap(pins);
  pinned_slots_ = 0;
  ++generation_;
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
    // At most half the slots are pinned: within two turns the hand finds one.
    const uint32_t* pins = pins_of(pins_);
    while (referenced[hand_] || pins[hand_] != 0) {
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

int64_t RowCache::pin_slot(int64_t slot) {
  uint32_t& pins = pins_of(pins_)[slot];
  if (pins == 0) {
    if (pinned_slots_ >= capacity_.load() / 2) return -1;
    ++pinned_slots_;
  }
  ++pins;
  referenced_.data()[slot] = 1;
  return slot;
}

int64_t RowCache::pin(int64_t id, uint64_t generation) {
  if (generation != generation_ || used_ == 0) return -1;
  const uint32_t entry = entries_of(index_)[find(id)];
  return entry == 0 ? -1 : pin_slot(entry - 1);
}

int64_t RowCache::insert_pinned(int64_t id, const uint8_t* row, uint64_t generation) {
  if (generation != generation_) return -1;
  insert(id, row);
  return pin(id, generation);
}

bool RowCache::take_pinned(int64_t slot, uint64_t generation, uint8_t* out) {
  if (generation != generation_) return false;
  std::memcpy(out, arena_.data() + slot * row_bytes_, row_bytes_);
  unpin(slot, generation);
  return true;
}

void RowCache::unpin(int64_t slot, uint64_t generation) {
  if (generation != generation_) return;
  if (--pins_of(pins_)[slot] == 0) --pinned_slots_;
}

void RowCache::drop_pins() {
  pins_.discard();
  pinned_slots_ = 0;
  ++generation_;
}

uint8_t* PinnedRows::start(RowCache* cache, int64_t n, int64_t row_bytes) {
  release();
  cache_ = cache;
  if (cache != nullptr) {
    std::lock_guard<std::mutex> lock(cache->mutex());
    generation_ = cache->generation();
  }
  row_bytes_ = row_bytes;
  where_.assign(n, kNotPinned);
  buffer_.resize(static_cast<size_t>(n) * row_bytes);
  return buffer_.data();
}

void PinnedRows::keep(const int64_t* ids, int64_t resident_begin, int64_t resident_end) {
  int64_t kept = 0;
  for (size_t position = 0; position < where_.size(); ++position) {
    if (where_[position] != kNotPinned) continue;
    if (ids[position] >= resident_begin && ids[position] < resident_end) {
      where_[position] = kResident;
      continue;
    }
    // Rows move down only, each to a place that no later row is read from.
    if (kept != static_cast<int64_t>(position)) {
      std::memcpy(buffer_.data() + kept * row_bytes_, buffer_.data() + position * row_bytes_,
                  row_bytes_);
    }
    where_[position] = own(kept++);
  }
  buffer_.resize(static_cast<size_t>(kept) * row_bytes_);
  buffer_.shrink_to_fit();
}

int64_t PinnedRows::pinned() const {
  return std::count_if(where_.begin(), where_.end(), [](int64_t where) { return where >= 0; });
}

bool PinnedRows::take(uint8_t* out) {
  bool whole = true;
  {
    std::unique_lock<std::mutex> lock;
    if (cache_ != nullptr) lock = std::unique_lock<std::mutex>(cache_->mutex());
    for (size_t position = 0; position < where_.size(); ++position) {
      const int64_t where = where_[position];
      uint8_t* row = out + position * row_bytes_;
      if (where >= 0) {
        whole &= cache_->take_pinned(where, generation_, row);
      } else if (where != kResident) {
        std::memcpy(row, buffer_.data() + (own(0) - where) * row_bytes_, row_bytes_);
      }
    }
  }
  where_ = {};
  buffer_ = {};
  return whole;
}

void PinnedRows::release() {
  if (cache_ != nullptr) {
    std::lock_guard<std::mutex> lock(cache_->mutex());
    for (const int64_t slot : where_) {
      if (slot >= 0) cache_->unpin(slot, generation_);
    }
  }
  where_ = {};
  buffer_ = {};
}

}  // namespace ple
