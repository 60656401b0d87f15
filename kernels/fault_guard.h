// Copies out of memory-mapped files that may shrink or fail to read.
//
// Touching a page of a mapping past the end of its (truncated) file, or a page
// the disk cannot read, raises SIGBUS, which kills the process.  A guarded
// copy turns that SIGBUS into a return value instead: the handler jumps back
// out of the copy on the thread that faulted.  SIGBUS from anywhere else goes
// to whatever handler was installed before (or kills the process, as it
// would have).
#pragma once

#include <cstddef>

namespace ple {

// Makes sure the SIGBUS handler is ours (another library may have replaced
// it since; it is then chained to).  Call before guarded copies.
void ensure_fault_handler();

// memcpy that returns false, instead of dying, when the source faults.  The
// destination may then be partly written.
bool guarded_copy(void* dst, const void* src, size_t bytes);

}  // namespace ple
