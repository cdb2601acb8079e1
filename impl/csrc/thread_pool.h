// A persistent pool of worker threads for the kernels' parallel loops.
//
// Work items are claimed dynamically, but each writes only its own output, so which
// thread runs an item never changes a result (REFERENCE.md invariant 7). The caller
// takes part; parallel loops from several callers run one after another.
#pragma once

#include <cstdint>
#include <functional>

namespace pagecheck {

// Worker count, the calling thread included. Initially $PAGECHECK_NUM_THREADS when it
// holds a positive integer, else the number of CPUs this process may run on.
int num_threads();
void set_num_threads(int n);

// Calls fn(i) for every i in [0, n) and returns when all calls have returned.
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

}  // namespace pagecheck
