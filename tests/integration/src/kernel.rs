//! What the kernel holds for the tracer, seen from outside it: the names of the BPF programs
//! loaded now (as `bpftool prog` lists them), so a test can tell whether a tracer's probes
//! outlived it. Read with the `bpf(2)` syscall directly: no bpftool on the test machines.

use std::os::fd::{FromRawFd, OwnedFd};

const BPF_PROG_GET_NEXT_ID: libc::c_long = 11;
const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
/// `struct bpf_prog_info`'s `name` (16 bytes) starts here.
const NAME_OFFSET: usize = 64;

fn bpf(cmd: libc::c_long, attr: &mut [u64; 4]) -> libc::c_long {
    // SAFETY: `attr` is a zero-tailed buffer as large as the size passed.
    unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), std::mem::size_of_val(attr)) }
}

/// The names of every BPF program loaded now (cut to 15 bytes by the kernel).
pub fn bpf_program_names() -> Vec<String> {
    let mut names = Vec::new();
    let mut id: u32 = 0;
    loop {
        let mut attr = [u64::from(id), 0, 0, 0];
        if bpf(BPF_PROG_GET_NEXT_ID, &mut attr) != 0 {
            return names;
        }
        // `next_id` is the second u32 of the attribute.
        id = (attr[0] >> 32) as u32;
        let mut attr = [u64::from(id), 0, 0, 0];
        let fd = bpf(BPF_PROG_GET_FD_BY_ID, &mut attr);
        if fd < 0 {
            // Freed meanwhile.
            continue;
        }
        // SAFETY: a new descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let mut info = [0u8; 256];
        let mut attr = [
            u64::from(std::os::fd::AsRawFd::as_raw_fd(&fd) as u32) | (info.len() as u64) << 32,
            info.as_mut_ptr() as u64,
            0,
            0,
        ];
        if bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr) == 0 {
            let name = &info[NAME_OFFSET..NAME_OFFSET + 16];
            let end = name.iter().position(|b| *b == 0).unwrap_or(16);
            names.push(String::from_utf8_lossy(&name[..end]).into_owned());
        }
    }
}
