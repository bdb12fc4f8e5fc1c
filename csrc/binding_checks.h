// What both binding modules (bindings.cpp: _C, cpu_bindings.cpp: _cpu) check at the boundary.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <string>

namespace nanovllm::binding {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

[[noreturn]] inline void value_error(const std::string& msg) { throw pybind11::value_error(msg); }

inline int32_t checked_int32(int64_t v, const char* name, int64_t lo, int64_t hi = kInt32Max) {
  if (v < lo || v > hi) {
    value_error(std::string(name) + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                "], got " + std::to_string(v));
  }
  return static_cast<int32_t>(v);
}

}  // namespace nanovllm::binding
