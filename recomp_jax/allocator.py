"""The host memory allocator of a run: jemalloc when the machine has it.

Why: every jitted call on the XLA CPU backend allocates its temporaries afresh, and glibc
``malloc`` hands large blocks back to the kernel when they are freed, so the next call faults
them in again page by page: a training step then spends much of its CPU time in the kernel.
``benchmarks/train.py`` measures it; docs/performance.md ("The allocator") has the numbers.

:func:`relaunch_with_allocator` (called first thing by ``python -m recomp_jax.main`` and by the
benchmarks) re-executes the process once with ``LD_PRELOAD`` set to jemalloc (Debian/Ubuntu:
``apt install libjemalloc2``), or tcmalloc if only that is installed, and with jemalloc told to
keep the pages it frees (its default returns blocks of 8 MiB and more to the kernel at once,
which is exactly the cost to avoid). With neither library, glibc is told to back its heap with
transparent huge pages (``glibc.malloc.hugetlb=1``, glibc >= 2.35), which cuts the page faults
and recovers part of the time.

``RECOMP_JAX_ALLOCATOR`` chooses: ``auto`` (default, as above), ``system`` (leave the process
alone), or the path of an allocator library to preload.

Keeping freed pages has a price when the working set changes shape: pages kept for one set of
buffer sizes are not all reused by the next, so a run that alternates Gemma training steps, dev
loss and generation piles them up. :func:`release_free_memory` hands kept pages back where the
working set changes (the stage runner after every stage, the training loop after every
evaluation), and ``python -m recomp_jax.main`` picks the setting by ``config.system``
(:func:`jemalloc_conf_for`): keep pages for the extractive system's encoder training (one shape
of step), a one-second decay for the systems that fine-tune Gemma (with jemalloc's separate
arena for large blocks turned off: that arena returns them at once under any decay, see
:data:`JEMALLOC_CONF_DECAY`). A ``MALLOC_CONF`` in the environment always wins.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
from typing import Mapping

ENV_CHOICE = 'RECOMP_JAX_ALLOCATOR'
ENV_DONE = 'RECOMP_JAX_ALLOCATOR_SET'  # set in the re-executed process: never relaunch twice

# Freed pages stay with the process (the fastest and lowest-peak setting on the encoder step).
JEMALLOC_CONF = 'dirty_decay_ms:-1,muzzy_decay_ms:-1'
# Freed pages go back after one second, for runs that fine-tune a decoder LM: training steps,
# dev loss and generation alternate, each model is a new set of buffer shapes, and kept pages
# pile up past a small machine's memory. 'oversize_threshold:0' matters as much as the decay:
# with any positive decay, jemalloc's dedicated arena for blocks of 8 MiB and more (XLA's
# temporaries) purges them at once, so every microbatch would fault its buffers in again.
JEMALLOC_CONF_DECAY = 'dirty_decay_ms:1000,muzzy_decay_ms:1000,oversize_threshold:0'
# The jemalloc setting of each system (config.system): the extractive system trains an encoder
# (MiniLM / Contriever: one shape of step, where keeping pages pays most); the others fine-tune
# Gemma. A system not listed gets the decay, the safe side on a small machine.
JEMALLOC_CONF_BY_SYSTEM = {'extractive': JEMALLOC_CONF}
GLIBC_HUGEPAGES = 'glibc.malloc.hugetlb=1'

_LIBRARY_NAMES = ('libjemalloc.so.2', 'libjemalloc.so', 'libtcmalloc_minimal.so.4',
                  'libtcmalloc.so.4')
_LIBRARY_DIRS = ('/usr/lib/x86_64-linux-gnu', '/usr/lib/aarch64-linux-gnu', '/usr/lib64',
                 '/usr/lib', '/usr/local/lib', '/lib/x86_64-linux-gnu', '/lib64')


def find_allocator() -> str | None:
  """Path of the first jemalloc (preferred) or tcmalloc library found, or None.

  Looks in ``$CONDA_PREFIX/lib`` and the usual system library directories.
  """
  conda = os.environ.get('CONDA_PREFIX')
  dirs = ((os.path.join(conda, 'lib'),) if conda else ()) + _LIBRARY_DIRS
  for name in _LIBRARY_NAMES:
    for directory in dirs:
      path = os.path.join(directory, name)
      if os.path.isfile(path):
        return path
  return None


def loaded_allocator(maps_path: str = '/proc/self/maps') -> str:
  """``'jemalloc'``, ``'tcmalloc'`` or ``'glibc'``: the allocator this process runs with."""
  try:
    with open(maps_path, encoding='utf-8', errors='replace') as f:
      maps = f.read()
  except OSError:
    return 'unknown'
  for name in ('jemalloc', 'tcmalloc'):
    if f'lib{name}' in maps:
      return name
  return 'glibc'


def _glibc_has_hugetlb_tunable() -> bool:
  try:
    version = os.confstr('CS_GNU_LIBC_VERSION') or ''  # 'glibc 2.36'
    major, minor = (int(x) for x in version.split()[1].split('.')[:2])
  except (ValueError, IndexError, OSError):
    return False
  return (major, minor) >= (2, 35)


def jemalloc_conf_for(system: str | None) -> str:
  """The ``MALLOC_CONF`` a run of ``system`` gets (:data:`JEMALLOC_CONF_BY_SYSTEM`); None: keep pages."""
  if system is None:
    return JEMALLOC_CONF
  return JEMALLOC_CONF_BY_SYSTEM.get(system, JEMALLOC_CONF_DECAY)


def allocator_environment(env: Mapping[str, str], *, library: str | None,
                          glibc_hugetlb: bool,
                          jemalloc_conf: str = JEMALLOC_CONF) -> dict[str, str] | None:
  """The environment to re-execute with, or None to leave the process as it is.

  Args:
    env: the current environment.
    library: the allocator library :func:`find_allocator` found (or None).
    glibc_hugetlb: whether glibc understands ``glibc.malloc.hugetlb``.
    jemalloc_conf: the ``MALLOC_CONF`` given to jemalloc unless ``env`` sets one.
  """
  if env.get(ENV_DONE) or not sys.platform.startswith('linux'):
    return None
  choice = env.get(ENV_CHOICE, 'auto').strip() or 'auto'
  if choice == 'system':
    return None
  if choice != 'auto':
    if not os.path.isfile(choice):
      raise FileNotFoundError(f'{ENV_CHOICE}={choice}: no such allocator library (use auto, '
                              f'system or the path of a .so file)')
    library = choice
  preload = env.get('LD_PRELOAD', '')
  if any(name in preload for name in ('jemalloc', 'tcmalloc')):
    return None  # the user chose an allocator already
  new = dict(env)
  new[ENV_DONE] = '1'
  if library:
    new['LD_PRELOAD'] = f'{library}:{preload}' if preload else library
    if 'jemalloc' in os.path.basename(library) and 'MALLOC_CONF' not in env:
      new['MALLOC_CONF'] = jemalloc_conf
    return new
  if glibc_hugetlb and 'GLIBC_TUNABLES' not in env:
    new['GLIBC_TUNABLES'] = GLIBC_HUGEPAGES
    return new
  return None


def relaunch_with_allocator(jemalloc_conf: str = JEMALLOC_CONF) -> None:
  """Re-executes this process (same interpreter and argv) with the allocator of
  :func:`allocator_environment`; returns without doing anything when none applies."""
  new_env = allocator_environment(os.environ, library=find_allocator(),
                                  glibc_hugetlb=_glibc_has_hugetlb_tunable(),
                                  jemalloc_conf=jemalloc_conf)
  if new_env is None:
    return
  argv = list(getattr(sys, 'orig_argv', None) or [sys.executable, *sys.argv])
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *argv[1:]], new_env)


# jemalloc >= 5: ``arena.<MALLCTL_ARENAS_ALL>.purge`` purges the dirty and muzzy pages of every arena.
_JEMALLOC_PURGE_ALL = b'arena.4096.purge'


def resident_bytes(statm_path: str = '/proc/self/statm') -> int:
  """This process's resident set size in bytes (0 where ``/proc`` is missing)."""
  try:
    with open(statm_path) as f:
      return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
  except (OSError, ValueError, IndexError):
    return 0


