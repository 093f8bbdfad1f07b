"""Running a tenant's python grader: ``grade(sample, item)`` in a child process that can
read the Python installation and write its own folder, and nothing else.

The child is ``python -I -S`` (no environment variables of Python's, no site-packages:
the standard library only) with an empty environment (no credentials), in a temporary
folder of its own. Before it reads the tenant's code it:

- sets resource limits: CPU seconds, address space, no new processes (a fork bomb gets
  ``BlockingIOError``), open files, the size of any file it writes, no core dumps;
- enters a new user and network namespace where the kernel allows unprivileged ones (no
  network at all: its only interface, loopback, is down);
- restricts itself with Landlock (Linux 5.13+, unprivileged): read and execute only
  beneath the Python installation and the system's libraries, read and write beneath its
  folder, no TCP connect or bind (Landlock 4+), no signals to or abstract sockets of
  processes outside it (Landlock 6+);
- installs a seccomp filter (after ``PR_SET_NO_NEW_PRIVS``) under which it cannot start a
  process or a program: ``fork``, ``vfork``, ``execve``, ``execveat`` and ``clone``
  without ``CLONE_THREAD`` fail (RLIMIT_NPROC alone does not bind root).

The parent kills the child's whole process group past the wall-clock limit and reads at
most ``MAX_OUTPUT`` bytes of its output. Where Landlock is absent the sandbox cannot keep
the child from the filesystem, and python graders are refused (``available``).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

MAX_OUTPUT = 64 * 1024
_SYS_CREATE_RULESET = 444  # the same number on x86-64 and arm64


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    open_files: int = 64


class SandboxError(Exception):
    """The grade did not come back: ``kind`` is OpenAI's python_grader_server_error_type
    (``timeout``, ``memory``, ``crashed``, ``output``), the message says why."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class GradeError(Exception):
    """The tenant's code raised, or returned something that is not a number."""


