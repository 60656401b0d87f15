// The direct-I/O read of a gather (GatherConfig.io "direct"): the rows that no
// tier or row cache holds, read from the table's files with O_DIRECT through
// an I/O engine (io_engines.h), each distinct aligned block once, and copied
// from the engine's aligned buffers into the output.  The page cache is not
// used, the files' mappings are never touched (so no SIGBUS), and a short
// read, an I/O error or a truncated file is an OsError naming the file, the
// byte and the row.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "interrupt.h"
#include "io_engines.h"
#include "mapped_table.h"

namespace ple {

// A table's files opened a second time, with O_DIRECT, each through its
// open descriptor (/proc/self/fd): the same files that the table mapped at
// open, even if their paths now name others.  Reads are aligned to
// alignment(): the largest direct-I/O offset alignment of the files (statx
// STATX_DIOALIGN: the device's logical block size, 512 B or 4 KiB; 4 KiB
// where the kernel does not say).
class DirectFiles {
 public:
  struct File {
    std::string path;
    int fd;
    uint64_t size;   // when the table was opened
    uintptr_t base;  // where the table maps it: how a row's address names its file
  };

  // OsError naming the file where the filesystem refuses O_DIRECT (ramfs,
  // some FUSE and network filesystems).
  explicit DirectFiles(const std::vector<MappedFile>& files);
  ~DirectFiles();
  DirectFiles(const DirectFiles&) = delete;
  DirectFiles& operator=(const DirectFiles&) = delete;

  const std::vector<File>& files() const { return files_; }  // by ascending base
  uint64_t alignment() const { return alignment_; }
  // The block of reads for GatherConfig.io_block_bytes `requested`: the
  // alignment where it is 0 or smaller.
  uint64_t block(uint64_t requested) const { return std::max(requested, alignment_); }

 private:
  std::vector<File> files_;
  uint64_t alignment_ = 0;
};

// A row placed in its file.
struct PlacedRow {
  uint32_t file;
  uint64_t offset;
  int64_t position;
};

// One read: whole blocks of one file, the blocks under first_row and
// possibly under the rows after it.
struct DirectRead {
  uint32_t file;
  uint64_t offset;
  uint32_t length;
  size_t first_row;  // the first row (in file order) that it holds bytes of
};

// What read_direct keeps from call to call, one for each gather that runs at
// once (in its GatherScratch): a call allocates none of its per-row memory
// once the table has served calls of its size, and a call that needed more
// than the gather keeps (row_gather.h) frees it at its end.
struct DirectScratch {
  std::vector<PlacedRow> placed;   // the rows to read, in file order
  std::vector<DirectRead> reads;   // in file order

  uint64_t bytes() const {
    return placed.capacity() * sizeof(PlacedRow) + reads.capacity() * sizeof(DirectRead);
  }
};

struct DirectCounters {
  uint64_t reads = 0;         // reads that completed (a run of adjacent blocks each)
  uint64_t read_bytes = 0;    // what they returned
  uint64_t unique_pages = 0;  // distinct 4 KiB file pages under the rows
};

// Reads the `n` rows at `by_address` (sorted by address, then position) into
// out + position * row_bytes, in reads of whole `block`s (a power of two,
// from files.alignment() to kMaxReadBytes), with the engines of `backend`,
// at most `depth` reads in flight in all, spread over up to `threads`
// threads.  `id_at` gives the id of a position, for errors.  `stop` can end
// it early (Interrupted; `out` partly written).
DirectCounters read_direct(const DirectFiles& files, uint64_t block, IoBackend backend, int depth,
                           int threads, int64_t row_bytes, const RowRef* by_address, size_t n,
                           DirectScratch& scratch, uint8_t* out,
                           const std::function<int64_t(int64_t)>& id_at, Interruption& stop);

}  // namespace ple
