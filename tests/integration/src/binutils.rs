//! A file's own tables as binutils reads them (`nm`, `readelf`): the independent side of the
//! checks on what `probes` says it would attach, never the tracer's ELF code.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

/// A binutils command's output on `file`, which must succeed.
pub fn tool(args: &[&str], file: &Path) -> String {
    let out = Command::new(args[0]).args(&args[1..]).arg(file).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Exported function addresses by name (without a symbol version), as `nm -D` reads them.
pub fn exported(file: &Path) -> HashMap<String, u64> {
    tool(&["nm", "-D", "--defined-only"], file)
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let (addr, _kind, name) = (w.next()?, w.next()?, w.next()?);
            let name = name.split('@').next().unwrap_or(name);
            Some((name.to_owned(), u64::from_str_radix(addr, 16).ok()?))
        })
        .collect()
}

/// Function addresses of `.symtab` by name (local ones included), as `readelf -sW` reads them.
pub fn symtab_functions(file: &Path) -> HashMap<String, u64> {
    tool(&["readelf", "-sW"], file)
        .lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w.len() >= 8 && w[3] == "FUNC").then(|| Some((w[7].to_owned(), u64::from_str_radix(w[1], 16).ok()?)))?
        })
        .collect()
}

/// A virtual address's file offset through the PT_LOAD headers as `readelf -lW` prints them
/// (a uprobe is placed by file offset).
pub fn file_offset(file: &Path, vaddr: u64) -> u64 {
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap();
    for l in tool(&["readelf", "-lW"], file).lines() {
        let w: Vec<&str> = l.split_whitespace().collect();
        if w.first() == Some(&"LOAD") {
            let (offset, start, memsz) = (hex(w[1]), hex(w[2]), hex(w[5]));
            if (start..start + memsz).contains(&vaddr) {
                return vaddr - start + offset;
            }
        }
    }
    panic!("{vaddr:#x} is in no PT_LOAD segment of {}", file.display());
}

/// One USDT note as `readelf -n` prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SdtNote {
    pub provider: String,
    pub name: String,
    pub location: u64,
    pub semaphore: u64,
    pub args: String,
}

/// The `stapsdt` notes of a file, as `readelf -n` prints them.
pub fn sdt_notes(file: &Path) -> Vec<SdtNote> {
    let hex = |s: &str| u64::from_str_radix(s.trim().trim_start_matches("0x"), 16).unwrap();
    let mut notes = Vec::new();
    let mut current: Option<SdtNote> = None;
    for line in tool(&["readelf", "-n"], file).lines().map(str::trim) {
        if let Some(p) = line.strip_prefix("Provider: ") {
            let empty =
                SdtNote { provider: p.to_owned(), name: String::new(), location: 0, semaphore: 0, args: String::new() };
            notes.extend(current.replace(empty));
        } else if let Some(note) = current.as_mut() {
            if let Some(n) = line.strip_prefix("Name: ") {
                note.name = n.to_owned();
            } else if let Some(rest) = line.strip_prefix("Location: ") {
                let parts: Vec<&str> = rest.split(", ").collect();
                note.location = hex(parts[0]);
                let semaphore = parts.iter().find_map(|p| p.strip_prefix("Semaphore: ")).unwrap_or("0");
                note.semaphore = hex(semaphore);
            } else if let Some(a) = line.strip_prefix("Arguments: ") {
                note.args = a.to_owned();
            }
        }
    }
    notes.extend(current);
    notes
}
