//! New pages written with `O_DIRECT`, a run of consecutive pages at a time.
//!
//! Why: a trace's pages are written once and not read again while it runs, and on the VMs this
//! runs on the page-cache copy of them was most of the store thread's time (perf, 500k calls/s
//! with stacks: 77 % in the kernel's `copy_folio_from_iter_atomic`; `dd` of 12 GB took 25-57 s of
//! system time through the cache, 4 GB with `oflag=direct` 0.8 s). Written straight to the
//! device, they cost the copy into an aligned buffer here and one write per run.
//!
//! Where the file system refuses `O_DIRECT` (at open, or a write fails with `EINVAL`: tmpfs on
//! older kernels, some FUSE and network file systems), or a page is not aligned as it needs, the
//! pages go through the cache as before. Either way, the caller must [`Self::flush`] before the
//! commit that makes them part of the DB.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// What `O_DIRECT` wants aligned: the buffer, the file offset and the length. 4 KiB covers every
/// logical block size in use.
const ALIGN: usize = 4096;
/// Bytes written per run at most.
const RUN: usize = 1 << 20;

/// Opens the DB for `O_DIRECT` writes, if its file system allows it. The descriptor must stay
/// open as long as SQLite's connection: closing any descriptor of a file drops the process's
/// POSIX locks on it, SQLite's included.
pub(super) fn open(path: &Path) -> Option<File> {
    std::fs::OpenOptions::new().write(true).custom_flags(libc::O_DIRECT).open(path).ok()
}

/// The run of consecutive new pages not written yet.
#[derive(Default)]
pub(super) struct Run {
    /// `RUN + ALIGN` bytes: the aligned window inside it is used (allocated at the first page).
    buf: Vec<u8>,
    /// The file offset of the run's first byte.
    at: u64,
    len: usize,
    /// `O_DIRECT` failed once: the rest goes through the cache.
    refused: bool,
}

impl Run {
    /// Writes `page` at offset `at`: queued while it extends the run, through the cache when
    /// `direct` is none or cannot take it.
    pub(super) fn write(&mut self, direct: Option<&File>, cached: &File, page: &[u8], at: u64) -> io::Result<()> {
        let usable = direct.is_some() && !self.refused;
        if !usable || !page.len().is_multiple_of(ALIGN) || !at.is_multiple_of(ALIGN as u64) || page.len() > RUN {
            self.flush(direct, cached)?;
            return cached.write_all_at(page, at);
        }
        if self.len > 0 && (self.at + self.len as u64 != at || self.len + page.len() > RUN) {
            self.flush(direct, cached)?;
        }
        if self.buf.is_empty() {
            self.buf = vec![0; RUN + ALIGN];
        }
        if self.len == 0 {
            self.at = at;
        }
        let start = self.buf.as_ptr().align_offset(ALIGN) + self.len;
        self.buf[start..start + page.len()].copy_from_slice(page);
        self.len += page.len();
        Ok(())
    }

    /// Writes the queued run.
    pub(super) fn flush(&mut self, direct: Option<&File>, cached: &File) -> io::Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        let start = self.buf.as_ptr().align_offset(ALIGN);
        let run = &self.buf[start..start + self.len];
        let written = match direct {
            Some(file) if !self.refused => match file.write_all_at(run, self.at) {
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    self.refused = true;
                    false
                }
                other => other.map(|()| true)?,
            },
            _ => false,
        };
        if !written {
            cached.write_all_at(run, self.at)?;
        }
        self.len = 0;
        Ok(())
    }

    /// Forgets a run a failed transaction left (its pages are past the committed end).
    pub(super) fn clear(&mut self) {
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(fill: u8, len: usize) -> Vec<u8> {
        vec![fill; len]
    }

    fn written(dir: &Path, direct: bool, writes: &[(u8, u64)], len: usize) -> Vec<u8> {
        let path = dir.join(format!("pages-{direct}"));
        let cached = std::fs::OpenOptions::new().create(true).truncate(true).write(true).open(&path).unwrap();
        let direct = if direct { open(&path) } else { None };
        let mut run = Run::default();
        for &(fill, at) in writes {
            run.write(direct.as_ref(), &cached, &page(fill, len), at).unwrap();
        }
        run.flush(direct.as_ref(), &cached).unwrap();
        std::fs::read(&path).unwrap()
    }

    #[test]
    fn runs_gaps_rewrites_and_a_full_run_land_as_the_cache_would_write_them() {
        let dir = std::env::temp_dir().join(format!("memscope-direct-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let len = 64 * 1024;
        let l = len as u64;
        // A run, a gap, a page written again, and more than one run's worth in a row.
        let mut writes = vec![(1, 0), (2, l), (3, 3 * l), (4, l)];
        writes.extend((0..20).map(|i| (10 + i as u8, (5 + i) * l)));
        let through_cache = written(&dir, false, &writes, len);
        let direct = written(&dir, true, &writes, len);
        assert_eq!(through_cache.len(), 25 * len);
        assert_eq!(through_cache[l as usize], 4, "the later write of a page wins");
        assert_eq!(through_cache[2 * len], 0, "the gap stays a hole");
        assert!(direct == through_cache, "O_DIRECT (or its fallback) writes the same bytes");
        // Unaligned pages go through the cache.
        assert_eq!(written(&dir, true, &[(7, 0), (8, 1000)], 1000), [vec![7; 1000], vec![8; 1000]].concat());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
