//! Callers' addresses to the libraries that made the calls ([`Library`]), for the owners of
//! memory that communication and math libraries take themselves.
//!
//! An address is looked up in its process's mappings (blazesym's `Normalizer`, the same reader
//! the stacks use) once, then remembered: a job allocates from a few dozen call sites, so nearly
//! every call is a hash lookup. The mappings are read again, once per new address, when an
//! address lies in none of them (a library `dlopen`ed since); a process that exited keeps what
//! was learnt of it until its exit record, and an address first seen after that names no library.

use blazesym::normalize::{Normalizer, UserMeta};
use blazesym::Pid;
use foldhash::HashMap;

use crate::apis::libraries::Library;

#[derive(Default)]
pub struct Callers {
    /// By process: each caller's address seen, and the library it lies in, if one of ours.
    known: HashMap<u32, HashMap<u64, Option<Library>>>,
    normalizers: HashMap<u32, Normalizer>,
}

fn normalizer() -> Normalizer {
    Normalizer::builder().enable_vma_caching(true).enable_build_ids(false).build()
}

/// What one lookup found: the file's library (or none of ours), or no mapping at all.
enum Found {
    File(Option<Library>),
    Unmapped,
}

impl Callers {
    /// The library of the call made from `addr` (a return address) in process `pid`.
    pub fn library(&mut self, pid: u32, addr: u64) -> Option<Library> {
        if let Some(&known) = self.known.get(&pid).and_then(|m| m.get(&addr)) {
            return known;
        }
        let mut found = self.lookup(pid, addr);
        if matches!(found, Found::Unmapped) && std::path::Path::new(&format!("/proc/{pid}")).exists() {
            self.normalizers.insert(pid, normalizer());
            found = self.lookup(pid, addr);
        }
        let lib = match found {
            Found::File(lib) => lib,
            Found::Unmapped => None,
        };
        self.known.entry(pid).or_default().insert(addr, lib);
        lib
    }

    fn lookup(&mut self, pid: u32, addr: u64) -> Found {
        let normalizer = self.normalizers.entry(pid).or_insert_with(normalizer);
        // The call instruction is just before the address it returns to, which may already be
        // the next function (or past the mapping's end, for a call that never returns).
        let Ok(out) = normalizer.normalize_user_addrs(Pid::from(pid), &[addr.saturating_sub(1)]) else {
            return Found::Unmapped;
        };
        let meta = out.outputs.first().and_then(|&(_, meta)| out.meta.get(meta));
        match meta {
            Some(UserMeta::Elf(elf)) => Found::File(Library::of_file(&elf.path)),
            // In no mapping the process had when its mappings were read.
            Some(UserMeta::Unknown(_)) | None => Found::Unmapped,
            Some(_) => Found::File(None),
        }
    }

    /// Forgets a process (it exited or replaced its image: its addresses may mean other files).
    pub fn process_exited(&mut self, pid: u32) {
        self.known.remove(&pid);
        self.normalizers.remove(&pid);
    }
}
