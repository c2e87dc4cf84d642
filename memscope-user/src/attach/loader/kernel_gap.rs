//! Telling a kernel too old for the probes from any other refusal, by the verifier's words.
//! It names a helper it does not know by its number ("invalid func unknown#181", or "unknown
//! func bpf_loop#181" where it knows the name but not for this program type), and a kernel
//! without callback functions (before 5.13, which `bpf_loop` needs) does not count them as
//! functions and says their BTF does not match. A version check would be wrong both ways: vendor
//! kernels (openEuler, Kylin) backport BPF features into old version numbers.

/// What an older kernel lacks, and the Linux release that brought it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gap {
    pub what: &'static str,
    pub since: &'static str,
}

/// Helpers the probes call that came in recent kernels, by their number in
/// include/uapi/linux/bpf.h. The others they call are older than 5.8, which the ring buffer
/// needs anyway.
const LATE_HELPERS: &[(u32, Gap)] = &[
    (174, Gap { what: "the BPF helper bpf_get_attach_cookie", since: "5.15" }),
    (181, Gap { what: "the BPF helper bpf_loop", since: "5.17" }),
];

/// The 5.10 verifier's words for a program with callback functions (seen on Debian 11's kernel).
const NO_CALLBACKS: &str = "number of funcs in func_info doesn't match number of subprogs";

/// This kernel's release (`uname -r`), empty where it cannot be read.
pub fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").map(|s| s.trim().to_owned()).unwrap_or_default()
}

/// The oldest Linux release with everything the probes use.
pub const OLDEST: &str = "5.17";

/// What a refused program's verifier output says this kernel lacks, if it is that.
pub fn missing(verifier_output: &str) -> Option<Gap> {
    if verifier_output.contains(NO_CALLBACKS) {
        return Some(Gap { what: "the callback functions bpf_loop takes", since: "5.13" });
    }
    verifier_output.lines().filter(|l| l.contains("func ")).find_map(|line| {
        let number = line.rsplit_once('#')?.1;
        let digits: String = number.chars().take_while(char::is_ascii_digit).collect();
        let number: u32 = digits.parse().ok()?;
        LATE_HELPERS.iter().find(|(n, _)| *n == number).map(|(_, gap)| *gap)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verifiers_words_for_what_an_older_kernel_lacks_name_the_release_that_brought_it() {
        let unknown_number = "0: R1=ctx() R10=fp0\n0: (85) call unknown#174\ninvalid func unknown#174\n";
        assert_eq!(missing(unknown_number).map(|g| g.since), Some("5.15"));
        let known_name = "12: (85) call bpf_loop#181\nunknown func bpf_loop#181\nprocessed 12 insns";
        assert_eq!(missing(known_name), Some(LATE_HELPERS[1].1));
        // Debian 11's 5.10, on the probes' object (the VM tier boots it).
        let callbacks = "number of funcs in func_info doesn't match number of subprogs\nverification time 634 usec";
        assert_eq!(missing(callbacks).map(|g| g.since), Some("5.13"));
        // A refusal for another reason, naming an old helper on the way, is not an old kernel.
        let other = "5: (85) call bpf_probe_read_user#112\nR2 min value is negative\n";
        assert_eq!(missing(other), None);
    }
}
