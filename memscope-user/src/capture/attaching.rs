//! Attaching a trace's libraries, at the start and as the traced processes map new ones: the
//! API probes first, then the marker sites (a program's `wait_for_tracer()` returns once their
//! semaphores rise, so everything else must be probed by then), with a warning and an
//! `ms_meta` entry for each library that cannot be probed, and the rows of `ms_probes`.

use std::collections::BTreeSet;

use memscope_core::apis::{self, Backend};
use memscope_core::printable::printable;
use memscope_core::store::{Meta, ProbeRow};

use crate::attach::libs::{self, Library};
use crate::attach::loader::{AttachError, LinkerHook};
use crate::attach::{AttachedProbe, AttachedUsdt, ProbeSet, Tracer};
use crate::terminal::say::{note, say};

/// A library that could not be probed, and why (it was warned about when found).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SkippedLibrary {
    pub library: String,
    pub reason: String,
}

pub(crate) fn probe_rows(probes: &[AttachedProbe], at: u64) -> Vec<ProbeRow> {
    probes
        .iter()
        .map(|p| ProbeRow {
            library: p.library.clone(),
            symbol: p.symbol.clone(),
            api: p.api.name().to_owned(),
            file_offset: p.file_offset,
            source: p.source.as_str().to_owned(),
            attached_wall_ns: at,
        })
        .collect()
}

pub(crate) fn usdt_rows(sites: &[AttachedUsdt], at: u64) -> Vec<ProbeRow> {
    sites
        .iter()
        .map(|s| ProbeRow {
            library: s.library.clone(),
            symbol: s.probe.clone(),
            api: "usdt".to_owned(),
            file_offset: s.file_offset,
            source: match s.semaphore_offset {
                Some(sem) => format!("stapsdt note, semaphore at file offset {sem:#x}"),
                None => "stapsdt note".to_owned(),
            },
            attached_wall_ns: at,
        })
        .collect()
}

/// The accelerator stacks a trace's probes belong to (`apis::Backend`): the run folder and
/// `ms_meta.backend` say it.
pub(crate) fn backends(probes: &[AttachedProbe], sites: &[AttachedUsdt]) -> Vec<Backend> {
    let usdt = sites.iter().filter_map(|s| s.probe.split_once(':')).filter_map(|(p, n)| apis::usdt_api(p, n));
    Backend::of(probes.iter().map(|p| p.api).chain(usdt))
}

/// Attaches the marker sites of `libs`; a library whose notes cannot be used is reported and
/// skipped (the allocation probes matter more than the markers).
pub(crate) fn attach_markers(tracer: &mut Tracer, libs: &[Library], quiet: bool) -> Vec<AttachedUsdt> {
    let mut attached = Vec::new();
    if !crate::attach::perf_uprobe::ref_ctr_supported() {
        // Our markers only fire when their semaphore is raised, which needs the kernel's
        // reference counter; attaching without it would look live and see nothing.
        if libs.iter().any(|l| libs::is_markers_module(&l.path)) {
            note(quiet, "warning: this kernel has no uprobe ref_ctr_offset (Linux >= 4.20): markers are not traced");
        }
        return attached;
    }
    for lib in libs {
        match tracer.attach_usdt(lib) {
            Ok((sites, skipped)) => {
                attached.extend(sites);
                for why in skipped {
                    note(quiet, format!("warning: marker site skipped: {}", printable(&why)));
                }
            }
            Err(e) => {
                let why = crate::attach::with_causes(&e);
                let lib = printable(&lib.shown);
                note(quiet, format!("warning: markers in {lib} are not traced: {}", printable(&why)));
            }
        }
    }
    attached
}

/// `USDT: 11 sites in A; 4 sites in B`: the sites attached, per library (the markers' module,
/// PyTorch's libc10_cuda.so). Library paths are the targets' text: escaped, as in every note.
pub(crate) fn describe_usdt(sites: &[AttachedUsdt]) -> String {
    let mut per_lib: std::collections::BTreeMap<&str, usize> = std::collections::BTreeMap::new();
    for site in sites {
        *per_lib.entry(site.library.as_str()).or_default() += 1;
    }
    let parts: Vec<String> = per_lib.into_iter().map(|(lib, n)| format!("{n} sites in {}", printable(lib))).collect();
    format!("USDT: {}", parts.join("; "))
}

pub(crate) fn describe_libraries(probes: &[AttachedProbe]) -> String {
    let libs: BTreeSet<&str> = probes.iter().map(|p| p.library.as_str()).collect();
    libs.into_iter().map(printable).collect::<Vec<_>>().join(", ")
}

