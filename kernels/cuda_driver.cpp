#include "cuda_driver.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>

#include "mapped_table.h"

namespace ple {

namespace {

// The process that first used the driver: its forked children cannot.
std::atomic<pid_t> driver_pid{0};

template <typename Function>
void find(void* lib, const char* name, Function*& entry) {
  entry = reinterpret_cast<Function*>(::dlsym(lib, name));
}

}  // namespace

const Driver& driver() {
  static const Driver loaded = [] {
    Driver d;
    void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = ::dlerror();  // names the library
      d.unusable = why != nullptr ? why : "cannot load libcuda.so.1";
      return d;
    }
    driver_pid.store(::getpid());
    auto required = [&](const char* name, auto*& entry) {
      find(lib, name, entry);
      if (entry == nullptr && d.unusable.empty()) {
        d.unusable = std::string("libcuda.so.1 has no ") + name;
      }
    };
    required("cuLaunchHostFunc", d.launch_host_func);
    required("cuMemHostRegister_v2", d.mem_host_register);
    required("cuMemHostUnregister", d.mem_host_unregister);
    required("cuMemHostGetDevicePointer_v2", d.mem_host_get_device_pointer);
    required("cuThreadExchangeStreamCaptureMode", d.exchange_capture_mode);
    required("cuInit", d.init);
    required("cuCtxGetCurrent", d.ctx_get_current);
    required("cuCtxSetCurrent", d.ctx_set_current);
    required("cuDeviceGet", d.device_get);
    required("cuDevicePrimaryCtxRetain", d.primary_ctx_retain);
    find(lib, "cuStreamWaitValue32_v2", d.stream_wait_value32);
    find(lib, "cuStreamWriteValue32_v2", d.stream_write_value32);
    find(lib, "cuStreamGetCaptureInfo_v3", d.stream_get_capture_info_v3);
    find(lib, "cuStreamGetCaptureInfo_v2", d.stream_get_capture_info_v2);
    find(lib, "cuGraphNodeGetDependencies_v2", d.graph_node_get_dependencies_v2);
    find(lib, "cuGraphNodeGetDependencies", d.graph_node_get_dependencies);
    find(lib, "cuGraphAddHostNode", d.graph_add_host_node);
    return d;
  }();
  if (!loaded.unusable.empty()) throw OsError("cannot use the CUDA driver: " + loaded.unusable);
  return loaded;
}

void check(CUresult result, const char* what) {
  if (result != 0) {
    throw std::runtime_error(std::string(what) + " failed (CUresult " + std::to_string(result) + ")");
  }
}

CapturePoint Driver::capture_point(CUstream stream) const {
  constexpr int kCaptureActive = 1;  // CU_STREAM_CAPTURE_STATUS_ACTIVE
  int status = 0;
  CapturePoint point;
  const CUgraphNode* frontier = nullptr;
  size_t count = 0;
  if (stream_get_capture_info_v3 != nullptr) {
    // The edges' data too: a query without it fails where an edge carries any.
    const CudaGraphEdgeData* edges = nullptr;
    check(stream_get_capture_info_v3(stream, &status, nullptr, &point.graph, &frontier, &edges,
                                     &count),
          "cuStreamGetCaptureInfo_v3");
  } else {
    check(stream_get_capture_info_v2(stream, &status, nullptr, &point.graph, &frontier, &count),
          "cuStreamGetCaptureInfo_v2");
  }
  if (status != kCaptureActive || point.graph == nullptr) {
    throw std::runtime_error("cuStreamGetCaptureInfo: the stream is not capturing a graph");
  }
  // The array is the driver's until the next call on the stream: copied now.
  if (frontier != nullptr) point.frontier.assign(frontier, frontier + count);
  return point;
}

bool Driver::add_dependencies_of(CUgraphNode node, std::vector<CUgraphNode>& out) const {
  std::vector<CUgraphNode> found;
  size_t count = 0;
  if (graph_node_get_dependencies_v2 != nullptr) {
    // With room for the edges' data: a query without it fails where an edge
    // carries any.
    if (graph_node_get_dependencies_v2(node, nullptr, nullptr, &count) != 0) return false;
    found.resize(count);
    std::vector<CudaGraphEdgeData> edges(count);
    if (count > 0 &&
        graph_node_get_dependencies_v2(node, found.data(), edges.data(), &count) != 0) {
      return false;
    }
  } else if (graph_node_get_dependencies != nullptr) {
    if (graph_node_get_dependencies(node, nullptr, &count) != 0) return false;
    found.resize(count);
    if (count > 0 && graph_node_get_dependencies(node, found.data(), &count) != 0) return false;
  } else {
    return false;
  }
  found.resize(count);
  for (CUgraphNode dependency : found) {
    if (std::find(out.begin(), out.end(), dependency) == out.end()) out.push_back(dependency);
  }
  return true;
}

RelaxedCaptureMode::RelaxedCaptureMode() {
  check(driver().exchange_capture_mode(&mode_), "cuThreadExchangeStreamCaptureMode");
}

RelaxedCaptureMode::~RelaxedCaptureMode() { driver().exchange_capture_mode(&mode_); }

void page_lock(void* data, size_t bytes) {
  RelaxedCaptureMode relaxed;
  // CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP
  check(driver().mem_host_register(data, bytes, 0x01 | 0x02), "cuMemHostRegister");
}

void page_unlock(void* data) {
  RelaxedCaptureMode relaxed;
  check(driver().mem_host_unregister(data), "cuMemHostUnregister");
}

void ensure_context(int ordinal) {
  CUcontext current = nullptr;
  check(driver().ctx_get_current(&current), "cuCtxGetCurrent");
  if (current != nullptr) return;
  int device = 0;
  check(driver().init(0), "cuInit");
  check(driver().device_get(&device, ordinal), "cuDeviceGet");
  check(driver().primary_ctx_retain(&current, device), "cuDevicePrimaryCtxRetain");
  check(driver().ctx_set_current(current), "cuCtxSetCurrent");
}

bool forked_after_cuda() {
  const pid_t pid = driver_pid.load();
  return pid != 0 && pid != ::getpid();
}

}  // namespace ple
