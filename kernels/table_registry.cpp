#include "table_registry.h"

#include <pthread.h>

#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace ple {

namespace {

// The open tables and their lock.  Never destroyed: the process's exit would
// otherwise close every table still open (stopping its prefetch thread,
// unmapping its files) while threads that Python does not wait for, daemon
// threads and the worker pool's, may still be gathering from it or may
// start to; the process's end frees all of it.
struct Registry {
  std::mutex mutex;
  std::unordered_map<int64_t, std::shared_ptr<MappedTable>> tables;
  int64_t next_handle = 1;  // handles are never reused
};

Registry& registry = *new Registry;

// fork() copies the locks of the other threads as they are, held or not, and
// none of those threads: before it, this thread takes the registry's lock
// and every registered table's (none of them is held for long, and none is
// held while its holder waits for another), so that the child gets them all
// free and the structures they guard whole.
void lock_tables_for_fork() {
  registry.mutex.lock();
  for (auto& entry : registry.tables) entry.second->lock_for_fork();
}

void unlock_tables_in_parent() {
  for (auto& entry : registry.tables) entry.second->unlock_after_fork(false);
  registry.mutex.unlock();
}

void unlock_tables_in_child() {
  for (auto& entry : registry.tables) entry.second->unlock_after_fork(true);
  registry.mutex.unlock();
}

const int tables_survive_fork =
    ::pthread_atfork(lock_tables_for_fork, unlock_tables_in_parent, unlock_tables_in_child);

}  // namespace

int64_t register_table(std::shared_ptr<MappedTable> table) {
  std::lock_guard<std::mutex> lock(registry.mutex);
  const int64_t handle = registry.next_handle++;
  registry.tables.emplace(handle, std::move(table));
  return handle;
}

std::shared_ptr<MappedTable> find_table(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry.mutex);
  auto it = registry.tables.find(handle);
  if (it == registry.tables.end()) {
    throw std::invalid_argument("no open ple table has handle " + std::to_string(handle) +
                                " (closed, or never opened)");
  }
  return it->second;
}

void unregister_table(int64_t handle) {
  std::shared_ptr<MappedTable> table;  // shut down and destroyed outside the lock
  {
    std::lock_guard<std::mutex> lock(registry.mutex);
    auto it = registry.tables.find(handle);
    if (it == registry.tables.end()) return;
    table = std::move(it->second);
    registry.tables.erase(it);
  }
  table->shut_down();
}

}  // namespace ple
