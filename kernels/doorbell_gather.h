// The host gather of a captured CUDA graph, rung by the graph itself.
//
// A host node (cuLaunchHostFunc) pays on every replay for a callback from the
// GPU to a driver thread and for the completion back, about 27 us on an H200
// by itself.  Instead the graph rings a doorbell: it writes a word of pinned
// memory (cuStreamWriteValue32), and waits (cuStreamWaitValue32) for a done
// word that a host thread of ple raises once it has gathered the rows into
// staging; the graph then lowers the done word for its next replay.  Both
// are stream memory operations, which graphs capture; neither blocks a host
// thread of the caller.
//
// Two answer a ring, and exactly one of them gathers for it (the one that
// lowers the ring word first):
// - the doorbell thread ("ple-doorbell"), one for the process, which spins
//   while replays come often and sleeps on a futex, taking no CPU, once none
//   has come for a while;
// - the replay's wake-up node: each doorbell also adds a host node to the
//   graph, beside the ids' copy that comes before the ring (it depends on
//   what the copy depends on, and nothing depends on it), so that it runs as
//   the gather's part of the replay begins.  When it finds the doorbell
//   thread asleep, it answers the ring itself, on the driver's thread for
//   host functions, which the GPU has just woken: a replay after a pause
//   waits for that one thread, as a graph of a host node does, not for a
//   second thread's wake-up.  It wakes the doorbell thread only when replays
//   come close together (the thread then answers the next ones by spinning)
//   or when its ring has not come within a bound.
// Whoever answers a ring raises the done word whatever the gather did: a
// failed gather sets the status word (the output is NaN and the next call
// raises), and never leaves the stream waiting.  The doorbell thread lives
// as long as the process and is never joined: a replay still running while
// the process exits is answered.  doorbell_gather.cpp gives the times.
#pragma once

#include <cstdint>

#include "host_gather.h"

namespace ple {

// Enqueues `job` on `stream`, which is being captured, as a doorbell ring,
// a wait for done and its reset, and adds the ring's wake-up node to the
// graph.  Returns false, having enqueued nothing, when the driver refuses
// stream memory operations (the caller then uses a host node).
bool enqueue_doorbell_gather(CUstream stream, const HostGatherJob& job);

// Whether the driver has refused a doorbell in this process: a device that
// cannot use stream memory operations refuses every capture, so later
// captures go straight to host nodes.
bool doorbell_refused();

// Who answered the rings of this process so far: counts for benchmarks and
// tests.
struct DoorbellCounts {
  uint64_t by_thread = 0;  // rings the doorbell thread answered
  uint64_t by_node = 0;    // rings a wake-up node answered
  uint64_t handed_over = 0;  // wake-up nodes whose ring came too late: the thread answered
  uint64_t thread_wakes = 0;  // times a wake-up node woke the thread for replays close together
};
DoorbellCounts doorbell_counts();

// While `spin` holds the doorbell thread never sleeps: it answers every ring
// by spinning, whatever the pause before it, taking a CPU all the while.  For
// benchmarks that tell the cost of a wake-up from the rest of a replay.
void set_doorbell_always_spins(bool spin);

}  // namespace ple
