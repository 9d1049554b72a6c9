// The OpenMP team of the calling thread, bound thread by thread.
//
// A CPU engine's step thread owns the CPUs its node reserved for it; on a small node the
// other CPUs carry the serving threads (Ray, the proxy, the ingress) and are partly idle.
// Helper threads there take a share of the big (prefill) steps: thread 0 (the caller) keeps
// its own CPUs, threads 1.. are bound to the shared CPUs and niced, so a serving thread that
// wakes up takes its CPU back at once and the helpers use only what is left. The linear
// kernels hand out their work in small dynamic units, so a preempted helper delays a step
// by about one unit, not by a static share.
//
// libgomp keeps a thread's pool position (and so its binding) across parallel regions of
// that thread, whatever their size: binding once is enough. Built and loaded by
// kernels/cpu/native.py.

#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <omp.h>

#include <cerrno>

// Thread t of a team of n binds to cpus[offsets[t] .. offsets[t + 1]); threads t >= 1 also
// raise their niceness to at least helper_nice (never lower it). Returns how many threads
// bound, or -1 when the runtime gave a team of another size.
extern "C" int pdserve_bind_omp_team(int n, const int* offsets, const int* cpus,
                                     int helper_nice) {
  int bound = 0, size = 0;
#pragma omp parallel num_threads(n) reduction(+ : bound)
  {
    const int t = omp_get_thread_num();
    if (t == 0) size = omp_get_num_threads();
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int i = offsets[t]; i < offsets[t + 1]; ++i) CPU_SET(cpus[i], &set);
    const bool ok = sched_setaffinity(0, sizeof set, &set) == 0;
    if (ok && t > 0 && helper_nice > 0) {
      const id_t tid = static_cast<id_t>(syscall(SYS_gettid));
      errno = 0;
      const int nice = getpriority(PRIO_PROCESS, tid);
      if (errno == 0 && nice < helper_nice) setpriority(PRIO_PROCESS, tid, helper_nice);
    }
    bound += ok ? 1 : 0;
  }
  return size == n ? bound : -1;
}
