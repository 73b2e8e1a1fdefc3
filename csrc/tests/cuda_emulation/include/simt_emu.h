// A tiny SIMT emulator for logic checks of lantern's CUDA kernel headers on a machine without a GPU
// (tests/ops/test_verify_cuda_emulated.py, test_tree_attention_cuda_emulated.py).
// Model: one OS thread. emu::run_block(b, nt, body) runs the nt CUDA threads of block b as cooperative fibers
// (ucontext, each on its own mmap'd stack with a guard page below it), blocks one after another. The fibers run
// round-robin in thread-index order: one runs until it waits at a barrier or returns, then switches straight to
// the next runnable one, setting the globals threadIdx / blockIdx first (only .x is used). Barriers are real:
// __syncthreads waits for all nt threads of the block; the shuffles, ballots and __syncwarp wait for the 32
// lanes of the warp (every lane must call them, as the kernels do; the masks are ignored). The last arrival
// releases the others and runs on. When no fiber can run and some have not returned (a barrier that some
// threads never reach, or reach at a different place), it prints which threads wait where and aborts instead
// of hanging. __shared__ becomes a function-local static (one block at a time). Under AddressSanitizer every
// switch is announced to it (__sanitizer_start/finish_switch_fiber), so it follows the fibers' stacks and
// keeps the redzones of their live frames (it warns once that it does not fully support swapcontext).
// It checks control flow, indexing and arithmetic, not the GPU memory model: the fibers never run at the same
// time and each runs to its next barrier in thread-index order, so a missing __syncthreads() shows only where
// a thread reads what a higher-numbered thread writes in the same phase. Data races, warp-synchronous code
// without __syncwarp, shuffle masks, shared-memory and register limits and CUDA's own math functions go
// unchecked.
// Include it before any lantern/cuda header, with this directory first on the include path (it provides
// host stand-ins for <cuda_fp16.h> / <cuda_bf16.h>). C++20, Linux (ucontext, mmap).
#pragma once
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>
#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EMU_ASAN 1
#endif
#endif
#ifdef EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#define __device__
#define __global__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static
struct EmuDim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline EmuDim3 threadIdx, blockIdx;  // the running fiber's: set by the scheduler before each switch
namespace emu {
// The deepest fiber stack measured was under 6 KiB (ASan + UBSan, -O1; 1.6 KiB plain): ample room.
constexpr size_t kStackBytes = size_t{256} << 10;
constexpr int kMaxThreads = 1024;
[[noreturn]] inline void die(const char* what) {
  std::fprintf(stderr, "simt_emu: %s\n", what);
  std::fflush(stderr);
  std::abort();
}
[[noreturn]] inline void die_errno(const char* call) {
  std::perror(call);
  die("a fiber call failed");
}
// A fiber stack: an inaccessible guard page, then kStackBytes (the stack grows down into the guard page).
class Stack {
 public:
  Stack() {
    const long page = sysconf(_SC_PAGESIZE);
    if (page <= 0) die_errno("sysconf(_SC_PAGESIZE)");
    guard_ = static_cast<size_t>(page);
    void* p = mmap(nullptr, guard_ + kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) die_errno("mmap (fiber stack)");
    base_ = static_cast<char*>(p);
    if (mprotect(base_, guard_, PROT_NONE) != 0) die_errno("mprotect (fiber stack guard page)");
  }
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;
  ~Stack() { munmap(base_, guard_ + kStackBytes); }
  char* bottom() const { return base_ + guard_; }