/// Attaches newly mapped libraries of the traced processes; returns the new probes and marker
/// sites ([`attach_found`]). Only a process that ended between its maps read and the attach is
/// no warning.
pub(crate) fn rescan(
    tracer: &mut Tracer,
    pids: impl Iterator<Item = u32>,
    set: ProbeSet,
    quiet: bool,
    skipped: &mut Vec<SkippedLibrary>,
) -> (Vec<AttachedProbe>, Vec<AttachedUsdt>) {
    let mut found = Vec::new();
    for pid in pids {
        let libs = libs::from_maps(pid).unwrap_or_default();
        found.extend(libs.into_iter().filter(|l| !tracer.is_attached(l)).map(|l| (Some(pid), l)));
    }
    attach_found(tracer, found, set, quiet, skipped)
}

/// Attaches libraries not probed yet, each found in process `pid`'s view (if any); returns the
/// new probes and marker sites. The markers go last: a program's `wait_for_tracer()` returns as
/// soon as their semaphores rise, and by then every library it had mapped must be probed too.
/// A library that cannot be probed (not an ELF file, replaced or gone since it was found) is a
/// warning, added to `skipped` (the caller records it in `ms_meta`); tracing goes on with the
/// others.
pub(crate) fn attach_found(
    tracer: &mut Tracer,
    libs: Vec<(Option<u32>, Library)>,
    set: ProbeSet,
    quiet: bool,
    skipped: &mut Vec<SkippedLibrary>,
) -> (Vec<AttachedProbe>, Vec<AttachedUsdt>) {
    let mut added = Vec::new();
    let mut found = Vec::new();
    for (pid, lib) in libs {
        if tracer.is_attached(&lib) {
            continue;
        }
        match tracer.attach(&lib, set) {
            Ok(probes) => {
                added.extend(probes);
                found.push(lib);
            }
            // A process that ended meanwhile takes its view of the files (`/proc/PID/root`)
            // with it: nothing is wrong with the library, which is tried again if another
            // process maps it.
            Err(_) if pid.is_some_and(|pid| std::fs::metadata(format!("/proc/{pid}/root")).is_err()) => {}
            Err(e) => skipped.push(skip(quiet, &lib, &e)),
        }
    }
    let markers = attach_markers(tracer, &found, quiet);
    (added, markers)
}

/// Warns about a library that cannot be probed; the warning names the file and why.
pub(crate) fn skip(quiet: bool, lib: &Library, e: &AttachError) -> SkippedLibrary {
    let reason = crate::attach::with_causes(e);
    note(quiet, format!("warning: {} is not traced: {}", printable(&lib.shown), printable(&reason)));
    SkippedLibrary { library: lib.shown.clone(), reason }
}

/// `ms_meta.libraries_skipped` (how many) and `ms_meta.skipped_libraries` (a JSON array of
/// `{"library", "reason"}`).
pub(crate) fn skipped_meta(skipped: &[SkippedLibrary]) -> Meta {
    let list: Vec<serde_json::Value> =
        skipped.iter().map(|s| serde_json::json!({ "library": s.library, "reason": s.reason })).collect();
    vec![
        ("libraries_skipped".into(), skipped.len().to_string()),
        ("skipped_libraries".into(), serde_json::Value::Array(list).to_string()),
    ]
}

/// The error when no library could be probed at start: the ones without the API, and why each
/// unusable one was refused.
pub(crate) fn nothing_to_probe(libraries: &[Library], skipped: &[SkippedLibrary]) -> anyhow::Error {
    let refused: Vec<String> =
        skipped.iter().map(|s| format!("{} ({})", printable(&s.library), printable(&s.reason))).collect();
    let usable: Vec<_> = libraries
        .iter()
        .map(|l| l.shown.as_str())
        .filter(|l| !skipped.iter().any(|s| s.library == *l))
        .map(printable)
        .collect();
    let mut text = String::new();
    if !usable.is_empty() {
        text = format!("none of {} exports the ACL memory API (aclrtMalloc, aclrtFree, ...)", usable.join(", "));
    }
    if !refused.is_empty() {
        let sep = if text.is_empty() { "" } else { "; " };
        text = format!("{text}{sep}no usable library: {}", refused.join("; "));
    }
    anyhow::anyhow!("{text}; pass --lib with the right library")
}

/// What the start's attach found: the API probes, the marker sites and the libraries refused.
pub(crate) struct Attached {
    pub(crate) probes: Vec<AttachedProbe>,
    pub(crate) markers: Vec<AttachedUsdt>,
    pub(crate) skipped: Vec<SkippedLibrary>,
}

