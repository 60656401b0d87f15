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
// The one doorbell thread ("ple-doorbell") watches every captured gather of
// the process.  It spins while replays come often and sleeps, taking no
// CPU, once none has come for a while.  What wakes it is the graph: each
// doorbell also puts a host node at the graph's start, with no edge to the
// rest, whose function (on the driver's thread for host functions) wakes the
// doorbell thread when it sleeps and then answers the ring itself if it
// comes first, so that the first replay after a pause waits for one thread
// to wake, not for a poll or two (doorbell_gather.cpp gives the times).
// Whoever answers a ring raises the done word whatever the gather did: a
// failed gather sets the status word (the output is NaN and the next call
// raises), and never leaves the stream waiting.
#pragma once

#include "host_gather.h"

namespace ple {

// Enqueues `job` on `stream`, which is being captured, as a doorbell ring,
// a wait for done and its reset.  Returns false, having enqueued nothing,
// when the driver refuses stream memory operations (the caller then uses a
// host node).
bool enqueue_doorbell_gather(CUstream stream, const HostGatherJob& job);

// Whether the driver has refused a doorbell in this process: a device that
// cannot use stream memory operations refuses every capture, so later
// captures go straight to host nodes.
bool doorbell_refused();

}  // namespace ple
