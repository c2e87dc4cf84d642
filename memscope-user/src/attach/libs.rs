//! Which library files carry the traced APIs.
//!
//! Sources, in the order a user would expect them to win:
//! 1. `--lib PATH` (a file of any name, or a folder to scan);
//! 2. what the process has mapped (`/proc/PID/maps`), opened through `/proc/PID/root` so a
//!    containerised target's files resolve in its own mount namespace;
//!    The process's executable too, when it links the CUDA runtime statically (`cudart_static`:
//!    it defines `cudaMalloc` itself). A launched program is not running yet: it is looked into
//!    itself, and a Python interpreter is asked where its `torch`/`torch_npu` packages are;
//! 3. `$ASCEND_HOME_PATH/lib64` (and `runtime/lib64`) of the target's environment, so libraries
//!    it will dlopen later are probed before their first call; in launch mode also the
//!    `LD_LIBRARY_PATH` folders the program will search; `$ATB_HOME_PATH/lib` likewise, where
//!    Ascend Transformer Boost keeps `libatb.so`.
//!
//! Files are identified by (device, inode): the same file reached through two paths (symlinks,
//! `/proc/PID/root`) is one library, and uprobing it twice would double every event.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use memscope_core::apis::{Api, Family};

use super::file::{check_regular, FileError};

/// Where a library was found (shown to the user and stored with the probes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    UserPath,
    Mapped {
        pid: u32,
    },
    AscendHome,
    /// `$ATB_HOME_PATH/lib` (set by ATB's set_env.sh).
    AtbHome,
    LibraryPath,
    /// Named in another traced library's `DT_NEEDED` (the runtime needs the driver).
    Dependency,
    /// The launched program itself, which links the CUDA runtime statically.
    Executable,
    /// The `lib` folder of a framework package (`torch`, `torch_npu`) the launched Python
    /// interpreter would import.
    PythonPackage,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Library {
    /// A path this process can open and attach to.
    pub path: PathBuf,
    /// The path as the target sees it.
    pub shown: String,
    /// (st_dev, st_ino).
    pub file_id: (u64, u64),
    pub origin: Origin,
}

/// Whether a file name is one of the traced families' libraries (`libascendcl.so`,
/// `libascendcl.so.1`, ...).
pub fn is_known_name(name: &OsStr) -> bool {
    Family::ALL.into_iter().any(|f| is_family_file(name, f))
}

/// Whether a file name is one of `family`'s libraries (versioned or not).
pub fn is_family_file(name: &OsStr, family: Family) -> bool {
    let name = name.as_bytes();
    family.library_names().iter().any(|known| {
        let known = known.as_bytes();
        name == known || (name.starts_with(known) && name.get(known.len()) == Some(&b'.'))
    })
}

/// Whether a file is our markers package's native module (`.../memscope/_native*.so`), whose
/// USDT notes the tracer attaches. Matched by name so that the hundreds of other libraries a
/// Python process maps are not opened and parsed for notes.
pub fn is_markers_module(path: &Path) -> bool {
    let in_package = path.parent().and_then(Path::file_name).is_some_and(|d| d == "memscope");
    let name = path.file_name().map(OsStr::as_bytes).unwrap_or_default();
    in_package && name.starts_with(b"_native") && name.ends_with(b".so")
}

/// Every symbol worth looking up: each API's public name and its `...Impl`, and the name
/// prefixes of internals found whatever their parameters.
pub fn wanted_symbols() -> super::elf::Wanted {
    super::elf::Wanted {
        names: Api::all().flat_map(|d| d.api.symbols()).collect(),
        prefixes: Api::all().filter_map(|d| d.api.symbol_prefix()).map(str::to_owned).collect(),
    }
}

/// A candidate, if it is a regular file (devices and FIFOs a target names are never opened).
fn library(path: PathBuf, shown: String, origin: Origin) -> Option<Library> {
    let meta = std::fs::metadata(&path).ok()?;
    meta.is_file().then(|| Library { path, shown, file_id: (meta.dev(), meta.ino()), origin })
}

/// Known libraries in one folder (not recursive).
pub fn in_dir(dir: &Path, origin: &Origin) -> Vec<Library> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut found: Vec<Library> = entries
        .filter_map(Result::ok)
        .filter(|e| is_known_name(&e.file_name()))
        .filter_map(|e| library(e.path(), e.path().display().to_string(), origin.clone()))
        .collect();
    found.sort_by(|a, b| a.path.cmp(&b.path));
    found
}