def landlock_abi() -> int:
    """Landlock's ABI version here (0: none)."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    version = int(libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))
    return max(version, 0)


def available() -> str | None:
    """Why python graders cannot run on this machine (None: they can)."""
    if landlock_abi() < 1:
        return (
            "this machine's kernel has no Landlock (Linux 5.13+ with it enabled), without "
            "which a grader's code could read and write the whole filesystem"
        )
    return None


# The child, before the tenant's code: limits, namespaces, Landlock; then the grade.
_BOOT = r"""
import ctypes, json, os, resource, sys
job = json.loads(sys.stdin.buffer.read())
out = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1); os.dup2(null, 2)
lim = job["limits"]
for what, value in ((resource.RLIMIT_CPU, lim["cpu_s"]), (resource.RLIMIT_AS, lim["memory"]),
                    (resource.RLIMIT_FSIZE, lim["file"]), (resource.RLIMIT_NOFILE, lim["files"]),
                    (resource.RLIMIT_NPROC, 0), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(what, (value, value))
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.getuid(), os.getgid()
if libc.unshare(0x10000000 | 0x40000000) == 0:  # CLONE_NEWUSER | CLONE_NEWNET
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
# the filesystem rights this ABI handles: 13 (ABI 1), REFER (2), TRUNCATE (3), IOCTL_DEV (5)
fs = (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1
net = 3 if abi >= 4 else 0  # TCP bind and connect
scoped = 3 if abi >= 6 else 0
class Ruleset(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]
class Beneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]
attr = Ruleset(fs, net, scoped)
size = 24 if abi >= 6 else 16 if abi >= 4 else 8
rules = libc.syscall(444, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
if rules < 0:
    out.write(json.dumps({"sandbox": "landlock refused its ruleset"})); sys.exit(0)
READ = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read files, read folders
FILE = (1 << 0) | (1 << 1) | (1 << 2)  # the rights a file (not a folder) can be given
grants = [(p, READ) for p in job["read"]] + [(os.devnull, READ | (1 << 1)), (job["home"], fs)]
for path, allowed in grants:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        continue
    beneath = Beneath(allowed if os.path.isdir(path) else allowed & FILE, fd)
    if libc.syscall(445, rules, 1, ctypes.byref(beneath), 0) != 0:
        out.write(json.dumps({"sandbox": f"landlock refused a rule for {path}"})); sys.exit(0)
    os.close(fd)
libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
if libc.syscall(446, rules, 0) != 0:
    out.write(json.dumps({"sandbox": "landlock refused to restrict"})); sys.exit(0)
os.close(rules)
# seccomp: no new processes or programs, whatever the user (RLIMIT_NPROC spares root):
# fork, vfork, execve, execveat and clone without CLONE_THREAD fail with EPERM; clone3,
# whose flags a filter cannot read, with ENOSYS (so that threads fall back to clone)
ARCHES = {"x86_64": (0xC000003E, 56, (57, 58, 59, 322)), "aarch64": (0xC00000B7, 220, (221, 281))}
if os.uname().machine in ARCHES:
    arch, clone, denied = ARCHES[os.uname().machine]
    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                    ("k", ctypes.c_uint32)]
    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Filter))]
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    code = [(LD, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, ALLOW), (LD, 0, 0, 0),
            (JGE, 0, 1, 0x40000000), (RET, 0, 0, EPERM), (JEQ, 0, 1, 435), (RET, 0, 0, ENOSYS)]
    for nr in denied:
        code += [(JEQ, 0, 1, nr), (RET, 0, 0, EPERM)]
    code += [(JEQ, 0, 3, clone), (LD, 0, 0, 16), (JSET, 1, 0, 0x00010000), (RET, 0, 0, EPERM),
             (RET, 0, 0, ALLOW)]
    table = (Filter * len(code))(*(Filter(*c) for c in code))
    program = Program(len(code), table)
    if libc.prctl(22, 2, ctypes.byref(program), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER
        out.write(json.dumps({"sandbox": "seccomp refused its filter"})); sys.exit(0)
try:
    scope = {"__name__": "grader"}
    exec(compile(job["source"], "<grader>", "exec"), scope)
    reward = scope["grade"](job["sample"], job["item"])
    result = {"reward": float(reward)}
except MemoryError:
    result = {"error": "MemoryError: the grader went over its memory limit"}
except BaseException as exc:
    result = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
out.write(json.dumps(result))
out.flush()
"""


def _read_paths() -> list[str]:
    """What the child may read: the Python it runs and the system's libraries."""
    paths = {sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable))}
    paths |= {"/usr/lib", "/usr/lib64", "/lib", "/lib64", "/etc/ld.so.cache", "/dev/urandom"}
    return sorted(paths)


def run_python(source: str, sample: dict[str, Any], item: Any, limits: Limits) -> float:
    """``grade(sample, item)`` of ``source``, sandboxed (see the module's docstring)."""
    with tempfile.TemporaryDirectory(prefix="grader-") as home:
        job = {
            "source": source, "sample": sample, "item": item, "home": home,
            "read": _read_paths(),
            "limits": {"cpu_s": limits.cpu_s, "memory": limits.memory_bytes,
                       "file": limits.file_bytes, "files": limits.open_files},
        }  # fmt: skip
        child = subprocess.Popen(
            [os.path.realpath(sys.executable), "-I", "-S", "-c", _BOOT],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            cwd=home, env={}, start_new_session=True, close_fds=True,
        )  # fmt: skip
        try:
            output, _ = child.communicate(json.dumps(job).encode(), timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise SandboxError(
                "timeout", f"the grader ran past its {limits.wall_s:g} s wall-clock limit"
            ) from None
        except BaseException:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise
    if child.returncode in (-signal.SIGXCPU, -signal.SIGKILL) and not output:
        raise SandboxError("timeout", f"the grader ran past its {limits.cpu_s} s of CPU time")
    if len(output) > MAX_OUTPUT:
        raise SandboxError("output", f"the grader's answer is over {MAX_OUTPUT} bytes")
    try:
        result = json.loads(output)
    except ValueError:
        raise SandboxError(
            "crashed", f"the grader's process ended (exit {child.returncode}) without a grade"
        ) from None
    if "sandbox" in result:
        raise SandboxError("crashed", f"the sandbox could not be set up: {result['sandbox']}")
    if "error" in result:
        raise GradeError(str(result["error"]))
    return float(result["reward"])
