// The CUDA driver, reached with dlopen at run time: the native part needs no
// CUDA toolkit to build, and does nothing with CUDA on a machine without a
// driver.  Only the entry points ple uses, with the driver API's types.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ple {

using CUresult = int;
using CUstream = void*;
using CUcontext = void*;
using CUdeviceptr = unsigned long long;
using CUhostFn = void (*)(void*);
using CUgraph = void*;
using CUgraphNode = void*;

struct CudaHostNodeParams {  // CUDA_HOST_NODE_PARAMS
  CUhostFn fn;
  void* user_data;
};

struct CudaGraphEdgeData {  // CUgraphEdgeData: what an edge's data is, never read here
  unsigned char from_port, to_port, type, reserved[5];
};

// Where a stream's capture stands: the graph it captures into, and the nodes
// that the next operation captured on the stream will depend on.
struct CapturePoint {
  CUgraph graph = nullptr;
  std::vector<CUgraphNode> frontier;
};

struct Driver {
  CUresult (*launch_host_func)(CUstream, CUhostFn, void*) = nullptr;
  CUresult (*mem_host_register)(void*, size_t, unsigned) = nullptr;
  CUresult (*mem_host_unregister)(void*) = nullptr;
  CUresult (*mem_host_get_device_pointer)(CUdeviceptr*, void*, unsigned) = nullptr;
  CUresult (*exchange_capture_mode)(int*) = nullptr;
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*device_get)(int*, int) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, int) = nullptr;
  // Stream memory operations (CUDA 11.7 and later; nullptr with an older
  // driver): a stream waits for a word to hold a value, or writes one.
  CUresult (*stream_wait_value32)(CUstream, CUdeviceptr, uint32_t, unsigned) = nullptr;
  CUresult (*stream_write_value32)(CUstream, CUdeviceptr, uint32_t, unsigned) = nullptr;
  // Where a stream's capture stands (cuStreamGetCaptureInfo, the _v3 entry
  // point of CUDA 12.3 and later, else the _v2 one), the nodes a node
  // depends on (cuGraphNodeGetDependencies, _v2 of CUDA 12.3 and later with
  // the edges' data), and a node added to a graph directly: the doorbell's
  // wake-up node (doorbell_gather.h).
  CUresult (*stream_get_capture_info_v3)(CUstream, int*, uint64_t*, CUgraph*, const CUgraphNode**,
                                         const CudaGraphEdgeData**, size_t*) = nullptr;
  CUresult (*stream_get_capture_info_v2)(CUstream, int*, uint64_t*, CUgraph*, const CUgraphNode**,
                                         size_t*) = nullptr;
  CUresult (*graph_node_get_dependencies_v2)(CUgraphNode, CUgraphNode*, CudaGraphEdgeData*,
                                             size_t*) = nullptr;
  CUresult (*graph_node_get_dependencies)(CUgraphNode, CUgraphNode*, size_t*) = nullptr;
  CUresult (*graph_add_host_node)(CUgraphNode*, CUgraph, const CUgraphNode*, size_t,
                                  const CudaHostNodeParams*) = nullptr;

  // Why the driver cannot be used (the library or a required entry point
  // is missing); empty when it can.
  std::string unusable;

  bool has_stream_memory_ops() const {
    return stream_wait_value32 != nullptr && stream_write_value32 != nullptr;
  }
  bool can_add_captured_nodes() const {
    return (stream_get_capture_info_v3 != nullptr || stream_get_capture_info_v2 != nullptr) &&
           graph_add_host_node != nullptr;
  }
  // Where `stream`'s capture stands; throws unless it is capturing.
  CapturePoint capture_point(CUstream stream) const;
  // The nodes that `node` depends on, appended to `out` (those already in
  // it are not added twice); false, with `out` as it was, where the driver
  // cannot say.
  bool add_dependencies_of(CUgraphNode node, std::vector<CUgraphNode>& out) const;
};

// cuStreamWaitValue32's condition that the word equals the value, and
// cuStreamWriteValue32's default (a memory barrier before the write).
constexpr unsigned kWaitValueEqual = 0x1;
constexpr unsigned kWriteValueDefault = 0x0;

// The driver; OsError when libcuda.so.1 or one of the required entry points
// is missing.
const Driver& driver();

// Throws std::runtime_error naming `what` unless `result` is CUDA_SUCCESS.
void check(CUresult result, const char* what);

// Page-locking memory is refused while any stream captures a graph in the
// default (global) mode; like torch's own allocator, the thread switches to
// the relaxed mode for the call, which allows it.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode();
  ~RelaxedCaptureMode();
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  int mode_ = 2;  // CU_STREAM_CAPTURE_MODE_RELAXED
};

// Page-locks host memory (pinned for every context, and mapped for the
// device: kernels and stream memory operations reach it), also while a graph
// is being captured; and undoes it.  The calling thread needs a current
// context (ensure_context).
void page_lock(void* data, size_t bytes);
void page_unlock(void* data);

// Page-locking needs a current context.  A thread that has not used CUDA yet
// (a host tier placed before any CUDA call, a table closed from another
// thread) gets the primary context of `ordinal`, the one torch uses for that
// device, rather than one on a device the process does not use.
void ensure_context(int ordinal);

// Whether this process is a forked child of one that used the CUDA driver
// here: its pinned memory and streams are the parent's, and the driver
// cannot serve it (the child must leave them alone).
bool forked_after_cuda();

}  // namespace ple
