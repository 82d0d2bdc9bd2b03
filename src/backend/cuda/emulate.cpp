// Fiber scheduler of the CUDA emulation (emulate.h). Compiled only into kestrel_cuda_emu.
//
// A fiber switch is a hand-written x86-64 stack switch (a few nanoseconds; ucontext's swapcontext
// makes a system call per switch, and an emulated mma exchanges among 32 lanes twice). On other
// processors the emulation is not available.
#if !defined(__x86_64__)
#error "the CUDA emulation's fiber switch is written for x86-64"
#endif

#include "backend/cuda/emulate.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"

// void kestrel_emu_switch(void** save_sp, void* load_sp): saves the callee-saved registers on the
// current stack, stores the stack pointer in *save_sp, loads load_sp and restores from there.
asm(R"(
  .pushsection .text
  .globl kestrel_emu_switch
  .type kestrel_emu_switch, @function
kestrel_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size kestrel_emu_switch, .-kestrel_emu_switch
  .popsection
)");
extern "C" void kestrel_emu_switch(void** save_sp, void* load_sp);

namespace kestrel::cuda::emu {
namespace {

constexpr size_t kStackBytes = 512 * 1024;
constexpr int kMaxThreads = 1024;
constexpr size_t kSlotBytes = 64;

enum class State { Runnable, AtBlockBarrier, AtWarpBarrier, Done };

struct PendingCopy {
  void* dst;
  unsigned char data[16];
  size_t size = 16;  // bytes landing at dst
};

struct Fiber {
  std::unique_ptr<unsigned char[]> stack;
  void* sp = nullptr;
  dim3 tid;
  int warp = 0;
  int lane = 0;
  unsigned exchanges = 0;  // warp exchanges so far: which of the two slot buffers is next
  State state = State::Done;
  std::vector<std::vector<PendingCopy>> groups;  // committed cp.async groups, oldest first
  std::vector<PendingCopy> open;                 // issued since the last commit
};

struct Launch {
  dim3 grid, block, block_id;
  int n_threads = 0;
  std::vector<unsigned char> smem;
  std::vector<Fiber> fibers;
  void* scheduler_sp = nullptr;
  int current = -1;
  std::exception_ptr error;
  std::function<void()> body;
  // Two buffers: a lane can write exchange k + 1's slot while a slower lane still reads exchange k's,
  // but not exchange k + 2's before every lane has reached k + 1 (and so finished reading k).
  unsigned char slots[kMaxThreads / 32][2][32][kSlotBytes];
  std::mt19937 rng{12345};
  std::vector<int> warp_order;  // warp priority for this block (release_barrier)
  // Kept up to date as fibers wait, finish and are released, so that a release costs O(warp)
  // rather than a scan of the block (warp collectives are the emulation's hot path).
  int n_done = 0;
  int n_at_block = 0;
  std::vector<int> warp_waiting;  // lanes of each warp waiting at a warp barrier
  std::vector<int> runnable;      // released, not yet run
};

// The launch in progress on this thread. Launches from several host threads (a pipeline's stage
// threads) run one at a time (launch_mutex): the kernels' shared arrays are static locals.
thread_local Launch* g_launch = nullptr;
std::mutex launch_mutex;

Fiber& self() { return g_launch->fibers[static_cast<size_t>(g_launch->current)]; }

void yield_to_scheduler() {
  Fiber& f = self();
  kestrel_emu_switch(&f.sp, g_launch->scheduler_sp);
}

[[noreturn]] void fiber_entry() {
  try {
    g_launch->body();
  } catch (...) {
    if (!g_launch->error) g_launch->error = std::current_exception();
  }
  Fiber& f = self();
  f.state = State::Done;
  ++g_launch->n_done;
  kestrel_emu_switch(&f.sp, g_launch->scheduler_sp);
  __builtin_trap();  // a finished fiber is never resumed
}

void init_fiber(Fiber& f) {
  if (!f.stack) f.stack = std::make_unique<unsigned char[]>(kStackBytes);
  uintptr_t top = reinterpret_cast<uintptr_t>(f.stack.get() + kStackBytes) & ~uintptr_t{15};
  auto* p = reinterpret_cast<void**>(top);
  *--p = nullptr;                                       // fiber_entry's (never used) return address
  *--p = reinterpret_cast<void*>(&fiber_entry);         // where the first switch's `ret` goes
  for (int i = 0; i < 6; ++i) *--p = nullptr;           // rbp rbx r12 r13 r14 r15
  f.sp = p;
  f.state = State::Runnable;
  f.exchanges = 0;
  f.groups.clear();
  f.open.clear();
}

void land(const PendingCopy& c) { std::memcpy(c.dst, c.data, c.size); }

// Releases the block barrier when every live thread waits at it; else one warp barrier whose lanes
// all wait. Which warp goes next is random, mostly in an order drawn per block, so that one warp
// can run far ahead of the others (up to the next block barrier) and a missing __syncthreads
// between a warp's reads of shared memory and another warp's writes shows up.
// False when the waiting threads wait on different barriers (a deadlock).
bool release_barrier(Launch& L) {
  const int live = L.n_threads - L.n_done;
  if (live > 0 && L.n_at_block == live) {
    for (int i = 0; i < L.n_threads; ++i) {
      Fiber& f = L.fibers[static_cast<size_t>(i)];
      if (f.state == State::AtBlockBarrier) {
        f.state = State::Runnable;
        L.runnable.push_back(i);
      }
    }
    L.n_at_block = 0;
    return true;
  }
  std::vector<int> ready;
  for (int w : L.warp_order) {
    const int lanes = std::min(L.n_threads, w * 32 + 32) - w * 32;
    const int waiting = L.warp_waiting[static_cast<size_t>(w)];
    if (waiting > 0 && waiting == lanes) ready.push_back(w);
  }
  if (ready.empty()) return false;
  const int w = (L.rng() % 4 != 0) ? ready.front() : ready[L.rng() % ready.size()];
  for (int i = w * 32; i < std::min(L.n_threads, w * 32 + 32); ++i) {
    L.fibers[static_cast<size_t>(i)].state = State::Runnable;
    L.runnable.push_back(i);
  }
  L.warp_waiting[static_cast<size_t>(w)] = 0;
  return true;
}

void run_block(Launch& L) {
  std::fill(L.smem.begin(), L.smem.end(), static_cast<unsigned char>(0xFF));
  for (int i = 0; i < L.n_threads; ++i) {
    Fiber& f = L.fibers[static_cast<size_t>(i)];
    f.tid = dim3(static_cast<unsigned>(i) % L.block.x, static_cast<unsigned>(i) / L.block.x % L.block.y,
                 static_cast<unsigned>(i) / (L.block.x * L.block.y));
    f.warp = i / 32;
    f.lane = i % 32;
    init_fiber(f);
  }
  L.warp_order.resize(static_cast<size_t>((L.n_threads + 31) / 32));
  std::iota(L.warp_order.begin(), L.warp_order.end(), 0);
  std::shuffle(L.warp_order.begin(), L.warp_order.end(), L.rng);
  L.n_done = 0;
  L.n_at_block = 0;
  L.warp_waiting.assign(L.warp_order.size(), 0);
  L.runnable.resize(static_cast<size_t>(L.n_threads));
  std::iota(L.runnable.begin(), L.runnable.end(), 0);
  std::vector<int> order;
  for (;;) {
    order.swap(L.runnable);
    L.runnable.clear();
    if (order.empty()) {
      if (L.n_done == L.n_threads) break;
      if (!release_barrier(L))
        throw Error("CUDA emulation: deadlock (threads of block " + std::to_string(L.block_id.x) + "," +
                    std::to_string(L.block_id.y) + "," + std::to_string(L.block_id.z) +
                    " wait at different barriers, or a warp collective has returned lanes)");
      continue;
    }
    std::shuffle(order.begin(), order.end(), L.rng);
    for (int i : order) {
      L.current = i;
      kestrel_emu_switch(&L.scheduler_sp, L.fibers[static_cast<size_t>(i)].sp);
      L.current = -1;
      if (L.error) std::rethrow_exception(L.error);
    }
  }
  for (int i = 0; i < L.n_threads; ++i)
    if (!L.fibers[static_cast<size_t>(i)].open.empty() || !L.fibers[static_cast<size_t>(i)].groups.empty())
      throw Error("CUDA emulation: a thread returned with cp.async copies not waited for");
}

void wait_at(State s) {
  Fiber& f = self();
  f.state = s;
  if (s == State::AtBlockBarrier) ++g_launch->n_at_block;
  if (s == State::AtWarpBarrier) ++g_launch->warp_waiting[static_cast<size_t>(f.warp)];
  yield_to_scheduler();
}

}  // namespace

const dim3& thread_idx() { return self().tid; }
const dim3& block_idx() { return g_launch->block_id; }
const dim3& block_dim() { return g_launch->block; }
const dim3& grid_dim() { return g_launch->grid; }
int lane_id() { return self().lane; }
unsigned char* dynamic_smem() { return g_launch->smem.data(); }

void sync_block() { wait_at(State::AtBlockBarrier); }

void sync_warp() {
  const Fiber& f = self();
  const int first = f.warp * 32;
  for (int i = first; i < std::min(g_launch->n_threads, first + 32); ++i)
    if (g_launch->fibers[static_cast<size_t>(i)].state == State::Done)
      throw Error("CUDA emulation: warp collective with a returned lane");
  wait_at(State::AtWarpBarrier);
}

void warp_exchange(const void* mine, size_t bytes, void* all) {
  if (bytes > kSlotBytes) throw Error("CUDA emulation: warp exchange of more than 64 bytes");
  if (g_launch->n_threads % 32 != 0) throw Error("CUDA emulation: warp collective in a partial warp");
  Fiber& f = self();
  const unsigned buffer = f.exchanges++ & 1u;
  std::memcpy(g_launch->slots[f.warp][buffer][f.lane], mine, bytes);
  sync_warp();  // every lane has written its slot
  auto* out = static_cast<unsigned char*>(all);
  for (int l = 0; l < 32; ++l)
    std::memcpy(out + static_cast<size_t>(l) * bytes, g_launch->slots[f.warp][buffer][l], bytes);
}

void async_copy16(void* dst, const void* src, int src_bytes) { async_copy(dst, src, 16, src_bytes); }

void async_copy(void* dst, const void* src, int size, int src_bytes) {
  if ((size != 4 && size != 8 && size != 16) || src_bytes < 0 || src_bytes > size)
    throw Error("CUDA emulation: cp.async of " + std::to_string(size) + " bytes, " + std::to_string(src_bytes) +
                " from the source");
  if (reinterpret_cast<uintptr_t>(dst) % static_cast<uintptr_t>(size) != 0 ||
      (src_bytes > 0 && reinterpret_cast<uintptr_t>(src) % static_cast<uintptr_t>(size) != 0))
    throw Error("CUDA emulation: cp.async of " + std::to_string(size) + " bytes at a misaligned address");
  PendingCopy c{dst, {}, static_cast<size_t>(size)};
  if (src_bytes > 0) std::memcpy(c.data, src, static_cast<size_t>(src_bytes));
  // Lands now or at its wait, at random: either order is legal, and each catches a different bug.
  if (g_launch->rng() & 1) {
    land(c);
  } else {
    self().open.push_back(c);
  }
}

void async_commit() {
  Fiber& f = self();
  f.groups.push_back(std::move(f.open));
  f.open.clear();
}

void async_wait(int n_pending) {
  Fiber& f = self();
  while (static_cast<int>(f.groups.size()) > n_pending) {
    for (const PendingCopy& c : f.groups.front()) land(c);
    f.groups.erase(f.groups.begin());
  }
}

void launch(dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& body) {
  const int n_threads = static_cast<int>(block.x * block.y * block.z);
  if (n_threads < 1 || n_threads > kMaxThreads) throw Error("CUDA emulation: bad block size");
  if (g_launch) throw Error("CUDA emulation: nested launch");
  const std::lock_guard<std::mutex> lock(launch_mutex);
  static std::vector<Fiber> fiber_pool;  // stacks are reused across launches
  auto L = std::make_unique<Launch>();
  L->grid = grid;
  L->block = block;
  L->n_threads = n_threads;
  L->smem.resize(smem_bytes);
  L->body = body;
  L->rng.seed(static_cast<unsigned>(std::random_device{}()));
  if (fiber_pool.size() < static_cast<size_t>(n_threads)) fiber_pool.resize(static_cast<size_t>(n_threads));
  // The pool keeps its extra fibers (threads n_threads and up sit idle): shrinking it would free
  // their 512 KB stacks, and a later, larger block would allocate and zero them again.
  L->fibers.swap(fiber_pool);
  g_launch = L.get();
  try {
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
          L->block_id = dim3(x, y, z);
          run_block(*L);
        }
  } catch (...) {
    g_launch = nullptr;
    fiber_pool.swap(L->fibers);
    throw;
  }
  g_launch = nullptr;
  fiber_pool.swap(L->fibers);
}

}  // namespace kestrel::cuda::emu

namespace kestrel::cuda {

// The emulation library has no CUDA runtime to ask for error names (cuda_check.cpp is the real one).
void cuda_fail(cudaError_t err, const char* expr, const char* file, int line) {
  throw Error("CUDA error " + std::to_string(static_cast<int>(err)) + " from " + expr + " at " + file + ":" +
              std::to_string(line));
}

// Programmatic dependent launch does not exist here (launches run to completion in order); the
// setting is kept so the runner's flag reads back.
namespace {
bool g_pdl = true;
}
bool pdl_enabled() { return g_pdl; }
void set_pdl_enabled(bool on) { g_pdl = on; }

}  // namespace kestrel::cuda
