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

// Makes sure the SIGBUS handler is ours (another library, or Python's
// signal.signal, may have replaced it since; it is then chained to).  Call
// before guarded copies, and again now and then during them: a handler
// installed between this call and a fault would meet that fault instead of
// ours (SIG_DFL kills the process; a handler that returns, as Python's do,
// makes the copy fault again forever).  Costs one sigaction call when the
// handler is ours.
void ensure_fault_handler();

// Runs copy(context) and returns true, or returns false, instead of dying,
// when the copy touches a page that raises SIGBUS: the copy then stops where
// it faulted.  A fault jumps out of `copy`, so it must hold nothing that
// needs a destructor or a lock.  One sigsetjmp for the whole copy: guard a
// batch of rows at once, and redo the batch row by row to find the row.
bool run_guarded(void (*copy)(void*), void* context);

// run_guarded of a callable (same rules).
template <typename Copy>
bool run_guarded(Copy& copy) {
  return run_guarded([](void* callable) { (*static_cast<Copy*>(callable))(); }, &copy);
}

// memcpy that returns false, instead of dying, when the source faults.  The
// destination may then be partly written.
bool guarded_copy(void* dst, const void* src, size_t bytes);

}  // namespace ple