/// `--lib PATH`: a file (any name: it is looked into for the API symbols) or a folder. Anything
/// else (a device, a FIFO) is refused by name, before it is opened.
pub fn from_user_path(path: &Path) -> Result<Vec<Library>, FileError> {
    let meta = std::fs::metadata(path).map_err(|source| FileError::Open { path: path.to_owned(), source })?;
    if meta.is_dir() {
        return Ok(in_dir(path, &Origin::UserPath));
    }
    let meta = check_regular(path)?;
    Ok(vec![Library {
        path: path.to_owned(),
        shown: path.display().to_string(),
        file_id: (meta.dev(), meta.ino()),
        origin: Origin::UserPath,
    }])
}

/// The symbol whose definition marks a statically linked CUDA runtime.
const STATIC_RUNTIME_SYMBOL: &str = "cudaMalloc";

/// `path` as a library, if it is an executable that links the CUDA runtime statically. Each
/// file is looked into once per tracer: every traced process maps its executable, and most
/// define no runtime function.
pub fn static_runtime(path: PathBuf, shown: String, origin: Origin) -> Option<Library> {
    static SEEN: std::sync::Mutex<std::collections::BTreeMap<(u64, u64), bool>> =
        std::sync::Mutex::new(std::collections::BTreeMap::new());
    let lib = library(path, shown, origin)?;
    let mut seen = SEEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let defines = *seen.entry(lib.file_id).or_insert_with(|| {
        let wanted: std::collections::HashSet<String> = [STATIC_RUNTIME_SYMBOL.to_owned()].into();
        super::file::map_library(&lib.path)
            .ok()
            .and_then(|data| super::elf::ElfSymbols::parse(&data, &wanted.into()).ok())
            .is_some_and(|symbols| symbols.get(STATIC_RUNTIME_SYMBOL).is_some())
    });
    defines.then_some(lib)
}

/// The framework packages whose libraries a Python job loads when it imports them.
const PYTHON_PACKAGES: [&str; 2] = ["torch", "torch_npu"];

/// How long the interpreter may take to say where its packages are.
const PYTHON_ASK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether a launched program is a Python interpreter (`python`, `python3`, `python3.11`).
pub fn is_python(program: &Path) -> bool {
    program.file_name().is_some_and(|n| n.as_bytes().starts_with(b"python"))
}

/// Known libraries in the `lib` folders of the framework packages `python` would import, asked
/// of the interpreter itself without importing them: a launched job has not imported torch when
/// the probes go live, and its allocator's first calls are then seen too. Nothing when the
/// interpreter has none of them, fails, or takes longer than [`PYTHON_ASK_TIMEOUT`].
pub fn python_packages(python: &Path) -> Vec<Library> {
    let names = PYTHON_PACKAGES.map(|n| format!("'{n}'")).join(", ");
    let ask = format!(
        "import importlib.util as u, os\nfor n in ({names},):\n    s = u.find_spec(n)\n    if s and s.origin: print(os.path.dirname(s.origin))"
    );
    let Ok(mut child) = std::process::Command::new(python)
        .args(["-c", &ask])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
    else {
        return Vec::new();
    };
    let deadline = std::time::Instant::now() + PYTHON_ASK_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if std::time::Instant::now() < deadline => std::thread::sleep(std::time::Duration::from_millis(5)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Vec::new();
            }
        }
    }
    let mut text = String::new();
    let _ = std::io::Read::read_to_string(&mut child.stdout.take().expect("piped"), &mut text);
    text.lines().flat_map(|dir| in_dir(&Path::new(dir).join("lib"), &Origin::PythonPackage)).collect()
}

/// A path as `/proc/PID/maps` shows it, as the file system names it. The kernel writes a newline
/// in a mapped path as `\012` (the one character it escapes there), so a runtime loaded from a
/// folder with a newline in its name was looked for under the wrong name and never probed. A
/// name that really holds the text `\012` keeps it: the unescaped form is taken only if it exists
/// in the process's root.
pub fn mapped_path(pid: u32, shown: &str) -> std::borrow::Cow<'_, str> {
    if !shown.contains("\\012") {
        return shown.into();
    }
    let real = shown.replace("\\012", "\n");
    if Path::new(&format!("/proc/{pid}/root{real}")).exists() {
        real.into()
    } else {
        shown.into()
    }
}

/// Known libraries mapped executable in a process, and its executable if it links the CUDA
/// runtime statically.
pub fn from_maps(pid: u32) -> std::io::Result<Vec<Library>> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
    let mut found = Vec::new();
    for line in maps.lines() {
        // address perms offset dev inode path; the path may contain spaces.
        let perms = line.split_ascii_whitespace().nth(1).unwrap_or("");
        let Some(at) = line.find(" /") else { continue };
        let path = &line[at + 1..];
        if !perms.contains('x') || path.ends_with(" (deleted)") {
            continue;
        }
        let path = &*mapped_path(pid, path);
        let file = Path::new(path);
        let through_root = PathBuf::from(format!("/proc/{pid}/root{path}"));
        if exe.as_deref() == Some(file) && !file.file_name().is_some_and(is_known_name) {
            found.extend(static_runtime(through_root, path.to_owned(), Origin::Mapped { pid }));
            continue;
        }
        if !file.file_name().is_some_and(is_known_name) && !is_markers_module(file) {
            continue;
        }
        if let Some(lib) = library(through_root, path.to_owned(), Origin::Mapped { pid }) {
            found.push(lib);
        }
    }
    Ok(dedup(found))
}

