// Transparent huge pages for the weights the kernels stream: asked for where a packed weight is allocated, before
// its pages are first written (advice on pages already resident changes nothing until khugepaged gets to them).
//
// Why: a decode step reads every weight once from memory, and on 4 KiB pages each 4 KiB of it is a TLB entry of
// its own, walked for again on every step. `python -m kvserve.loadtest kernelbench --ggml-model` times a decode
// step's projections on the same bytes advised against huge pages beside it (BENCHMARKS.md, ggml-model). The
// read-bandwidth probe the benchmarks set the kernels against reads numpy's buffers, which numpy advises for huge
// pages from 4 MiB on: with the advice the kernels' weights lie as the probe's bytes do.
#ifndef KVSERVE_HUGE_PAGES_H
#define KVSERVE_HUGE_PAGES_H

#include <cstdint>
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvserve {

constexpr uintptr_t kHugePage = uintptr_t{2} << 20;  // x86-64's transparent huge page (PMD size)

// madvise(MADV_HUGEPAGE) over the whole 2 MiB pages inside [p, p + bytes): the kernel backs them with huge pages
// at their first fault where /sys/kernel/mm/transparent_hugepage/enabled says "always" or "madvise" (not "never").
// Returns the bytes advised: 0 for a buffer holding no whole huge page, off Linux, or where madvise refuses.
inline int64_t advise_huge_pages(void* p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t begin = ((uintptr_t)p + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = ((uintptr_t)p + (uintptr_t)bytes) & ~(kHugePage - 1);
  if (bytes > 0 && end > begin && madvise((void*)begin, end - begin, MADV_HUGEPAGE) == 0) return (int64_t)(end - begin);
#else
  (void)p;
  (void)bytes;
#endif
  return 0;
}

}  // namespace kvserve

#endif  // KVSERVE_HUGE_PAGES_H
