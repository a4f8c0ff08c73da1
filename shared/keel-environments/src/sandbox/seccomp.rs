//! The seccomp filter every sandboxed program runs under, as a classic BPF program that
//! bubblewrap installs (`--seccomp FD`) just before it executes the program.
//!
//! It refuses with `EPERM` what a program needs only to attack the kernel or get out of its
//! namespaces: new namespaces (`unshare`, `setns`, `clone` with any `CLONE_NEW*` flag), mounts
//! of every kind (so no tmpfs outside the size limit), `chroot`, `ptrace`, kernel keyrings,
//! `bpf`, `perf_event_open`, `userfaultfd`, io_uring, module loading and `kexec`. `clone3`
//! answers `ENOSYS` (its flags sit in memory a filter cannot read), so the C library falls
//! back to `clone`, which is checked. `socket` and `socketpair` are allowed for the Unix, IPv4
//! and IPv6 families only (no netlink, packet, vsock, Bluetooth, ... sockets: the kernel's
//! rarer socket code is where its bugs are). Any other architecture's system calls (x32, i386
//! compatibility) kill the process. Everything else is allowed.

/// One classic BPF instruction (`struct sock_filter`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Insn {
    code: u16,
    jt: u8,
    jf: u8,
    k: u32,
}

const LD_W_ABS: u16 = 0x20;
const JEQ_K: u16 = 0x15;
const JGE_K: u16 = 0x35;
const JSET_K: u16 = 0x45;
const RET_K: u16 = 0x06;

const RET_ALLOW: u32 = 0x7fff_0000;
const RET_KILL_PROCESS: u32 = 0x8000_0000;
const RET_ERRNO: u32 = 0x0005_0000;
const EPERM: u32 = 1;
const ENOSYS: u32 = 38;

/// Offsets in `struct seccomp_data`.
const NR: u32 = 0;
const ARCH: u32 = 4;
const ARG0_LOW: u32 = 16;

/// The socket families a program may open: `AF_UNIX`, `AF_INET`, `AF_INET6`.
const SOCKET_FAMILIES: [u32; 3] = [1, 2, 10];

/// Every `CLONE_NEW*` flag (time, mount, cgroup, UTS, IPC, user, PID, network).
const CLONE_NEW_ANY: u32 =
    0x0000_0080 | 0x0002_0000 | 0x0200_0000 | 0x0400_0000 | 0x0800_0000 | 0x1000_0000 | 0x2000_0000 | 0x4000_0000;

/// The system call numbers of one architecture.
struct Table {
    audit_arch: u32,
    /// Numbers at or above this belong to another ABI (x32 on x86-64).
    foreign_from: Option<u32>,
    clone: u32,
    clone3: u32,
    /// `socket` and `socketpair`, whose first argument is the family.
    sockets: [u32; 2],
    denied: &'static [u32],
}

#[cfg(target_arch = "x86_64")]
const TABLE: Option<Table> = Some(Table {
    audit_arch: 0xc000_003e,
    foreign_from: Some(0x4000_0000),
    clone: 56,
    clone3: 435,
    sockets: [41, 53],
    // ptrace, chroot, pivot_root, mount, umount2, init_module, delete_module, kexec_load,
    // add_key, request_key, keyctl, unshare, perf_event_open, setns, finit_module, kexec_file_load,
    // bpf, userfaultfd, io_uring_setup/enter/register, open_tree, move_mount, fsopen, fsconfig,
    // fsmount, fspick, mount_setattr.
    denied: &[
        101, 161, 155, 165, 166, 175, 176, 246, 248, 249, 250, 272, 298, 308, 313, 320, 321, 323, 425, 426, 427, 428,
        429, 430, 431, 432, 433, 442,
    ],
});

#[cfg(target_arch = "aarch64")]
const TABLE: Option<Table> = Some(Table {
    audit_arch: 0xc000_00b7,
    foreign_from: None,
    clone: 220,
    clone3: 435,
    sockets: [198, 199],
    // The same calls in the generic table.
    denied: &[
        117, 51, 41, 40, 39, 105, 106, 104, 217, 218, 219, 97, 241, 268, 273, 294, 280, 282, 425, 426, 427, 428, 429,
        430, 431, 432, 433, 442,
    ],
});

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const TABLE: Option<Table> = None;

/// The filter as the bytes of a `sock_filter` array, or `None` on an architecture without a
/// table (the sandbox then refuses to run).
pub fn program() -> Option<Vec<u8>> {
    let table = TABLE.as_ref()?;
    let insns = assemble(table);
    Some(insns.iter().flat_map(|i| [&i.code.to_ne_bytes()[..], &[i.jt, i.jf], &i.k.to_ne_bytes()].concat()).collect())
}