/// Known libraries that `lib` declares it needs, found the way the dynamic loader would look
/// first: its `DT_RUNPATH`/`DT_RPATH` folders (with `$ORIGIN` expanded), then its own folder.
/// Probing them before the program loads them means their first calls are seen too.
pub fn dependencies(lib: &Library) -> Vec<Library> {
    let Ok(data) = super::file::map_library(&lib.path) else { return Vec::new() };
    let Ok(deps) = crate::attach::elf::dependencies(&data) else { return Vec::new() };
    let origin = lib.path.parent().unwrap_or(Path::new("/")).to_owned();
    let mut dirs: Vec<PathBuf> = deps
        .search
        .iter()
        .map(|d| PathBuf::from(d.replace("${ORIGIN}", "$ORIGIN").replace("$ORIGIN", &origin.to_string_lossy())))
        .collect();
    dirs.push(origin);
    let mut found = Vec::new();
    for name in deps.needed.iter().filter(|n| is_known_name(OsStr::new(n))) {
        if let Some(dep) =
            dirs.iter().find_map(|d| library(d.join(name), d.join(name).display().to_string(), Origin::Dependency))
        {
            found.push(dep);
        }
    }
    found
}

/// Adds the known dependencies of every library (one level: the runtime needs the driver).
pub fn with_dependencies(libs: Vec<Library>) -> Vec<Library> {
    let deps: Vec<Library> = libs.iter().flat_map(dependencies).collect();
    dedup(libs.into_iter().chain(deps).collect())
}

/// The runtime folders under an `ASCEND_HOME_PATH`.
pub fn ascend_home_dirs(home: &Path) -> Vec<PathBuf> {
    vec![home.join("lib64"), home.join("runtime").join("lib64")]
}

/// A process's environment (`/proc/PID/environ`).
pub fn process_env(pid: u32) -> std::io::Result<HashMap<String, String>> {
    let raw = std::fs::read(format!("/proc/{pid}/environ"))?;
    Ok(raw
        .split(|b| *b == 0)
        .filter_map(|kv| {
            let kv = String::from_utf8_lossy(kv);
            let (k, v) = kv.split_once('=')?;
            Some((k.to_owned(), v.to_owned()))
        })
        .collect())
}

/// Libraries under `ASCEND_HOME_PATH` and `ATB_HOME_PATH` and, if given, the `LD_LIBRARY_PATH` folders, of an
/// environment. `root` prefixes the paths (a target's `/proc/PID/root`).
pub fn from_env(env: &HashMap<String, String>, root: &Path, include_ld_path: bool) -> Vec<Library> {
    let rooted = |p: &str| root.join(p.trim_start_matches('/'));
    let mut found = Vec::new();
    if let Some(home) = env.get("ASCEND_HOME_PATH").filter(|h| h.starts_with('/')) {
        for dir in ascend_home_dirs(Path::new(home)) {
            found.extend(in_dir(&rooted(&dir.to_string_lossy()), &Origin::AscendHome));
        }
    }
    if let Some(home) = env.get("ATB_HOME_PATH").filter(|h| h.starts_with('/')) {
        found.extend(in_dir(&rooted(&Path::new(home).join("lib").to_string_lossy()), &Origin::AtbHome));
    }
    if include_ld_path {
        for dir in
            env.get("LD_LIBRARY_PATH").map(String::as_str).unwrap_or("").split(':').filter(|d| d.starts_with('/'))
        {
            found.extend(in_dir(&rooted(dir), &Origin::LibraryPath));
        }
    }
    // Shown as the target sees it, not through our view of its root.
    for lib in &mut found {
        if let Ok(inside) = lib.path.strip_prefix(root) {
            lib.shown = Path::new("/").join(inside).display().to_string();
        }
    }
    dedup(found)
}

/// Keeps the first library per file, ordered outer layer first.
///
/// Probes of an outer layer (the runtime) must be live before those of an inner one (the driver):
/// a driver call is reported inside the runtime call that made it only if that call's entry was
/// seen. Attaching in this order keeps the window where inner calls look standalone to the few
/// calls already running at attach time.
pub fn dedup(libs: Vec<Library>) -> Vec<Library> {
    let mut seen = std::collections::HashSet::new();
    let mut libs: Vec<Library> = libs.into_iter().filter(|l| seen.insert(l.file_id)).collect();
    libs.sort_by_key(|l| std::path::Path::new(&l.shown).file_name().map_or(u8::MAX, layer_rank));
    libs
}

