#include "call_key.h"

#include <mlx/array.h>

#include <cstdint>
#include <initializer_list>
#include <vector>

namespace nb = nanobind;

namespace pagecheck {

namespace {

// An option's type in the key's bytes: the types whose values the key holds, and arrays.
enum class OptionType : int64_t { none, boolean, integer, real, text, array };

bool option_type(PyObject* x, PyTypeObject* array_type, OptionType& t) {
  PyTypeObject* type = Py_TYPE(x);
  if (x == Py_None) t = OptionType::none;
  else if (type == &PyBool_Type) t = OptionType::boolean;
  else if (type == &PyLong_Type) t = OptionType::integer;
  else if (type == &PyFloat_Type) t = OptionType::real;
  else if (type == &PyUnicode_Type) t = OptionType::text;
  else if (type == array_type) t = OptionType::array;
  else return false;
  return true;
}

// ndim, dims..., dtype: an array's part of the key's bytes.
void add_array(std::vector<int64_t>& words, const mlx::core::array& a) {
  words.push_back(static_cast<int64_t>(a.ndim()));
  for (const int d : a.shape()) words.push_back(d);
  words.push_back(static_cast<int64_t>(a.dtype().val()));
}

}  // namespace

nb::object call_key(nb::handle query, nb::handle key_pages, nb::handle value_pages, nb::handle options) {
  auto* const array_type = reinterpret_cast<PyTypeObject*>(nb::type<mlx::core::array>().ptr());
  for (const nb::handle h : {query, key_pages, value_pages})
    if (Py_TYPE(h.ptr()) != array_type) return nb::none();
  if (!PyTuple_CheckExact(options.ptr())) return nb::none();
  const Py_ssize_t n = PyTuple_GET_SIZE(options.ptr());
  // The shapes, dtypes and option types as one bytes object (hashed in one pass), then
  // each plain option's value (None in an array option's place).
  std::vector<int64_t> words;
  words.reserve(64);
  for (const nb::handle h : {query, key_pages, value_pages}) add_array(words, nb::cast<const mlx::core::array&>(h));
  nb::object key = nb::steal(PyTuple_New(n + 1));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* x = PyTuple_GET_ITEM(options.ptr(), i);
    OptionType t;
    if (!option_type(x, array_type, t)) return nb::none();
    if (i == 0 && t == OptionType::real && PyFloat_AS_DOUBLE(x) == 0.0) return nb::none();
    words.push_back(static_cast<int64_t>(t));
    if (t == OptionType::array) {
      add_array(words, nb::cast<const mlx::core::array&>(nb::handle(x)));
      x = Py_None;
    }
    PyTuple_SET_ITEM(key.ptr(), i + 1, nb::borrow(x).release().ptr());
  }
  PyObject* bytes = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(words.data()),
                                              static_cast<Py_ssize_t>(words.size() * sizeof(int64_t)));
  if (bytes == nullptr) throw nb::python_error();
  PyTuple_SET_ITEM(key.ptr(), 0, bytes);
  return key;
}

}  // namespace pagecheck
