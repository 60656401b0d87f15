// The settings of a table's gather, defined once for Python and C++.
//
// ple.GatherConfig (ple/config.py) takes its policies, io modes, field names,
// units, defaults and ranges from the tables below, which bindings.cpp
// exports as native.POLICIES, native.IO_MODES and native.CONFIG_FIELDS;
// set_config checks the same ranges
// (the native side can be called directly, and must never take a value that
// it cannot count in).
#pragma once

#include <cstdint>
#include <string>

namespace ple {

// How the gather advises the kernel to read pages ahead of the copy
// (README "Prefetch policies"; the names are GatherConfig.policy's).
enum class Policy { kWindow, kDistance, kAll, kNone };

struct PolicyName {
  Policy policy;
  const char* name;
};

// Every policy by name; the first is the default.
inline constexpr PolicyName kPolicies[] = {
    {Policy::kWindow, "window"},
    {Policy::kDistance, "distance"},
    {Policy::kAll, "all"},
    {Policy::kNone, "none"},
};

// Where the rows that no tier or row cache holds are read from (the names
// are GatherConfig.io's): the page cache through the files' mappings, with
// the prefetch policy's advice, or the files themselves with O_DIRECT reads
// (direct_reader.h), which bypass the page cache.
enum class Io { kMmap, kDirect };

struct IoName {
  Io io;
  const char* name;
};

// Every io mode by name; the first is the default.
inline constexpr IoName kIoModes[] = {
    {Io::kMmap, "mmap"},
    {Io::kDirect, "direct"},
};

// The most threads one gather runs on.  The gather's threads live for the
// whole process (the worker pool keeps every thread it has started), and past
// the machine's CPUs more threads only contend; 256 is more than the CPUs of
// most hosts this runs on, and bounds what a wrong value can start.
constexpr int64_t kMaxThreads = 256;
// The default thread count is the machine's CPUs, at most this many.
constexpr int64_t kDefaultThreadsCap = 16;
// The largest window: 2**40 KiB (1 PiB, 2**50 bytes).  The gather counts the
// window in bytes in uint64 and adds it to mapped addresses (below 2**57 on
// every 64-bit Linux), which cannot wrap below 2**63; no page cache comes
// near it.
constexpr int64_t kMaxPrefetchWindowKib = int64_t{1} << 40;
constexpr int64_t kDefaultPrefetchWindowKib = 4096;
// The largest row cache budget: 2**40 MiB (1 EiB, 2**60 bytes), a factor 8
// below int64's limit for the byte counts (bytes as uint64, slots = bytes /
// row_bytes in int64).  A budget that the machine cannot map fails when it
// is set, with MemoryError.
constexpr int64_t kMaxRowCacheMib = int64_t{1} << 40;
// The most O_DIRECT reads one gather keeps in flight.  Each takes a buffer
// of up to 64 KiB (touched only as far as the reads fill it) and, with the
// pread backend, a thread of its own; past a few hundred reads a disk
// serves no more (README "Direct I/O").
constexpr int64_t kMaxIoQueueDepth = 1024;
constexpr int64_t kDefaultIoQueueDepth = 64;
// The largest block of a direct read: a read is at most 64 KiB (io_engines.h
// kMaxReadBytes; direct_reader.cpp asserts that a block fits in a read).
constexpr int64_t kMaxIoBlockBytes = 64 * 1024;
// The units of the two sizes.
constexpr int64_t kKiB = 1024, kMiB = 1024 * 1024;

// One int field of GatherConfig as Python sees it: a value in `unit`, which
// is `unit_bytes` bytes (0: a count, not a size), between `least` and `most`
// (both included), and a power of two or 0 where `power_of_two`.
struct ConfigField {
  const char* name;
  const char* unit;
  int64_t unit_bytes;
  int64_t default_value;  // for threads: the cap of the machine's CPUs
  int64_t least, most;
  bool power_of_two = false;
};

// GatherConfig's int fields, in its order (policy comes first, io last).
inline constexpr ConfigField kConfigFields[] = {
    {"prefetch_window_kib", "KiB", kKiB, kDefaultPrefetchWindowKib, 0, kMaxPrefetchWindowKib},
    {"threads", "threads", 0, kDefaultThreadsCap, 1, kMaxThreads},
    {"row_cache_mib", "MiB", kMiB, 0, 0, kMaxRowCacheMib},
    {"io_queue_depth", "reads", 0, kDefaultIoQueueDepth, 1, kMaxIoQueueDepth},
    {"io_block_bytes", "bytes", 1, 0, 0, kMaxIoBlockBytes, true},
};

// A table's settings as the native side holds them: sizes in bytes.
struct GatherConfig {
  Policy policy = kPolicies[0].policy;
  uint64_t window_bytes = kDefaultPrefetchWindowKib * kKiB;
  int threads = 1;
  uint64_t row_cache_bytes = 0;
  int io_queue_depth = kDefaultIoQueueDepth;
  // The block of direct reads; 0: the files' direct-I/O alignment.
  uint64_t io_block_bytes = 0;
  Io io = kIoModes[0].io;
};

// The policy of a name in kPolicies; std::invalid_argument for another.
Policy parse_policy(const std::string& name);
// The io mode of a name in kIoModes; std::invalid_argument for another.
Io parse_io(const std::string& name);

// Throws std::invalid_argument, naming the field and its range, unless every
// field of `config` is within kConfigFields' ranges.
void check_config(const GatherConfig& config);

}  // namespace ple