/// Attaches the libraries given at start. One unusable file among the candidates is a warning;
/// none usable is the error.
pub(crate) fn attach_all(
    tracer: &mut Tracer,
    libraries: &[Library],
    set: ProbeSet,
    quiet: bool,
) -> anyhow::Result<Attached> {
    let mut probes = Vec::new();
    let mut skipped = Vec::new();
    let mut usable = Vec::new();
    for lib in libraries {
        match tracer.attach(lib, set) {
            Ok(attached) => {
                probes.extend(attached);
                usable.push(lib.clone());
            }
            Err(e) => skipped.push(skip(quiet, lib, &e)),
        }
    }
    let markers = attach_markers(tracer, &usable, quiet);
    // None given (a launch that only watches what the job loads) is no error; none usable is.
    if probes.is_empty() && !libraries.is_empty() {
        return Err(nothing_to_probe(libraries, &skipped));
    }
    Ok(Attached { probes, markers, skipped })
}

/// Hooks the dynamic linker process `pid` runs with, so that a library the job loads is probed
/// as soon as the linker reports it (within a drain, ~20 ms) rather than at the next look at its
/// maps (every 250 ms). Where it cannot be hooked (a static program, a linker without the
/// symbol), the periodic look remains; each linker file is tried once.
pub(crate) fn hook_linker(tracer: &mut Tracer, pid: u32) {
    if let Some(ld) = crate::attach::linker::of_process(pid) {
        let _: Result<LinkerHook, _> = tracer.hook_linker(&ld);
    }
}

/// The error of an attach that failed because process `pid` went away meanwhile says that, not
/// that its libraries were unusable.
pub(crate) fn unless_exited(e: anyhow::Error, pid: u32) -> anyhow::Error {
    if crate::capture::procs::liveness(pid) == crate::capture::procs::Liveness::Exited {
        return anyhow::anyhow!(
            "process {pid} exited while its probes were being attached: there is nothing left to trace"
        );
    }
    e
}

/// The "live" line: what is probed and which processes are traced.
pub(crate) fn announce(
    probes: &[AttachedProbe],
    markers: &[AttachedUsdt],
    libraries: usize,
    pid: u32,
    follow: bool,
    launch_mode: bool,
    quiet: bool,
) {
    let backends = backends(probes, markers);
    if probes.is_empty() {
        say!("memscope-bpf: live: no library probed yet, watching the ones the job loads; tracing pid {pid} and its children");
        return;
    }
    say!(
        "memscope-bpf: live: {} probes on {} ({}){}; tracing pid {pid}{}",
        probes.len(),
        if libraries == 1 { "1 library".to_owned() } else { format!("{libraries} libraries") },
        describe_libraries(probes),
        match backends.as_slice() {
            [] => String::new(),
            b => format!(", backend {}", Backend::meta(b)),
        },
        match (follow, launch_mode) {
            (true, true) => " and its children".to_owned(),
            (true, false) => format!(" and the children it forks from now on (--no-follow traces pid {pid} alone)"),
            (false, _) => String::new(),
        },
    );
    if !markers.is_empty() {
        note(quiet, describe_usdt(markers));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attach::elf::SymbolSource;
    use crate::attach::libs::Origin;

    const EVIL: &str = "/tmp/lib\u{1b}]0;pwned\u{7}\nmemscope-bpf: forged.so";
    const SHOWN: &str = "/tmp/lib\\u{1b}]0;pwned\\u{7}\\nmemscope-bpf: forged.so";

    fn clean(text: &str) {
        assert!(!text.contains('\u{1b}') && !text.contains('\n') && text.contains(SHOWN), "{text}");
    }

    #[test]
    fn library_paths_are_escaped_in_the_notes_and_exact_in_the_rows() {
        let api = apis::Api::all().next().unwrap().api;
        let source = SymbolSource::Dynsym;
        let probe = AttachedProbe { library: EVIL.into(), symbol: "f".into(), api, file_offset: 0, source };
        let site = AttachedUsdt { library: EVIL.into(), probe: "p:n".into(), file_offset: 0, semaphore_offset: None };
        clean(&describe_libraries(std::slice::from_ref(&probe)));
        clean(&describe_usdt(std::slice::from_ref(&site)));
        assert_eq!(probe_rows(&[probe], 0)[0].library, EVIL);
        assert_eq!(usdt_rows(&[site], 0)[0].library, EVIL);
    }

    #[test]
    fn the_error_naming_unusable_libraries_escapes_them() {
        let lib = Library { path: EVIL.into(), shown: EVIL.into(), file_id: (1, 2), origin: Origin::UserPath };
        clean(&nothing_to_probe(std::slice::from_ref(&lib), &[]).to_string());
        let refused = SkippedLibrary { library: EVIL.into(), reason: format!("{EVIL}: not an ELF file") };
        clean(&nothing_to_probe(&[lib], &[refused]).to_string());
    }
}
