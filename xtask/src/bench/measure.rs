//! What every bench measures with: running a command and keeping what it printed, the median of
//! rounds, the bpftrace peer's script for the allocation loop, and writing a results file.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{bail, Context as _};

pub fn run_capture(cmd: &mut Command) -> anyhow::Result<(String, String)> {
    let out = cmd.stdin(Stdio::null()).output().with_context(|| format!("cannot run {cmd:?}"))?;
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    if !out.status.success() {
        bail!("{cmd:?} failed ({}):\n{stdout}\n{stderr}", out.status);
    }
    Ok((stdout, stderr))
}

/// The same 8 probes memscope-bpf attaches for this loop: entry and return of the runtime's and
/// the driver's allocation and free implementations.
pub fn bpftrace_script(lib: &Path) -> String {
    let l = lib.display();
    let hal = lib.with_file_name("libascend_hal.so");
    let h = hal.display();
    format!(
        "uprobe:{l}:aclrtMallocImpl {{ @p[tid] = arg0; }} \
         uretprobe:{l}:aclrtMallocImpl /@p[tid]/ {{ @live[*(uint64 *)uptr(@p[tid])] = 1; delete(@p[tid]); }} \
         uprobe:{l}:aclrtFreeImpl {{ @f[tid] = arg0; }} \
         uretprobe:{l}:aclrtFreeImpl /@f[tid]/ {{ delete(@live[@f[tid]]); delete(@f[tid]); }} \
         uprobe:{h}:halMemAllocInner {{ @hp[tid] = arg0; }} \
         uretprobe:{h}:halMemAllocInner /@hp[tid]/ {{ @hlive[*(uint64 *)uptr(@hp[tid])] = 1; delete(@hp[tid]); }} \
         uprobe:{h}:halMemFreeInner {{ @hf[tid] = arg0; }} \
         uretprobe:{h}:halMemFreeInner /@hf[tid]/ {{ delete(@hlive[@hf[tid]]); delete(@hf[tid]); }} \
         END {{ clear(@live); clear(@p); clear(@f); clear(@hlive); clear(@hp); clear(@hf); }}"
    )
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Writes a section's results into `path` and prints them.
pub fn report(path: &Path, md: &str) -> anyhow::Result<()> {
    std::fs::write(path, md)?;
    println!("{md}");
    Ok(())
}
