// Whether this CPU and OS run the AMX kernels (amx_gemm.cpp, amx_moe.cpp), and the one-time
// request for the tile data state. Compiled with the library's common flags (not the AMX ones),
// so calling it is safe on any CPU the library loads on.
//
// Needed, per the Intel SDM vol. 1 ch. 13 and 18 and Linux Documentation/arch/x86/xstate.rst:
// CPUID.(7,0).EDX AMX-TILE (bit 24) and AMX-BF16 (bit 22); XCR0 enabling the tile
// configuration and tile data state (bits 17, 18); and, on Linux, arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
// granting this process the tile data state (bit 18), after which every thread of the process
// may use it. Without the grant the first tile instruction raises SIGILL.

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <mutex>

#include "moe_engine_cpu.h"

namespace {

constexpr long kArchGetXcompPerm = 0x1022;  // ARCH_GET_XCOMP_PERM
constexpr long kArchReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
constexpr long kXfeatureXtiledata = 18;

int32_t detect() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 1;
  const bool amx = (d >> 24 & 1) && (d >> 22 & 1);
  if (!amx) return 1;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) return 3;  // OSXSAVE
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if (!(lo >> 17 & 1) || !(lo >> 18 & 1)) return 3;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return 4;
  unsigned long perm = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &perm) != 0 || !(perm >> 18 & 1)) return 4;
  return 0;
}

}  // namespace

int32_t moe_amx_available(void) {
  static std::once_flag once;
  static int32_t status = 1;
  std::call_once(once, [] { status = detect(); });
  return status;
}
