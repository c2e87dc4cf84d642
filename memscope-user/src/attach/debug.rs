//! Finding a library's separate debug file, where stripped libraries keep their hidden symbols.
//!
//! Release builds such as torch_npu's wheels are stripped (`eu-strip -f`): `.symtab` and DWARF go
//! to a separate file, and the library keeps a `.gnu_debuglink` (file name + CRC32) and usually a
//! build id. Looked for, as gdb does:
//! 1. by build id: `<dir>/.build-id/xx/yyyy.debug` for each `--debug-dir` and `/usr/lib/debug`;
//! 2. by debuglink name: next to the library, in its `.debug/` folder, under
//!    `/usr/lib/debug/<library folder>/`, and in each `--debug-dir`.
//!
//! A candidate is accepted only if it matches: same build id, or the debuglink's CRC32. A debug
//! file from another build would put probes at wrong offsets. Candidates are opened as
//! `attach::file` does (regular files only, bounded, this machine's ELF): the debuglink names
//! a file next to the library, in a folder the target may control.

use std::path::{Path, PathBuf};

use object::Object;

/// How a debug file was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    BuildId,
    DebugLink,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DebugFile {
    pub path: PathBuf,
    pub found: Found,
}

/// What a library says about its debug file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DebugRef {
    pub build_id: Option<Vec<u8>>,
    pub link: Option<(String, u32)>,
    /// Whether the library still has its own `.symtab`.
    pub has_symtab: bool,
}

pub fn debug_ref(data: &[u8]) -> DebugRef {
    let Ok(file) = object::File::parse(data) else { return DebugRef::default() };
    DebugRef {
        build_id: file.build_id().ok().flatten().map(<[u8]>::to_vec),
        link: file.gnu_debuglink().ok().flatten().map(|(name, crc)| (String::from_utf8_lossy(name).into_owned(), crc)),
        has_symtab: file.section_by_name(".symtab").is_some(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

const SYSTEM_DEBUG: &str = "/usr/lib/debug";

/// The stacks' debug finder ([`memscope_core::stacks::capture::DebugFinder`]): a stripped file's
/// debug file, found as the probes' is (also under `debug_dirs`); `None` for a file that keeps
/// its own symbols.
pub fn finder(debug_dirs: Vec<PathBuf>) -> memscope_core::stacks::capture::DebugFinder {
    Box::new(move |path| {
        let data = std::fs::read(path).ok()?;
        let reference = debug_ref(&data);
        if reference.has_symtab {
            return None;
        }
        find(path, &reference, &debug_dirs).map(|d| d.path)
    })
}

/// The debug file for a library, if one that matches is found.
pub fn find(library: &Path, r: &DebugRef, extra_dirs: &[PathBuf]) -> Option<DebugFile> {
    let system = PathBuf::from(SYSTEM_DEBUG);
    let dirs: Vec<&Path> = extra_dirs.iter().map(PathBuf::as_path).chain(std::iter::once(system.as_path())).collect();
    if let Some(id) = r.build_id.as_ref().filter(|id| id.len() > 1) {
        let name = hex(id);
        for dir in &dirs {
            let candidate = dir.join(".build-id").join(&name[..2]).join(format!("{}.debug", &name[2..]));
            if matches_build_id(&candidate, id) {
                return Some(DebugFile { path: candidate, found: Found::BuildId });
            }
        }
    }
    let (name, crc) = r.link.as_ref()?;
    let lib_dir = library.parent().unwrap_or(Path::new("/"));
    let mut candidates = vec![lib_dir.join(name), lib_dir.join(".debug").join(name)];
    candidates.push(system.join(lib_dir.strip_prefix("/").unwrap_or(lib_dir)).join(name));
    candidates.extend(extra_dirs.iter().map(|d| d.join(name)));
    candidates
        .into_iter()
        .find(|c| c.as_path() != library && crc_matches(c, *crc))
        .map(|path| DebugFile { path, found: Found::DebugLink })
}

fn matches_build_id(candidate: &Path, id: &[u8]) -> bool {
    let Ok(data) = super::file::map_debug_file(candidate) else { return false };
    object::File::parse(&*data).ok().and_then(|f| f.build_id().ok().flatten().map(<[u8]>::to_vec)).as_deref()
        == Some(id)
}

fn crc_matches(candidate: &Path, crc: u32) -> bool {
    super::file::crc32(candidate).is_ok_and(|found| found == crc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_is_the_gnu_debuglink_crc32() {
        // The CRC gnu_debuglink uses is the standard CRC-32 (IEEE): known check value.
        assert_eq!(crc32fast::hash(b"123456789"), 0xcbf4_3926);
    }

    #[test]
    fn this_test_binary_has_its_own_symtab_and_no_link() {
        let data = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let r = debug_ref(&data);
        assert!(r.has_symtab);
        assert!(find(Path::new("/nonexistent/x"), &DebugRef::default(), &[]).is_none());
    }

    #[test]
    fn debuglink_with_a_wrong_crc_is_refused() {
        let dir = std::env::temp_dir().join(format!("memscope-debug-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("lib.so.debug"), b"not the right build").unwrap();
        let lib = dir.join("lib.so");
        let right = crc32fast::hash(b"not the right build");
        let r = DebugRef { build_id: None, link: Some(("lib.so.debug".into(), right ^ 1)), has_symtab: false };
        assert!(find(&lib, &r, &[]).is_none(), "a debug file that does not match must not be used");
        let r = DebugRef { link: Some(("lib.so.debug".into(), right)), ..r };
        assert_eq!(find(&lib, &r, &[]).map(|d| d.found), Some(Found::DebugLink));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
