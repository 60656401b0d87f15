// The row gather as host work in a CUDA stream (see host_gather.cpp).
#pragma once

#include <cstdint>
#include <string>

#include "cuda_driver.h"
#include "table_registry.h"

namespace ple {

// One gather of the CUDA operator's host side: the n int64 ids at `ids` into
// `staging` (ids in `resident` are left to the device and host tiers).  All
// three pointers are pinned host memory that stays valid while the work (or
// the graph it is captured into) may run.
struct HostGatherJob {
  int64_t handle;
  uintptr_t stream;  // the CUstream it is enqueued on; its errors are kept under it
  const int64_t* ids;  // written by a device-to-host copy ordered before the job
  int64_t n;
  ResidentRange resident;  // fixed at launch: a captured graph keeps its tiers
  uint8_t* staging;        // n * row_bytes
  int32_t* status;         // 0 when the rows in staging are this job's, else 1
  uint64_t owner = 0;      // the gather's prefetch owner: its plan advances as the job runs
};

// Runs `job` on the calling thread; never throws: a failure sets the status
// word and is kept for take_host_error.
void run_host_gather(const HostGatherJob& job);

// Enqueues `job` on its stream.  Eagerly, and in a graph where stream memory
// operations are missing (or PLE_GRAPH_GATHER=host_func), as a host function
// (cuLaunchHostFunc); in a graph otherwise, rung by the graph through a
// doorbell (doorbell_gather.h), which costs less on every replay.
void launch_host_gather(const HostGatherJob& job, bool capturing);

// How a gather captured now would run: "doorbell" or "host_func".
std::string graph_gather_mechanism();

// Page-locks host memory for the CUDA operator (also while a graph is being
// captured, which cudaHostRegister refuses), and undoes it.  `device`: whose
// primary context to use on a thread that has no current context.
void register_host_memory(void* data, size_t bytes, int device);
void unregister_host_memory(void* data, int device);

// The error of a failed host gather of this table on this stream, or of one
// in a graph, once; "" when there was none.
std::string take_host_error(int64_t handle, uintptr_t stream);

}  // namespace ple
