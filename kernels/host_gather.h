// The row gather as host work in a CUDA stream (see host_gather.cpp).
#pragma once

#include <cstdint>
#include <string>

#include "table_registry.h"

namespace ple {

// Enqueues, on `stream` (a CUstream), the gather of the n int64 ids at `ids`
// into `staging` (ids in `resident` are left to the device and host tiers);
// `status` is set to 0 when it succeeded, 1 when it failed.
// All three pointers are pinned host memory that stays valid while the work
// (or, when `capturing`, the graph it is captured into) may run.
void launch_host_gather(uintptr_t stream, int64_t handle, const int64_t* ids, int64_t n,
                        ResidentRange resident, uint8_t* staging, int32_t* status, bool capturing);

// Page-locks host memory for the CUDA operator (also while a graph is being
// captured, which cudaHostRegister refuses), and undoes it.  `device`: whose
// primary context to use on a thread that has no current context.
void register_host_memory(void* data, size_t bytes, int device);
void unregister_host_memory(void* data, int device);

// Whether this process is a forked child of one that used the CUDA driver
// here: its pinned memory and streams are the parent's, and the driver
// cannot serve it (the child must leave them alone).
bool forked_after_cuda();

// The error of a failed host gather of this table on this stream, once; ""
// when there was none.
std::string take_host_error(int64_t handle, uintptr_t stream);

}  // namespace ple
