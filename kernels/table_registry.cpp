#include "table_registry.h"

#include <pthread.h>

#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace ple {

namespace {

std::mutex registry_mutex;
std::unordered_map<int64_t, std::shared_ptr<MappedTable>> registry;
int64_t next_handle = 1;  // handles are never reused

// fork() copies the locks of the other threads as they are, held or not, and
// none of those threads: before it, this thread takes the registry's lock
// and every registered table's (none of them is held for long, and none is
// held while its holder waits for another), so that the child gets them all
// free and the structures they guard whole.
void lock_tables_for_fork() {
  registry_mutex.lock();
  for (auto& entry : registry) entry.second->lock_for_fork();
}

void unlock_tables_in_parent() {
  for (auto& entry : registry) entry.second->unlock_after_fork(false);
  registry_mutex.unlock();
}

void unlock_tables_in_child() {
  for (auto& entry : registry) entry.second->unlock_after_fork(true);
  registry_mutex.unlock();
}

const int tables_survive_fork =
    ::pthread_atfork(lock_tables_for_fork, unlock_tables_in_parent, unlock_tables_in_child);

}  // namespace

int64_t register_table(std::shared_ptr<MappedTable> table) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  const int64_t handle = next_handle++;
  registry.emplace(handle, std::move(table));
  return handle;
}

std::shared_ptr<MappedTable> find_table(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry.find(handle);
  if (it == registry.end()) {
    throw std::invalid_argument("no open ple table has handle " + std::to_string(handle) +
                                " (closed, or never opened)");
  }
  return it->second;
}

void unregister_table(int64_t handle) {
  std::shared_ptr<MappedTable> table;  // shut down and destroyed outside the lock
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry.find(handle);
    if (it == registry.end()) return;
    table = std::move(it->second);
    registry.erase(it);
  }
  table->shut_down();
}

}  // namespace ple
