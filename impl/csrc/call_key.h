#pragma once
// The memo key of a serving call's checks (impl/checked.py `signature`), built in one
// compiled pass: in Python the same key took ~0.7 us of a B 1, S 128 decode's ~12.
#include <nanobind/nanobind.h>

namespace pagecheck {

// Everything the checks of a call read, as one hashable tuple: each of the three arrays'
// shape and dtype, each option by value (an mx.array option by its shape and dtype,
// never its values), then every option's type (True, 1 and 1.0 are equal keys that the
// checks tell apart). None where no key states the call exactly: an array argument that
// is not exactly an mx.array, an option of any other type, or a float scale of zero
// (0.0 == -0.0).
nanobind::object call_key(nanobind::handle query, nanobind::handle key_pages, nanobind::handle value_pages,
                          nanobind::handle options);

}  // namespace pagecheck
