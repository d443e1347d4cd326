"""Answers shared by the sandbox tests of every engine (test_sandbox.py, test_unprivileged.py): the socket-family
probe."""

from __future__ import annotations

SOCKETS_PY = """import ctypes, errno, mmap, os, struct
libc = ctypes.CDLL(None, use_errno=True)
def attempt(fam, typ):  # socket(2) itself, the family as a full 64-bit register
    fd = libc.syscall(ctypes.c_long(41), ctypes.c_long(fam), ctypes.c_long(typ), ctypes.c_long(0))
    if fd >= 0:
        os.close(fd)
        return 'ok'
    return errno.errorcode.get(ctypes.get_errno(), '?')
for name, fam, typ in (('unix', 1, 1), ('inet', 2, 2), ('inet6', 10, 2), ('netlink', 16, 3), ('vsock', 40, 1),
                       ('vsock-high-bits', 0x100000028, 1), ('packet', 17, 2), ('key', 15, 3), ('alg', 38, 5),
                       ('bluetooth', 31, 1), ('tipc', 30, 2), ('appletalk', 5, 2), ('max', 45, 1)):
    print(name, attempt(fam, typ))
# i386 ABI (int 0x80): socketcall(SYS_SOCKET, [AF_VSOCK, SOCK_STREAM, 0]) and socket(AF_VSOCK) as syscall 359;
# code and arguments in one page below 4 GB (MAP_32BIT), where 32-bit pointers reach
page = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40,
                 prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
base = ctypes.addressof(ctypes.c_char.from_buffer(page))
assert base < 2**32
args = struct.pack('<3I', 40, 1, 0)
calls = {'i386-socketcall': bytes.fromhex('53b866000000bb01000000b9') + struct.pack('<I', base + 512),
         'i386-socket': bytes.fromhex('53b867010000bb28000000b90100000031d2')}
for name, head in calls.items():
    code = head + bytes.fromhex('cd805bc3')
    page.seek(0)
    page.write(code)
    page.seek(512)
    page.write(args)
    fd = ctypes.CFUNCTYPE(ctypes.c_int)(base)()
    if fd >= 0:
        os.close(fd)
    print(name, 'ok' if fd >= 0 else errno.errorcode.get(-fd, '?'))
"""


def check_sockets(log: str) -> None:
    """What :data:`SOCKETS_PY` printed: the four families a Python program uses open (or fail for a reason of
    their own, never the policy's EPERM); every other attempt fails with EPERM."""
    got = dict(ln.split() for ln in log.splitlines() if len(ln.split()) == 2)
    assert len(got) == 15, log
    allowed = ("unix", "inet", "inet6", "netlink")
    assert {k: got[k] != "EPERM" for k in allowed} == dict.fromkeys(allowed, True), got
    assert {k: v for k, v in got.items() if k not in allowed} == {k: "EPERM" for k in got if k not in allowed}, got