/// Checks, in order: the architecture, a foreign ABI, `clone3`, each denied call, the socket
/// calls (to their family check), `clone`'s flags, the socket family; four return
/// instructions close the program.
fn assemble(t: &Table) -> Vec<Insn> {
    let socket_block = 4 + usize::from(t.foreign_from.is_some()) + 1 + t.denied.len() + 2 + 3;
    let checks = socket_block + 1 + SOCKET_FAMILIES.len() + 1;
    // Return instructions, after the checks: allow, EPERM, ENOSYS, kill.
    let (allow, eperm, enosys, kill) = (checks, checks + 1, checks + 2, checks + 3);
    let mut p: Vec<Insn> = Vec::with_capacity(checks + 4);
    // A jump from instruction `at` to `target` skips `target - at - 1` instructions.
    let to = |at: usize, target: usize| (target - at - 1) as u8;
    p.push(Insn { code: LD_W_ABS, jt: 0, jf: 0, k: ARCH });
    p.push(Insn { code: JEQ_K, jt: 1, jf: 0, k: t.audit_arch });
    p.push(Insn { code: RET_K, jt: 0, jf: 0, k: RET_KILL_PROCESS });
    p.push(Insn { code: LD_W_ABS, jt: 0, jf: 0, k: NR });
    if let Some(from) = t.foreign_from {
        let at = p.len();
        p.push(Insn { code: JGE_K, jt: to(at, kill), jf: 0, k: from });
    }
    let at = p.len();
    p.push(Insn { code: JEQ_K, jt: to(at, enosys), jf: 0, k: t.clone3 });
    for nr in t.denied {
        let at = p.len();
        p.push(Insn { code: JEQ_K, jt: to(at, eperm), jf: 0, k: *nr });
    }
    for nr in t.sockets {
        let at = p.len();
        p.push(Insn { code: JEQ_K, jt: to(at, socket_block), jf: 0, k: nr });
    }
    let at = p.len();
    p.push(Insn { code: JEQ_K, jt: 0, jf: to(at, allow), k: t.clone });
    p.push(Insn { code: LD_W_ABS, jt: 0, jf: 0, k: ARG0_LOW });
    let at = p.len();
    p.push(Insn { code: JSET_K, jt: to(at, eperm), jf: to(at, allow), k: CLONE_NEW_ANY });
    debug_assert_eq!(p.len(), socket_block);
    p.push(Insn { code: LD_W_ABS, jt: 0, jf: 0, k: ARG0_LOW });
    for family in SOCKET_FAMILIES {
        let at = p.len();
        p.push(Insn { code: JEQ_K, jt: to(at, allow), jf: 0, k: family });
    }
    let at = p.len();
    p.push(Insn { code: JEQ_K, jt: to(at, eperm), jf: to(at, eperm), k: 0 });
    debug_assert_eq!(p.len(), checks);
    for k in [RET_ALLOW, RET_ERRNO | EPERM, RET_ERRNO | ENOSYS, RET_KILL_PROCESS] {
        p.push(Insn { code: RET_K, jt: 0, jf: 0, k });
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the filter the way the kernel would, on one system call.
    fn run(program: &[Insn], arch: u32, nr: u32, arg0: u32) -> u32 {
        let (mut acc, mut pc) = (0u32, 0usize);
        loop {
            let i = program[pc];
            match i.code {
                LD_W_ABS => {
                    acc = match i.k {
                        NR => nr,
                        ARCH => arch,
                        ARG0_LOW => arg0,
                        other => panic!("load of offset {other}"),
                    }
                }
                RET_K => return i.k,
                JEQ_K | JGE_K | JSET_K => {
                    let taken = match i.code {
                        JEQ_K => acc == i.k,
                        JGE_K => acc >= i.k,
                        _ => acc & i.k != 0,
                    };
                    pc += usize::from(if taken { i.jt } else { i.jf });
                }
                other => panic!("unknown instruction {other:#x}"),
            }
            pc += 1;
        }
    }

    #[test]
    fn the_filter_allows_ordinary_calls_and_refuses_escapes() {
        let Some(table) = TABLE.as_ref() else { return };
        let p = assemble(table);
        let arch = table.audit_arch;
        let fork_flags = 0x0120_0011; // CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID | SIGCHLD
        assert_eq!(run(&p, arch, table.clone, fork_flags), RET_ALLOW, "fork");
        assert_eq!(run(&p, arch, table.clone, fork_flags | 0x1000_0000), RET_ERRNO | EPERM, "clone(CLONE_NEWUSER)");
        assert_eq!(run(&p, arch, table.clone, 0x4000_0000), RET_ERRNO | EPERM, "clone(CLONE_NEWNET)");
        assert_eq!(run(&p, arch, table.clone3, 0), RET_ERRNO | ENOSYS);
        for nr in table.denied {
            assert_eq!(run(&p, arch, *nr, 0), RET_ERRNO | EPERM, "syscall {nr}");
        }
        for nr in [0, 1, 2, 3, 9, 60, 231] {
            if !table.denied.contains(&nr) && nr != table.clone && nr != table.clone3 {
                assert_eq!(run(&p, arch, nr, 0), RET_ALLOW, "syscall {nr}");
            }
        }
        for nr in table.sockets {
            for family in SOCKET_FAMILIES {
                assert_eq!(run(&p, arch, nr, family), RET_ALLOW, "socket family {family}");
            }
            // Netlink, packet, vsock, Bluetooth, AF_ALG.
            for family in [16, 17, 40, 31, 38] {
                assert_eq!(run(&p, arch, nr, family), RET_ERRNO | EPERM, "socket family {family}");
            }
        }
        assert_eq!(run(&p, 0x4000_0003, 1, 0), RET_KILL_PROCESS, "another architecture");
        if let Some(from) = table.foreign_from {
            assert_eq!(run(&p, arch, from + 1, 0), RET_KILL_PROCESS, "another ABI");
        }
        assert_eq!(program().map(|b| b.len()), Some(p.len() * 8));
    }
}
