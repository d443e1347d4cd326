"""The sandbox's seccomp policy, written once: podman/docker get it as a JSON profile (``--security-opt
seccomp=FILE``), bwrap as the BPF program libseccomp compiles from the same rules (``--seccomp FD``).

Every other system call is allowed; these fail with ``EPERM`` (``clone3`` with ``ENOSYS``, so libc falls back to
``clone``, whose flags a filter can read):

- kernel keyrings (``keyctl``, ``add_key``, ``request_key``): the only ``keyctl`` left is joining a new,
  empty anonymous session keyring, which the runner does first, so no execution sees the host's keys or
  another execution's;
- ``io_uring`` (its operations bypass per-syscall filtering);
- new namespaces (``unshare``, ``setns``; ``clone`` with a namespace flag) and every mount call;
- another process's memory or tracing (``ptrace``, ``process_vm_*``, ``pidfd_getfd``, ``kcmp``);
- the kernel's own surface: modules, kexec, ``bpf``, ``perf_event_open``, ``userfaultfd``, swap, clocks,
  quotas, accounting, reboot, ``open_by_handle_at``;
- sockets of every address family but the four a Python program uses (:data:`SOCKET_FAMILIES`: ``AF_UNIX``,
  ``AF_INET``, ``AF_INET6``, and ``AF_NETLINK``, which glibc's ``getaddrinfo`` and ``getifaddrs`` open). The
  rest reach host-side kernel code that no answer needs and that has had exploitable bugs: ``AF_VSOCK`` talks to
  the hypervisor and to other VMs' or the host's vsock services (the network namespace does not cover it),
  ``AF_PACKET``, ``AF_KEY``, ``AF_ALG``, ``AF_TIPC``, ``AF_RDS``, ``AF_CAN``, ``AF_BLUETOOTH`` and the others have
  each had privilege escalations. The rule reads the family as a 64-bit register: anything above ``AF_NETLINK``
  (16) is refused, so a value with high bits set that the kernel truncates to a family cannot slip past an
  equality test, and the families below 16 outside the four are refused one by one. ``socketcall``, the i386
  multiplexer whose arguments sit in memory where no filter can read them, is refused altogether.

The compat ABIs of the architecture (i386 and x32 on x86_64) get the same rules: without them ``int 0x80``
would reach ``keyctl`` past a filter written for x86_64 alone.
"""

from __future__ import annotations

import errno
import platform
from dataclasses import dataclass
from pathlib import Path

from mlbench_kit.errors import MLBenchError

KEYCTL_JOIN_SESSION_KEYRING = 1
# clone/unshare flags that create namespaces: NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
NS_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)

DENIED = (
    "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "setns", "mount", "umount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick",
    "open_tree", "move_mount", "mount_setattr",
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "bpf", "perf_event_open", "userfaultfd", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "create_module", "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "stime", "syslog", "lookup_dcookie",
    "open_by_handle_at", "name_to_handle_at", "iopl", "ioperm", "vhangup", "uselib", "nfsservctl", "vm86",
    "vm86old", "_sysctl", "fanotify_init",
)

# the socket address families an answer may open: AF_UNIX, AF_INET, AF_INET6, AF_NETLINK
SOCKET_FAMILIES = (1, 2, 10, 16)

# (libseccomp name, the JSON profile's name) of the native architecture and its compat ABIs
_ARCHES = {"x86_64": [("X86_64", "SCMP_ARCH_X86_64"), ("X86", "SCMP_ARCH_X86"), ("X32", "SCMP_ARCH_X32")],
           "aarch64": [("AARCH64", "SCMP_ARCH_AARCH64"), ("ARM", "SCMP_ARCH_ARM")]}


@dataclass(frozen=True)
class Rule:
    """One rule: ``name`` fails with ``errno`` when every ``(arg index, op, value)`` holds (op: 'eq', 'ne', 'gt'
    (unsigned, all 64 bits) or 'masked', the last meaning ``arg & value == value``)."""

    name: str
    errno: int = errno.EPERM
    args: tuple[tuple[int, str, int], ...] = ()


def rules() -> list[Rule]:
    """The policy: every rule both engines apply."""
    out = [Rule(n) for n in DENIED]
    out += [Rule("keyctl", args=((0, "ne", KEYCTL_JOIN_SESSION_KEYRING),)),
            Rule("keyctl", args=((0, "eq", KEYCTL_JOIN_SESSION_KEYRING), (1, "ne", 0)))]
    out += [Rule(call, args=((0, "masked", flag),)) for call in ("clone", "unshare") for flag in NS_FLAGS]
    out.append(Rule("clone3", errno.ENOSYS))
    top = max(SOCKET_FAMILIES)
    out.append(Rule("socket", args=((0, "gt", top),)))
    out += [Rule("socket", args=((0, "eq", fam),)) for fam in range(1, top) if fam not in SOCKET_FAMILIES]
    out.append(Rule("socketcall"))
    return out


def _arches() -> list[tuple[str, str]]:
    return _ARCHES.get(platform.machine(), [])


_JSON_OP = {"eq": "SCMP_CMP_EQ", "ne": "SCMP_CMP_NE", "gt": "SCMP_CMP_GT", "masked": "SCMP_CMP_MASKED_EQ"}


def podman_profile() -> dict:
    """The policy as an OCI/podman seccomp profile (JSON)."""
    syscalls = []
    for r in rules():
        entry: dict = {"names": [r.name], "action": "SCMP_ACT_ERRNO", "errnoRet": r.errno}
        if r.args:
            entry["args"] = [{"index": i, "value": v, "valueTwo": v if op == "masked" else 0, "op": _JSON_OP[op]}
                             for i, op, v in r.args]
        syscalls.append(entry)
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": [j for _, j in _arches()], "syscalls": syscalls}


def write_bpf(path: Path) -> None:
    """Compile the policy with libseccomp into the BPF program bwrap loads (``--seccomp FD``)."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as exc:  # a dependency of the project, over the system's libseccomp2
        raise MLBenchError(f"cannot compile the sandbox's seccomp policy: {exc}", "--backend bwrap",
                           "install the project's dependencies (bash scripts/setup.sh) and libseccomp2 "
                           "(apt-get install libseccomp2)") from None
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    for name, _ in _arches():
        try:
            f.add_arch(getattr(sc.Arch, name))
        except FileExistsError:  # the native one is there already
            pass
    ops = {"eq": sc.EQ, "ne": sc.NE, "gt": sc.GT, "masked": sc.MASKED_EQ}
    for r in rules():
        args = [sc.Arg(i, ops[op], v, v) if op == "masked" else sc.Arg(i, ops[op], v) for i, op, v in r.args]
        try:
            f.add_rule(sc.ERRNO(r.errno), r.name, *args)
        except (ValueError, RuntimeError, OSError):  # a call this kernel/libseccomp does not know on any arch
            continue
    with open(path, "wb") as fh:
        f.export_bpf(fh)
