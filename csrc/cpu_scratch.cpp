#include "cpu_scratch.h"

#include <sys/mman.h>

#include <new>

namespace nanovllm {
namespace {
constexpr size_t kHugePage = size_t{2} << 20;
}  // namespace

void ScratchUnmap::operator()(std::byte*) const {
  if (base != nullptr) munmap(base, bytes);
}

ScratchBuffer scratch_buffer(int64_t bytes) {
  const size_t want = bytes > 0 ? static_cast<size_t>(bytes) : 1;
  const bool huge = want >= kHugePage;
  // Room to start on a 2 MiB boundary; private, as a shared mapping follows THP's shmem setting.
  const size_t span = huge ? (want + kHugePage - 1) / kHugePage * kHugePage + kHugePage : want;
  void* base = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) throw std::bad_alloc();
  auto* at = static_cast<std::byte*>(base);
  if (huge) {
    at += (kHugePage - reinterpret_cast<uintptr_t>(at) % kHugePage) % kHugePage;
#if defined(MADV_HUGEPAGE)
    madvise(at, span - static_cast<size_t>(at - static_cast<std::byte*>(base)), MADV_HUGEPAGE);  // no THP: 4 KiB pages
#endif
  }
#if defined(MADV_POPULATE_WRITE)
  // Its pages now, in one call, rather than a fault at each first touch inside a kernel's loop: on
  // the KVM hosts here a faulted 2 MiB page costs ~0.7 ms a MB (its zeroing in the fault handler),
  // populating ~0.26 (Intel Xeon with AMX). Before Linux 5.14 the call fails and the faults stay.
  madvise(at, want, MADV_POPULATE_WRITE);
#endif
  return ScratchBuffer(at, ScratchUnmap{base, span});
}

std::byte* GrowingScratch::at_least(int64_t n) {
  if (n > bytes) {
    data = scratch_buffer(n);
    bytes = n;
  }
  return data.get();
}

}  // namespace nanovllm
