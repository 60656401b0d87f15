#include "fault_guard.h"

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace ple {

namespace {

// Where a guarded copy on this thread jumps back to; null outside one.
// volatile, and fenced below: the compiler may see that the copy never reads
// it and would otherwise drop the store before the copy.
thread_local sigjmp_buf* volatile active_guard = nullptr;

std::mutex install_mutex;
struct sigaction previous_handler;  // what SIGBUS did before ours

// A fork while another thread installs must not leave the child's lock held.
const int install_survives_fork = ::pthread_atfork([] { install_mutex.lock(); },
                                                   [] { install_mutex.unlock(); },
                                                   [] { install_mutex.unlock(); });

thread_local bool forwarding = false;

// The default action: for a fault, the access runs again on return and is
// fatal; a SIGBUS sent by kill is raised again.
void die_by_default(siginfo_t* info) {
  ::signal(SIGBUS, SIG_DFL);
  if (info == nullptr || info->si_code <= 0) ::raise(SIGBUS);
}

void forward(int signal, siginfo_t* info, void* context) {
  // A handler that hands the signal back to us (as Python's faulthandler
  // does) must not make a loop.
  if (forwarding) return die_by_default(info);
  forwarding = true;
  const struct sigaction& before = previous_handler;
  if (before.sa_flags & SA_SIGINFO) {
    if (before.sa_sigaction != nullptr) before.sa_sigaction(signal, info, context);
  } else if (before.sa_handler == SIG_DFL) {
    die_by_default(info);
  } else if (before.sa_handler != SIG_IGN) {
    before.sa_handler(signal);
  }
  forwarding = false;
}

void on_sigbus(int signal, siginfo_t* info, void* context) {
  if (active_guard != nullptr) siglongjmp(*active_guard, 1);
  forward(signal, info, context);
}

bool ours_installed() {
  struct sigaction current;
  ::sigaction(SIGBUS, nullptr, &current);
  return (current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigbus;
}

}  // namespace

void ensure_fault_handler() {
  // The common case needs no lock; installing does, so that previous_handler
  // is never our own handler.
  if (ours_installed()) return;
  std::lock_guard<std::mutex> lock(install_mutex);
  if (ours_installed()) return;
  struct sigaction ours;
  std::memset(&ours, 0, sizeof(ours));
  ours.sa_sigaction = on_sigbus;
  // SA_NODEFER: SIGBUS must not stay blocked after the jump out of the
  // handler (sigsetjmp does not save the signal mask: that would cost a
  // system call per row).
  ours.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
  sigemptyset(&ours.sa_mask);
  ::sigaction(SIGBUS, &ours, &previous_handler);
}

bool run_guarded(void (*copy)(void*), void* context) {
  sigjmp_buf guard;
  if (sigsetjmp(guard, 0) != 0) {
    active_guard = nullptr;
    return false;
  }
  active_guard = &guard;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  copy(context);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  active_guard = nullptr;
  return true;
}

bool guarded_copy(void* dst, const void* src, size_t bytes) {
  auto copy = [&] { std::memcpy(dst, src, bytes); };
  return run_guarded(copy);
}

}  // namespace ple
