//! Reproducible archives and checksums for the release: tar (gzipped or not) with every entry
//! owned by root and dated at the release's timestamp, in a fixed order, so two builds of one
//! commit give the same bytes; and SHA-256 in `sha256sum`'s format.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use sha2::{Digest as _, Sha256};

/// What an archive entry is made of.
pub enum Content {
    Dir,
    File(PathBuf),
}

pub struct Entry {
    /// Path inside the archive, relative, `/`-separated.
    pub path: String,
    pub mode: u32,
    pub content: Content,
}

impl Entry {
    pub fn dir(path: &str, mode: u32) -> Self {
        Self { path: path.to_owned(), mode, content: Content::Dir }
    }

    pub fn file(path: &str, mode: u32, source: &Path) -> Self {
        Self { path: path.to_owned(), mode, content: Content::File(source.to_owned()) }
    }
}

/// Every file and folder under `dir`, as entries under `prefix` (`""`: at the archive's top), in
/// name order.
pub fn tree(dir: &Path, prefix: &str) -> anyhow::Result<Vec<Entry>> {
    let mut entries = if prefix.is_empty() { Vec::new() } else { vec![Entry::dir(prefix, 0o755)] };
    let mut children: Vec<_> =
        std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?.collect::<Result<_, _>>()?;
    children.sort_by_key(|c| c.file_name());
    for child in children {
        let base = child.file_name().to_string_lossy().into_owned();
        let name = if prefix.is_empty() { base } else { format!("{prefix}/{base}") };
        let path = child.path();
        if child.file_type()?.is_dir() {
            entries.extend(tree(&path, &name)?);
        } else {
            let executable = std::os::unix::fs::PermissionsExt::mode(&child.metadata()?.permissions()) & 0o111 != 0;
            entries.push(Entry::file(&name, if executable { 0o755 } else { 0o644 }, &path));
        }
    }
    Ok(entries)
}

/// The entries as an uncompressed tar.
pub fn tar(entries: &[Entry], mtime: u64) -> anyhow::Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    for entry in entries {
        let mut header = tar::Header::new_gnu();
        header.set_mode(entry.mode);
        header.set_mtime(mtime);
        header.set_uid(0);
        header.set_gid(0);
        match &entry.content {
            Content::Dir => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_size(0);
                builder.append_data(&mut header, format!("{}/", entry.path), std::io::empty())?;
            }
            Content::File(source) => {
                let data = std::fs::read(source).with_context(|| format!("cannot read {}", source.display()))?;
                header.set_size(data.len() as u64);
                builder.append_data(&mut header, &entry.path, data.as_slice())?;
            }
        }
    }
    Ok(builder.into_inner()?)
}

pub fn gzip(data: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    encoder.write_all(data)?;
    Ok(encoder.finish()?)
}

pub fn sha256(data: &[u8]) -> String {
    Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

/// `sha256sum`'s lines (`HEX  NAME`) for these files, named relative to `base`; `sha256sum -c`
/// run in `base` checks them.
pub fn checksums(base: &Path, files: &[PathBuf]) -> anyhow::Result<String> {
    let mut text = String::new();
    for file in files {
        let data = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
        let name = file.strip_prefix(base).unwrap_or(file);
        text.push_str(&format!("{}  {}\n", sha256(&data), name.display()));
    }
    Ok(text)
}
