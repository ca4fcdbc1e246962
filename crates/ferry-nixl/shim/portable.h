// Built into the wheel's plugin only (FERRY_NIXL_PORTABLE, build.rs): the
// wheel is manylinux_2_28, whose libstdc++ (GCC 8) is older than the g++
// that compiles it. g++ 11 and later call std::__throw_bad_array_new_length
// (GLIBCXX_3.4.29) from the allocators the containers here use; defined
// here, the plugin asks no newer libstdc++ than manylinux_2_28 allows
// (auditwheel checks), and the definition stays inside it (rustc's version
// script exports only the plugin's Rust entry points).
#pragma once

#include <new>

namespace std {
[[noreturn]] void __throw_bad_array_new_length() { throw std::bad_array_new_length(); }
} // namespace std
