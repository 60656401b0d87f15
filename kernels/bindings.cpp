// The Python face of the native part: tables by handle, the row gather, and
// counters, and the definitions Python takes from here (the settings'
// fields and ranges, the policies, the counters).  Operators are registered
// in Python (ops/), on top of these.
#include <cxxabi.h>
#include <dlfcn.h>
#include <pthread.h>
#include <torch/extension.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <thread>

#include "doorbell_gather.h"
#include "host_gather.h"
#include "counters.h"
#include "gather_config.h"
#include "interrupt.h"
#include "table_registry.h"

namespace py = pybind11;

// setup.py and the import-time build pass the torch version they built against.
#define PLE_STRINGIFY2(x) #x
#define PLE_STRINGIFY(x) PLE_STRINGIFY2(x)

namespace {

// Python runs signal handlers on its main thread only (a forked child's main
// thread is the one that forked).
std::atomic<unsigned long> main_thread{0};
const int main_thread_after_fork =
    ::pthread_atfork(nullptr, nullptr, [] { main_thread.store(PyThread_get_thread_ident()); });

bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// CPython before 3.14 ends a thread that takes the GIL once the interpreter
// finalizes (a daemon thread coming back from a gather, or waiting for the
// GIL in Python code) with pthread_exit, which unwinds the thread's C++
// frames: a noexcept one (any destructor that takes the GIL back: pybind11's
// gil_scoped_release, torch's) turns that into std::terminate, and a frame
// that gives up or takes back the GIL on the way (torch's dispatcher around a
// Python kernel) corrupts the finalizing thread's.  So ple takes the GIL, and
// calls Python from C++, through catch blocks that make such a thread wait
// for the process's end where it was ended, unwinding nothing, as CPython
// 3.14 makes it wait itself.
[[noreturn]] void wait_for_process_end() {
  for (;;) ::pause();
}

// `take()`, which takes the GIL or runs Python code, on a thread that
// CPython may end there.
template <typename Take>
auto unless_ended_by_python(Take take) -> decltype(take()) {
  try {
    return take();
  } catch (abi::__forced_unwind&) {
    wait_for_process_end();
  }
}

// The same end in torch's own frames (a torch operator that ple's Python
// code calls, torch's dispatch around ple's operators, any torch call of a
// daemon thread) reaches std::terminate; this handler makes such a thread
// (no active exception, not the main thread, Python finalizing) wait for
// the process's end too, and passes every other std::terminate to the
// handler that was there before.
std::terminate_handler terminate_before_ple = nullptr;
std::terminate_handler terminate_before_ple_in_process = nullptr;

[[noreturn]] void park_threads_ended_by_finalization() {
  if (std::current_exception() == nullptr && python_finalizing() &&
      PyThread_get_thread_ident() != main_thread.load()) {
    wait_for_process_end();
  }
  if (terminate_before_ple_in_process != nullptr) terminate_before_ple_in_process();
  if (terminate_before_ple != nullptr) terminate_before_ple();
  std::abort();
}

// The handler goes into ple's own libstdc++ and into the process's (the one
// torch's frames unwind with), which are two where the compiler that built
// ple links libstdc++ statically: seen on the GPU machine, where torch's
// frames then reached the process's default handler and aborted.  Called at
// import and again as Python begins to exit, after any library that set a
// handler of its own since.
void install_terminate_handler() {
  if (std::get_terminate() != &park_threads_ended_by_finalization) {
    terminate_before_ple = std::set_terminate(&park_threads_ended_by_finalization);
  }
  void* process_libstdcxx = ::dlopen("libstdc++.so.6", RTLD_NOW | RTLD_NOLOAD);
  if (process_libstdcxx == nullptr) return;
  using Set = std::terminate_handler (*)(std::terminate_handler);
  using Get = std::terminate_handler (*)();
  auto set = reinterpret_cast<Set>(::dlsym(process_libstdcxx, "_ZSt13set_terminatePFvvE"));
  auto get = reinterpret_cast<Get>(::dlsym(process_libstdcxx, "_ZSt13get_terminatev"));
  if (set != nullptr && get != nullptr && get() != &park_threads_ended_by_finalization) {
    std::terminate_handler before = set(&park_threads_ended_by_finalization);
    if (before != terminate_before_ple) terminate_before_ple_in_process = before;
  }
  ::dlclose(process_libstdcxx);
}

// A test hook: while set, a call that lets go of the GIL on a thread other
// than Python's main thread waits there until Python finalizes, then goes on.
// Tests park daemon threads inside each entry point with it, and exit.
std::atomic<bool> hold_calls{false};
std::atomic<int64_t> held_calls{0};      // calls that waited
std::atomic<int64_t> calls_back{0};      // of those, calls that came back for the GIL

void hold_until_finalizing() {
  held_calls.fetch_add(1);
  while (!python_finalizing()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

// Keeps the process up, once Python has finalized, until every held call has
// come back for the GIL, and a while after, for what that does to happen.
void wait_for_held_calls() {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (calls_back.load() < held_calls.load() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
}

// What every call that reads, waits or opens files runs under: the GIL let
// go for its life, and taken back unless Python ends the thread.
class WithoutGil {
 public:
  WithoutGil()
      : state_(PyEval_SaveThread()),
        held_(hold_calls.load() && PyThread_get_thread_ident() != main_thread.load()) {
    if (held_) hold_until_finalizing();
  }
  ~WithoutGil() {
    if (held_) calls_back.fetch_add(1);
    unless_ended_by_python([this] { PyEval_RestoreThread(state_); });
  }
  WithoutGil(const WithoutGil&) = delete;
  WithoutGil& operator=(const WithoutGil&) = delete;

 private:
  PyThreadState* state_;
  bool held_;
};

// fn(*args, **kwargs), for torch's dispatcher, which calls ple's operator
// kernels (Python functions) from frames of its own that give up and take
// back the GIL: a thread that Python ends in the kernel's code is not
// unwound through them.
py::object call_kernel(const py::object& fn, const py::args& args, const py::kwargs& kwargs) {
  PyObject* result =
      unless_ended_by_python([&] { return PyObject_Call(fn.ptr(), args.ptr(), kwargs.ptr()); });
  if (result == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(result);
}

// Whether a signal handler raised during this thread's gather.
thread_local bool handler_raised = false;

// The poll of a gather started from Python's main thread: runs the pending
// signal handlers, the GIL taken for the moment.  One that raises (Ctrl-C's
// KeyboardInterrupt) stops the gather; its exception stays set, to be
// raised once the gather has stopped.
bool poll_python_signals() {
  const PyGILState_STATE gil = unless_ended_by_python([] { return PyGILState_Ensure(); });
  const bool raised = unless_ended_by_python([] { return PyErr_CheckSignals(); }) != 0;
  PyGILState_Release(gil);
  handler_raised = handler_raised || raised;
  return raised;
}

// While it lives, the gathers of this thread run Python's signal handlers
// now and then (on the main thread; elsewhere there are none to run).
class PythonSignals {
 public:
  PythonSignals()
      : poll_(PyThread_get_thread_ident() == main_thread.load() ? &poll_python_signals : nullptr) {
    handler_raised = false;
  }
  // Raises what a handler raised, if one did (then whatever the gather
  // threw is dropped: the handler's exception is the one to see).
  void raise_if_raised() {
    if (!handler_raised) return;
    handler_raised = false;
    throw py::error_already_set();
  }

 private:
  ple::ScopedPoll poll_;
};

int64_t open_table(const std::vector<std::string>& paths, const std::vector<int64_t>& shard_file,
                   const std::vector<int64_t>& shard_offset, const std::vector<int64_t>& shard_rows,
                   int64_t row_bytes) {
  std::shared_ptr<ple::MappedTable> table;
  {
    WithoutGil no_gil;
    table = std::make_shared<ple::MappedTable>(paths, shard_file, shard_offset, shard_rows, row_bytes);
  }
  return ple::register_table(std::move(table));
}

// The names of a table of named choices (kPolicies, kIoModes), the default first.
template <typename Entry, size_t N>
py::tuple choice_names(const Entry (&choices)[N]) {
  py::list names;
  for (const Entry& choice : choices) names.append(choice.name);
  return py::tuple(names);
}

// A choice field of GatherConfig: its name, what it chooses (for errors),
// its default and its choices.
template <typename Entry, size_t N>
py::dict choice_field(const char* name, const char* what, const Entry (&choices)[N]) {
  py::dict field;
  field["name"] = name;
  field["what"] = what;
  field["default"] = choices[0].name;
  field["choices"] = choice_names(choices);
  return field;
}

// native.CONFIG_FIELDS: GatherConfig's fields in order, each a dict of its
// name and default, and its choices and what they choose (policy, io) or
// its unit, unit_bytes, least, most and power_of_two (the int fields).
py::tuple config_fields() {
  py::list fields;
  fields.append(choice_field("policy", "prefetch policy", ple::kPolicies));
  for (const ple::ConfigField& field : ple::kConfigFields) {
    py::dict entry;
    entry["name"] = field.name;
    entry["default"] = field.default_value;
    entry["unit"] = field.unit;
    entry["unit_bytes"] = field.unit_bytes;
    entry["least"] = field.least;
    entry["most"] = field.most;
    entry["power_of_two"] = field.power_of_two;
    fields.append(entry);
  }
  fields.append(choice_field("io", "io mode", ple::kIoModes));
  return py::tuple(fields);
}

// GatherConfig's fields with the sizes in bytes (unit_bytes times the value).
void configure(int64_t handle, const std::string& policy, uint64_t window_bytes, int threads,
               uint64_t row_cache_bytes, int io_queue_depth, uint64_t io_block_bytes,
               const std::string& io) {
  auto table = ple::find_table(handle);
  const ple::GatherConfig config{ple::parse_policy(policy), window_bytes, threads, row_cache_bytes,
                                 io_queue_depth, io_block_bytes, ple::parse_io(io)};
  WithoutGil no_gil;  // opening files for direct reads may wait for the disk
  table->set_config(config);
}

// What reads a table's rows from its files: "mmap", or the direct-I/O
// backend ("io_uring", "aio", "pread").
std::string io_backend(int64_t handle) {
  auto table = ple::find_table(handle);
  if (table->config().io == ple::Io::kMmap) return "mmap";
  return ple::backend_name(table->io_backend());
}

// The bytes of a block that direct reads are made of (GatherConfig.io
// "direct"); 0 with io "mmap".
uint64_t io_block_bytes(int64_t handle) { return ple::find_table(handle)->io_block_bytes(); }

// ids: contiguous int32/int64 CPU tensor; out: contiguous uint8 CPU tensor of
// ids.numel() * row_bytes bytes.  The caller (ops/) checks shapes and dtypes,
// and fills the rows of ids in `resident` from its tiers.  `for_tiers`: the
// rows are being read into the tiers, so no prefetch serves them and the row
// cache neither serves nor keeps them.  `owner`: the gather's prefetch owner,
// whose plan it may be a forward of (MappedTable::gather).
void read_rows(int64_t handle, const torch::Tensor& ids, torch::Tensor& out, ple::ResidentRange resident,
               bool for_tiers, uint64_t owner = 0) {
  TORCH_CHECK(ids.device().is_cpu() && ids.is_contiguous(), "ids must be a contiguous CPU tensor");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 || ids.scalar_type() == torch::kInt32,
              "ids must be int32 or int64");
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.scalar_type() == torch::kUInt8,
              "out must be a contiguous uint8 CPU tensor");
  auto table = ple::find_table(handle);
  TORCH_CHECK(out.numel() == ids.numel() * table->row_bytes(), "out has ", out.numel(),
              " bytes, the rows need ", ids.numel() * table->row_bytes());
  const void* id_data = ids.data_ptr();
  uint8_t* out_data = out.data_ptr<uint8_t>();
  const bool is_int64 = ids.scalar_type() == torch::kInt64;
  PythonSignals signals;
  try {
    WithoutGil no_gil;
    if (for_tiers) {
      ple::Interruption stop;
      ple::gather_rows(*table, id_data, is_int64, ids.numel(), out_data, resident,
                       /*use_row_cache=*/false, stop);
    } else {
      table->gather(id_data, is_int64, ids.numel(), out_data, resident, 0, owner);
    }
  } catch (...) {
    signals.raise_if_raised();
    throw;
  }
  signals.raise_if_raised();
}

uint64_t prefetch(int64_t handle, const torch::Tensor& ids, int64_t resident_begin,
                  int64_t resident_end, uint64_t owner) {
  TORCH_CHECK(ids.device().is_cpu() && ids.is_contiguous() && ids.scalar_type() == torch::kInt64,
              "prefetch ids must be a contiguous int64 CPU tensor");
  const int64_t* data = ids.data_ptr<int64_t>();
  auto table = ple::find_table(handle);
  std::vector<int64_t> copy(data, data + ids.numel());
  WithoutGil no_gil;
  return table->prefetch(std::move(copy), {resident_begin, resident_end}, owner);
}

// Starts `owner`'s plan on a table: `ids` holds its chunks back to back
// (contiguous int64, CPU), `sizes` their lengths (PrefetchQueue::plan).
uint64_t plan_prefetches(int64_t handle, uint64_t owner, const torch::Tensor& ids,
                         const std::vector<int64_t>& sizes, uint64_t max_bytes,
                         int64_t resident_begin, int64_t resident_end) {
  TORCH_CHECK(ids.device().is_cpu() && ids.is_contiguous() && ids.scalar_type() == torch::kInt64,
              "a plan's ids must be a contiguous int64 CPU tensor");
  int64_t total = 0;
  for (const int64_t size : sizes) {
    TORCH_CHECK(size > 0, "a plan's chunks hold ids, not ", size);
    total += size;
  }
  TORCH_CHECK(total == ids.numel(), "a plan's chunks hold ", total, " ids, not ", ids.numel());
  const int64_t* data = ids.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> chunks;
  chunks.reserve(sizes.size());
  for (const int64_t size : sizes) {
    chunks.emplace_back(data, data + size);
    data += size;
  }
  auto table = ple::find_table(handle);
  py::gil_scoped_release no_gil;  // it waits for a read of the plan it replaces
  return table->plan_prefetches(owner, std::move(chunks), max_bytes,
                                {resident_begin, resident_end});
}

// Raises `type` with `what`, decoded as Python decodes file names: messages
// name files by path, and a path need not be UTF-8 (pybind's own translation
// would raise UnicodeDecodeError instead of the error).
void set_error(PyObject* type, const char* what) {
  PyObject* text = PyUnicode_DecodeFSDefault(what);
  if (text == nullptr) {
    PyErr_Clear();
    text = PyUnicode_DecodeUTF8(what, static_cast<Py_ssize_t>(std::strlen(what)), "replace");
  }
  PyErr_SetObject(type, text);
  Py_XDECREF(text);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ple native part: memory-mapped tables and the windowed row gather";
  static py::exception<ple::OsError> os_error(m, "NativeOSError", PyExc_OSError);
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const ple::OsError& e) {
      set_error(os_error.ptr(), e.what());
    } catch (const std::invalid_argument& e) {
      set_error(PyExc_ValueError, e.what());
    } catch (const std::out_of_range& e) {
      set_error(PyExc_IndexError, e.what());
    }
  });
  m.attr("torch_version") = PLE_STRINGIFY(PLE_TORCH_VERSION);
  m.attr("MAX_THREADS") = ple::kMaxThreads;
  m.attr("MAX_PENDING_BYTES") = ple::PrefetchQueue::kMaxPendingBytes;
  m.attr("CONFIG_FIELDS") = config_fields();
  m.attr("POLICIES") = choice_names(ple::kPolicies);
  m.attr("IO_MODES") = choice_names(ple::kIoModes);
  m.attr("COUNTERS") = py::cast(ple::counter_meanings());  // [(name, meaning)], stats()'s order
  main_thread.store(py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>());
  install_terminate_handler();
  m.def("install_terminate_handler", &install_terminate_handler,
        "Puts ple's terminate handler back where another has replaced it (Python's exit does)");
  m.def(
      "set_poll_interval",
      [](double seconds) {
        if (!(seconds >= 0 && seconds <= 60)) {
          throw std::invalid_argument("a poll interval is 0 to 60 s");
        }
        ple::set_poll_interval(std::chrono::duration_cast<std::chrono::nanoseconds>(
            std::chrono::duration<double>(seconds)));
      },
      "How often a gather started on Python's main thread runs the signal handlers, in seconds "
      "(0.05 by default; 0: at every check, which tests use)");
  m.def(
      "hold_calls_until_exit",
      [] {
        static const int registered = std::atexit(&wait_for_held_calls);
        (void)registered;
        hold_calls.store(true);
      },
      "Test hook: from now on, a call that lets go of the GIL on a thread other than Python's main "
      "thread waits there until Python finalizes; the process's exit waits for those calls to "
      "come back for the GIL");
  m.def("held_calls", [] { return held_calls.load(); },
        "Calls that hold_calls_until_exit made wait");
  m.def("call_kernel", &call_kernel,
        "fn(*args, **kwargs) for torch's dispatcher: a thread that Python ends in fn as it "
        "finalizes waits there for the process's end, unwound through none of torch's frames");
  m.def("open_table", &open_table, "Maps a table's shards; returns its handle");
  // Without the GIL: closing waits for the table's prefetch thread to stop.
  m.def("close_table", &ple::unregister_table, py::call_guard<WithoutGil>(),
        "Forgets a handle and stops its prefetches; unmaps when no gather holds it");
  m.def("configure", &configure,
        "Sets policy, window (bytes), threads, row cache (bytes), io queue depth and io mode");
  m.def("io_backend", &io_backend, "What reads a table's rows from its files");
  m.def("io_block_bytes", &io_block_bytes, "The block of a table's direct reads (0: io mmap)");
  m.def(
      "gather",
      [](int64_t handle, const torch::Tensor& ids, torch::Tensor& out, int64_t resident_begin,
         int64_t resident_end, uint64_t owner) {
        read_rows(handle, ids, out, {resident_begin, resident_end}, false, owner);
      },
      "Copies rows ids of a table into out, for a prefetch owner (0: none)");
  m.def(
      "read_for_tiers",
      [](int64_t handle, const torch::Tensor& ids, torch::Tensor& out) {
        read_rows(handle, ids, out, {0, 0}, true);
      },
      "Copies rows ids into out for the tiers: no prefetch, no row cache");
  m.def(
      "file_descriptors",
      [](int64_t handle) { return ple::find_table(handle)->duplicate_file_descriptors(); },
      "New descriptors of a table's files, in its paths' order (the caller closes them)");
  m.def("stats", [](int64_t h) {
    auto table = ple::find_table(h);
    return table->counters().snapshot(table->row_bytes());
  });
  m.def("reset_stats", [](int64_t h) { ple::find_table(h)->counters().reset(); });
  m.def("prefetch", &prefetch,
        "Starts gathering ids for an owner on a background thread for the next gather of them; "
        "returns the prefetch's ticket");
  // Without the GIL: it waits for the prefetch being read.
  m.def(
      "drop_prefetches",
      [](int64_t handle, std::optional<uint64_t> owner, uint64_t through) {
        return ple::find_table(handle)->drop_prefetches(owner, through);
      },
      py::call_guard<WithoutGil>(),
      "Drops an owner's (None: every) prefetches up to a ticket that no gather has taken; returns "
      "their bytes once none of them is read");
  m.def("plan_prefetches", &plan_prefetches,
        "Starts an owner's plan: chunks of ids read ahead of its gathers within a bound; returns "
        "its number (0: none started)");
  // Without the GIL: they wait for the prefetch being read.
  m.def(
      "end_plan",
      [](int64_t handle, uint64_t owner, std::optional<uint64_t> plan) {
        ple::find_table(handle)->end_plan(owner, plan);
      },
      py::call_guard<py::gil_scoped_release>(),
      "Ends an owner's plan (None: whichever it has) and drops what it read ahead");
  m.def(
      "planning",
      [](int64_t handle, uint64_t owner, std::optional<uint64_t> plan) {
        return ple::find_table(handle)->planning(owner, plan);
      },
      py::call_guard<py::gil_scoped_release>(),
      "Whether an owner's plan (None: any) has chunks to come");
  m.def(
      "row_cache_pinned_rows",
      [](int64_t handle) {
        auto table = ple::find_table(handle);
        std::lock_guard<std::mutex> lock(table->row_cache().mutex());
        return table->row_cache().pinned_slots();
      },
      py::call_guard<WithoutGil>(),
      "Slots of a table's row cache that prefetches not yet taken hold pinned");
  m.def(
      "prefetched_bytes",
      [](int64_t handle, std::optional<uint64_t> owner) {
        return ple::find_table(handle)->prefetched_bytes(owner);
      },
      py::call_guard<WithoutGil>(),
      "The bytes of rows an owner's (None: every) prefetches hold");
  m.def(
      "launch_host_gather",
      [](uintptr_t stream, int64_t handle, uintptr_t ids, int64_t n, int64_t resident_begin,
         int64_t resident_end, uintptr_t staging, uintptr_t status, bool capturing,
         uint64_t owner) {
        ple::launch_host_gather({handle, stream, reinterpret_cast<const int64_t*>(ids), n,
                                 {resident_begin, resident_end}, reinterpret_cast<uint8_t*>(staging),
                                 reinterpret_cast<int32_t*>(status), owner},
                                capturing);
      },
      "Enqueues the gather of pinned ids into pinned staging on a CUDA stream, for a prefetch "
      "owner (0: none)");
  m.def("graph_gather_mechanism", &ple::graph_gather_mechanism,
        "How a gather captured in a CUDA graph now runs: \"doorbell\" or \"host_func\"");
  m.def(
      "doorbell_counts",
      [] {
        const ple::DoorbellCounts counts = ple::doorbell_counts();
        py::dict out;
        out["by_thread"] = counts.by_thread;
        out["by_node"] = counts.by_node;
        out["handed_over"] = counts.handed_over;
        out["thread_wakes"] = counts.thread_wakes;
        return out;
      },
      "Who answered the CUDA graphs' doorbells so far: the doorbell thread, a wake-up node, "
      "the thread after a node's wait ran out; and the wakes for replays close together");
  m.def("set_doorbell_always_spins", &ple::set_doorbell_always_spins,
        "While true, the doorbell thread answers every ring by spinning, never sleeping "
        "(benchmarks)");
  m.def("register_host_memory", [](uintptr_t data, size_t bytes, int device) {
    ple::register_host_memory(reinterpret_cast<void*>(data), bytes, device);
  });
  m.def("unregister_host_memory", [](uintptr_t data, int device) {
    ple::unregister_host_memory(reinterpret_cast<void*>(data), device);
  });
  m.def("take_host_error", &ple::take_host_error,
        "The error of a failed host gather of a table on a stream, once");
  m.def("drop_page_cache", [](int64_t h) {
    auto table = ple::find_table(h);
    WithoutGil no_gil;
    table->drop_page_cache();
  });
  m.def("forked_after_cuda", &ple::forked_after_cuda,
        "Whether this process is a forked child of one that used the CUDA driver");
}