def peak_resident_bytes(status_path: str = '/proc/self/status') -> int:
  """The largest resident set size (``VmHWM``) this process had since it started or since
  :func:`reset_peak_resident`, in bytes (0 where ``/proc`` is missing)."""
  try:
    with open(status_path) as f:
      for line in f:
        if line.startswith('VmHWM:'):
          return int(line.split()[1]) * 1024  # kB
  except (OSError, ValueError, IndexError):
    pass
  return 0


def reset_peak_resident(clear_refs_path: str = '/proc/self/clear_refs') -> bool:
  """Restarts :func:`peak_resident_bytes` from the current resident set, so a stage or an
  evaluation can report its own peak (Linux >= 4.0: ``5`` written to ``clear_refs``).
  Returns False where the kernel does not allow it (the peak then stays the process's)."""
  try:
    with open(clear_refs_path, 'w') as f:
      f.write('5')
    return True
  except OSError:
    return False


def memory_map_count(maps_path: str = '/proc/self/maps') -> int:
  """How many memory mappings this process has (0 where ``/proc`` is missing)."""
  try:
    with open(maps_path) as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


def memory_map_limit(limit_path: str = '/proc/sys/vm/max_map_count') -> int:
  """The kernel's cap on a process's memory mappings (``vm.max_map_count``; 0 if unknown)."""
  try:
    with open(limit_path) as f:
      return int(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return 0


def drop_compiled_near_map_limit(fraction: float = 0.5) -> dict:
  """Clears JAX's compiled executables when the process holds over ``fraction`` of the
  kernel's memory-mapping cap.

  Why: the XLA CPU backend JIT-compiles every executable into memory mappings of its own
  (about 3.3 per executable, measured on jax 0.10), and a process may hold at most
  ``vm.max_map_count`` mappings (65530 by default). Past it LLVM cannot map the next
  executable ("LLVM compilation error: Cannot allocate memory") and the process dies with
  SIGSEGV inside ``backend_compile``, whatever memory is free. A process that compiles
  ~20,000 functions and keeps them (the test suite; a pipeline of many stages and shapes)
  gets there. :func:`jax.clear_caches` frees them; the functions used next recompile.

  Returns:
    ``{'maps', 'limit', 'cleared', 'maps_after'}``.
  """
  maps, limit = memory_map_count(), memory_map_limit()
  cleared = bool(limit) and maps > fraction * limit
  if cleared:
    import jax  # pylint: disable=import-outside-toplevel
    jax.clear_caches()
    gc.collect()
  return {'maps': maps, 'limit': limit, 'cleared': cleared,
          'maps_after': memory_map_count() if cleared else maps}


# Below this growth of the resident set a task's freed pages are not worth a full garbage
# collection and trim (~0.5 s in a process holding a pipeline's models and tokenizers).
RELEASE_MIN_GROWTH = 256 << 20


def release_if_grown(since: int) -> dict | None:
  """:func:`release_free_memory` when the resident set grew by ``RELEASE_MIN_GROWTH`` bytes or
  more since ``since`` (a :func:`resident_bytes` reading taken before the task); else ``None``."""
  if resident_bytes() - since < RELEASE_MIN_GROWTH:
    return None
  return release_free_memory()


def release_free_memory() -> dict:
  """Returns the pages the allocator keeps for reuse to the operating system.

  Collects Python garbage first (so the buffers of dead arrays are freed), then asks
  jemalloc to purge every arena (``mallctl("arena.4096.purge")``) or glibc to trim its
  heaps (``malloc_trim(0)``); tcmalloc and other allocators are left alone.

  Returns:
    ``{'allocator', 'released', 'rss_before', 'rss_after'}`` (bytes; ``released`` is
    False when the allocator had no call for it or the call failed).
  """
  gc.collect()
  name = loaded_allocator()
  before = resident_bytes()
  released = False
  try:
    process = ctypes.CDLL(None)
    if name == 'jemalloc':
      released = process.mallctl(_JEMALLOC_PURGE_ALL, None, None, None, ctypes.c_size_t(0)) == 0
    elif name == 'glibc':
      process.malloc_trim(ctypes.c_size_t(0))
      released = True
  except (OSError, AttributeError):
    released = False
  return {'allocator': name, 'released': released, 'rss_before': before,
          'rss_after': resident_bytes()}


def describe() -> str:
  """One line for logs and benchmark headers, e.g. ``allocator jemalloc (MALLOC_CONF=...)``."""
  name = loaded_allocator()
  if name == 'jemalloc':
    return f"allocator jemalloc (MALLOC_CONF={os.environ.get('MALLOC_CONF', 'default')})"
  if name == 'glibc' and os.environ.get('GLIBC_TUNABLES'):
    return f"allocator glibc (GLIBC_TUNABLES={os.environ['GLIBC_TUNABLES']})"
  return f'allocator {name}'