 private:
  char* base_ = nullptr;
  size_t guard_ = 0;
};
enum class State { kRunnable, kWaiting, kDone };
struct Barrier {
  const char* name = "";
  int index = 0, expected = 0, arrived = 0;
  std::vector<int> waiters;  // thread indices, in arrival order
  void reset(const char* n, int i, int e) {
    name = n;
    index = i;
    expected = e;
    arrived = 0;
    waiters.clear();
  }
};
struct Fiber {
  ucontext_t ctx;  // not movable once made (glibc points into it): fibers live behind unique_ptr
  State state = State::kDone;
};
struct Scheduler {
  ucontext_t main_ctx;
  std::vector<std::unique_ptr<Stack>> stacks;  // kept across blocks
  std::vector<std::unique_ptr<Fiber>> fibers;
  int nt = 0, current = -1, finished = 0;
  void (*call)(void*) = nullptr;  // the block's body, type-erased
  void* body = nullptr;
  Barrier block_bar;
  Barrier warp_bar[kMaxThreads / 32];
  const void* main_stack_bottom = nullptr;  // the OS thread's stack, for ASan
  size_t main_stack_size = 0;
  int switched_from = -1;  // the fiber (-1: the scheduler) the last switch left
};
inline Scheduler sched;
inline uint64_t wbuf[2][kMaxThreads / 32][32];  // the lanes' words of a warp exchange: see warp_exchange
inline unsigned char next_wbuf[kMaxThreads];    // per thread: the wbuf of its warp's next exchange
inline int or_acc = 0;

inline ucontext_t* context_of(int t) { return t < 0 ? &sched.main_ctx : &sched.fibers[t]->ctx; }
// The first runnable fiber after `from` in thread-index order, wrapping around (from -1: from thread 0); -1 (the
// scheduler) when none can run. A fiber switches to the next one directly: one swapcontext per switch.
inline int next_runnable(int from) {
  for (int i = 1; i <= sched.nt; ++i) {
    const int t = (from + i) % sched.nt;
    if (sched.fibers[t]->state == State::kRunnable) return t;
  }
  return -1;
}
#ifdef EMU_ASAN
// Tells ASan a switch has landed; it names the stack left, which is the OS thread's when the switch came from the
// scheduler (the first switch of all does), needed to switch back there.
inline void finish_switch_for_asan(void* fake_stack) {
  const void* left_bottom = nullptr;
  size_t left_size = 0;
  __sanitizer_finish_switch_fiber(fake_stack, &left_bottom, &left_size);
  if (sched.switched_from < 0) {
    sched.main_stack_bottom = left_bottom;
    sched.main_stack_size = left_size;
  }
}
#endif
// Leaves the running fiber `from` (-1: the scheduler) for `to` (-1: the scheduler). Returns when `from` is
// resumed; never when `from` has returned (its stack is then left for good).
inline void switch_to(int from, int to) {
  const bool from_returned = from >= 0 && sched.fibers[from]->state == State::kDone;
  sched.current = to;
  if (to >= 0) threadIdx = EmuDim3{static_cast<unsigned>(to), 0, 0};
#ifdef EMU_ASAN
  void* fake_stack = nullptr;
  if (to < 0)
    __sanitizer_start_switch_fiber(from_returned ? nullptr : &fake_stack, sched.main_stack_bottom,
                                   sched.main_stack_size);
  else
    __sanitizer_start_switch_fiber(from_returned ? nullptr : &fake_stack, sched.stacks[to]->bottom(), kStackBytes);
#endif
  sched.switched_from = from;
  if (from_returned) {
    setcontext(context_of(to));
    die_errno("setcontext");
  }
  if (swapcontext(context_of(from), context_of(to)) != 0) die_errno("swapcontext");
#ifdef EMU_ASAN
  finish_switch_for_asan(fake_stack);
#endif
}
inline void fiber_main() {
#ifdef EMU_ASAN
  finish_switch_for_asan(nullptr);  // a new fiber: no fake stack of its own yet
#endif
  sched.call(sched.body);
  const int self = sched.current;
  sched.fibers[self]->state = State::kDone;
  ++sched.finished;
  switch_to(self, next_runnable(self));
}
inline void arrive_and_wait(Barrier& bar) {
  if (sched.current < 0) die("a barrier was called outside emu::run_block");
  if (++bar.arrived == bar.expected) {  // the last arrival releases the others and runs on
    for (int w : bar.waiters) sched.fibers[w]->state = State::kRunnable;
    bar.waiters.clear();
    bar.arrived = 0;
    return;
  }
  const int self = sched.current;
  bar.waiters.push_back(self);
  sched.fibers[self]->state = State::kWaiting;
  switch_to(self, next_runnable(self));
}
// Prints the threads of `who` (in increasing order) as ranges: "0-31 40 64-95".
inline void print_threads(std::vector<int> who) {
  std::sort(who.begin(), who.end());
  for (size_t i = 0; i < who.size();) {
    size_t j = i;
    while (j + 1 < who.size() && who[j + 1] == who[j] + 1) ++j;
    if (j == i)
      std::fprintf(stderr, " %d", who[i]);
    else
      std::fprintf(stderr, " %d-%d", who[i], who[j]);
    i = j + 1;
  }
}
[[noreturn]] inline void report_deadlock() {
  std::fprintf(stderr,
               "simt_emu: deadlock in block %u: no thread can run, %d of %d returned (a barrier that some threads "
               "never reach)\n",
               blockIdx.x, sched.finished, sched.nt);
  const auto report = [](const Barrier& bar) {
    if (bar.waiters.empty()) return;
    std::fprintf(stderr, "  %d of %d threads wait at %s %d:", bar.arrived, bar.expected, bar.name, bar.index);
    print_threads(bar.waiters);
    std::fprintf(stderr, "\n");
  };
  report(sched.block_bar);
  for (int w = 0; w < sched.nt / 32; ++w) report(sched.warp_bar[w]);
  std::vector<int> done;
  for (int t = 0; t < sched.nt; ++t)
    if (sched.fibers[t]->state == State::kDone) done.push_back(t);
  if (!done.empty()) {
    std::fprintf(stderr, "  returned:");
    print_threads(done);
    std::fprintf(stderr, "\n");
  }
  die("deadlock");
}
inline void run_block_erased(unsigned b, int nt, void (*call)(void*), void* body) {
  if (nt <= 0 || nt % 32 != 0 || nt > kMaxThreads) die("run_block: nt must be a multiple of 32 in [32, 1024]");
  if (sched.current >= 0) die("run_block called from inside a block");
  blockIdx = EmuDim3{b, 0, 0};
  sched.nt = nt;
  sched.finished = 0;
  sched.call = call;
  sched.body = body;
  sched.block_bar.reset("the block barrier (__syncthreads) of block", static_cast<int>(b), nt);
  std::memset(next_wbuf, 0, sizeof next_wbuf);
  for (int w = 0; w < nt / 32; ++w) sched.warp_bar[w].reset("the barrier (shuffle, ballot, __syncwarp) of warp", w, 32);
  while (static_cast<int>(sched.stacks.size()) < nt) sched.stacks.push_back(std::make_unique<Stack>());
  while (static_cast<int>(sched.fibers.size()) < nt) sched.fibers.push_back(std::make_unique<Fiber>());
  for (int t = 0; t < nt; ++t) {
    Fiber& f = *sched.fibers[t];
    if (getcontext(&f.ctx) != 0) die_errno("getcontext");
    f.ctx.uc_stack.ss_sp = sched.stacks[t]->bottom();
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;  // fiber_main never returns: it switches away itself
    makecontext(&f.ctx, fiber_main, 0);
#ifdef EMU_ASAN
    // ASan's swapcontext clears the shadow of the whole stack a context names at every switch into it: that took
    // most of the run's time and forgot the redzones of the fiber's live frames (an overflow of a local array
    // went unreported). So the stack is cleared once per block here (it is reused) and the context names none
    // (only makecontext reads uc_stack).
    __asan_unpoison_memory_region(sched.stacks[t]->bottom(), kStackBytes);
    f.ctx.uc_stack.ss_size = 0;
#endif
    f.state = State::kRunnable;
  }
  while (sched.finished < nt) {  // the fibers run until none can; then they come back here
    const int t = next_runnable(-1);
    if (t < 0) report_deadlock();
    switch_to(-1, t);
  }
}
template <class F>
void run_block(unsigned b, int nt, F body) {
  run_block_erased(b, nt, [](void* f) { (*static_cast<F*>(f))(); }, &body);
}
inline void warp_sync() { arrive_and_wait(sched.warp_bar[threadIdx.x >> 5]); }
// Lane threadIdx.x % 32 offers `word`; returns its warp's 32 words once every lane has offered one (shuffles,
// ballots). Each warp uses the two buffers alternately, so one barrier suffices: a lane that has read this
// exchange's buffer may fill the other while the rest still read this one, and cannot fill this one again
// before every lane has arrived at the next exchange, that is, has finished reading it.
inline const uint64_t* warp_exchange(uint64_t word) {
  const unsigned t = threadIdx.x;
  uint64_t* buf = wbuf[next_wbuf[t]][t >> 5];
  next_wbuf[t] ^= 1;
  buf[t & 31] = word;
  warp_sync();
  return buf;
}
}  // namespace emu
inline void __syncthreads() { emu::arrive_and_wait(emu::sched.block_bar); }
inline int __syncthreads_or(int p) {
  __syncthreads();
  if (p) emu::or_acc = 1;
  __syncthreads();
  const int r = emu::or_acc;
  __syncthreads();
  if (threadIdx.x == 0) emu::or_acc = 0;
  __syncthreads();
  return r;
}
template <class T>
T emu_exchange(T v, int src, bool valid) {
  static_assert(sizeof(T) <= 8);
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  const uint64_t* lanes = emu::warp_exchange(bits);
  T out = v;
  if (valid) std::memcpy(&out, &lanes[src], sizeof(T));
  return out;
}
template <class T>
T __shfl_down_sync(unsigned, T v, unsigned d) {
  int l = threadIdx.x & 31;
  return emu_exchange(v, l + d, l + (int)d < 32);
}
template <class T>
T __shfl_up_sync(unsigned, T v, unsigned d) {
  int l = threadIdx.x & 31;
  return emu_exchange(v, l - (int)d, l >= (int)d);
}
template <class T>
T __shfl_sync(unsigned, T v, int src) {
  return emu_exchange(v, src & 31, true);  // CUDA reads lane src modulo the width
}
inline unsigned __ballot_sync(unsigned, int p) {
  const uint64_t* lanes = emu::warp_exchange(p ? 1 : 0);
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= (lanes[i] ? 1u : 0u) << i;
  return r;
}
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline unsigned atomicAdd(unsigned* a, unsigned v) { return std::atomic_ref<unsigned>(*a).fetch_add(v); }
inline double atomicAdd(double* a, double v) { return std::atomic_ref<double>(*a).fetch_add(v); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
