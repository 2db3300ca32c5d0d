// std::vector whose storage starts on a cache line (64 bytes): for the kernels' buffers that are reused across
// calls (activation codes, a panel made ready for AMX tiles, attention scores, projection scratch).
//
// Why: malloc aligns to 16 bytes, so a plain vector's rows may start mid-line, and then every 64-byte load or tile
// row of them touches two cache lines. Which alignment a buffer got depended on the allocating thread's malloc
// arena: the same prefill step ran slower on the server's step thread (its own arena) than on the main thread.
// Aligned storage makes the kernels' speed independent of the thread that calls them (`python -m
// kvserve.loadtest profile --step-thread` compares the two threads).
#ifndef KVSERVE_ALIGNED_VECTOR_H
#define KVSERVE_ALIGNED_VECTOR_H

#include <cstddef>
#include <new>
#include <vector>

namespace kvserve {

// A std::allocator that aligns every allocation to kCacheLine bytes (aligned operator new, C++17).
template <class T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::size_t kCacheLine = 64;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{kCacheLine})); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{kCacheLine}); }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};

template <class T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

}  // namespace kvserve

#endif  // KVSERVE_ALIGNED_VECTOR_H
