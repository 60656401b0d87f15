// Open tables by handle.  Tables are reached from Python and from operators
// by an integer handle.  A gather holds a shared_ptr, so closing a table
// while it is being gathered from only unmaps it when that gather is done.
// Unregistering shuts the table's prefetches down at once.  A forked child
// inherits every table registered at the fork, usable as in the parent.
// The process's exit closes none: tables still open stay so to its end,
// their prefetch threads too (table_registry.cpp says why).
#pragma once

#include <cstdint>
#include <memory>

#include "mapped_table.h"

namespace ple {

int64_t register_table(std::shared_ptr<MappedTable> table);
std::shared_ptr<MappedTable> find_table(int64_t handle);  // throws if unknown
void unregister_table(int64_t handle);

}  // namespace ple
