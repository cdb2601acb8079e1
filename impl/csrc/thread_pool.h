// A persistent pool of worker threads for the kernels' parallel loops.
//
// Work items are claimed dynamically, but each writes only its own output, so which
// thread runs an item never changes a result (REFERENCE.md invariant 7). The caller
// takes part and waits only for the items others claimed: a worker that never gets a
// core during a loop is not waited for. Parallel loops from several callers run one
// after another.
#pragma once

#include <cstdint>
#include <functional>

namespace pagecheck {

// Worker count, the calling thread included. Initially $PAGECHECK_NUM_THREADS when it
// holds a positive integer, else the number of CPUs this process may run on.
int num_threads();
void set_num_threads(int n);

// Calls fn(i) for every i in [0, n) and returns when all calls have returned.
// At most 2^32 - 1 items (std::length_error beyond).
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

// For tests: while held, the workers claim no item, as if the OS never ran them; every
// loop then runs in its caller alone, with the same results.
void hold_workers(bool held);
// Items run by worker threads (not by callers) since the process started.
int64_t worker_items();
// Times an idle worker yielded its core (sched_yield) since the process started.
int64_t worker_yields();
// Idle spells in which a worker began to yield before its hold (thread_pool.cpp kHold)
// had run its course since the process started: 0 unless the hold is broken.
int64_t worker_early_yields();

}  // namespace pagecheck