/// 0 for the outermost layer's libraries; unknown names (a `--lib` file) go first, as they may
/// hold anything.
fn layer_rank(name: &OsStr) -> u8 {
    let name = name.as_bytes();
    Family::ALL
        .iter()
        .position(|f| f.library_names().iter().any(|known| name.starts_with(known.as_bytes())))
        .map_or(0, |i| i as u8 + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runtime_mapped_from_a_folder_with_a_newline_in_its_name_is_found() {
        // The file need only be a mapped, executable regular file with a known name: mapped here,
        // by this test process, as the job would map the real runtime.
        let dir = std::env::temp_dir().join(format!("memscope-nl-{}/with\nnewline", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lib = dir.join("libacl_rt.so");
        std::fs::write(&lib, vec![0u8; 4096]).unwrap();
        let file = std::fs::File::open(&lib).unwrap();
        use std::os::fd::AsRawFd as _;
        // SAFETY: a fresh private read+exec mapping of a 4 KiB file, unmapped below.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_EXEC,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(at, libc::MAP_FAILED);
        let found = from_maps(std::process::id()).unwrap();
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(at, 4096) };
        let ours: Vec<&Library> = found.iter().filter(|l| l.shown.ends_with("newline/libacl_rt.so")).collect();
        assert_eq!(ours.len(), 1, "{found:?}");
        assert_eq!(ours[0].shown, lib.display().to_string(), "named as the file system names it");
        let _ = std::fs::remove_dir_all(dir.parent().unwrap());
    }

    #[test]
    fn known_names_include_versioned_files_only() {
        assert!(is_known_name(OsStr::new("libascendcl.so")));
        assert!(is_known_name(OsStr::new("libascendcl.so.1")));
        assert!(is_known_name(OsStr::new("libacl_rt_impl.so")));
        assert!(!is_known_name(OsStr::new("libascendcl.so_backup")));
        assert!(!is_known_name(OsStr::new("libascendclx.so")));
        assert!(!is_known_name(OsStr::new("libc.so.6")));
    }

    #[test]
    fn same_file_through_a_symlink_is_one_library() {
        let dir = std::env::temp_dir().join(format!("memscope-libs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("lib64")).unwrap();
        std::fs::write(dir.join("lib64/libascendcl.so"), b"x").unwrap();
        std::os::unix::fs::symlink("libascendcl.so", dir.join("lib64/libascendcl.so.1")).unwrap();
        std::fs::write(dir.join("lib64/libother.so"), b"x").unwrap();
        let env: HashMap<String, String> = [("ASCEND_HOME_PATH".to_owned(), dir.display().to_string())].into();
        let libs = from_env(&env, Path::new("/"), false);
        assert_eq!(libs.len(), 1, "{libs:?}");
        assert_eq!(libs[0].origin, Origin::AscendHome);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn atb_home_lib_is_searched() {
        let dir = std::env::temp_dir().join(format!("memscope-libs-atb-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("lib")).unwrap();
        std::fs::write(dir.join("lib/libatb.so"), b"x").unwrap();
        let env: HashMap<String, String> = [("ATB_HOME_PATH".to_owned(), dir.display().to_string())].into();
        let libs = from_env(&env, Path::new("/"), false);
        assert_eq!(libs.len(), 1, "{libs:?}");
        assert_eq!((libs[0].origin.clone(), libs[0].path.clone()), (Origin::AtbHome, dir.join("lib/libatb.so")));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_user_path_that_is_not_a_file_or_folder_is_named_as_such() {
        let err = from_user_path(Path::new("/dev/zero")).unwrap_err().to_string();
        assert_eq!(err, "/dev/zero is not a regular file (it is a character device)");
        let err = from_user_path(Path::new("/nonexistent/libascendcl.so")).unwrap_err();
        assert!(matches!(err, FileError::Open { .. }), "{err}");
    }

    #[test]
    fn a_fifo_named_like_a_library_in_a_folder_is_not_a_candidate() {
        let dir = std::env::temp_dir().join(format!("memscope-libs-fifo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let c = std::ffi::CString::new(dir.join("libascendcl.so.9").as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(from_user_path(&dir).unwrap().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn maps_of_this_process_have_no_ascend_library() {
        assert!(from_maps(std::process::id()).unwrap().is_empty());
    }

    #[test]
    fn wanted_symbols_cover_public_and_impl_names() {
        let w = wanted_symbols().names;
        assert!(w.contains("aclrtMalloc") && w.contains("aclrtMallocImpl") && w.contains("aclrtUnmapMemImpl"));
        assert!(w.contains("cuMemAlloc_v2") && !w.contains("pytorch:malloc"), "USDT rows are no symbols");
    }
}
