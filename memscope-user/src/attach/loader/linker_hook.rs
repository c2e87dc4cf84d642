//! The dynamic linker's hook (`attach::linker`, the eBPF `objects_changed`): one uprobe per
//! linker file, on a multi-uprobe link where the kernel has them.

use std::os::fd::AsFd as _;

use aya::programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint};
use aya::programs::UProbe;

use super::{AttachError, LinkerHook, Tracer};
use crate::attach::libs::Library;
use crate::attach::uprobe_multi;

impl Tracer {
    /// Hooks a dynamic linker file's `_dl_debug_state` (`attach::linker`): from now on each
    /// change to the loaded objects of a process running it that the probes would trace sends a
    /// `Loaded` record. A file is tried once: later calls say what came of it.
    pub fn hook_linker(&mut self, ld: &Library) -> Result<LinkerHook, AttachError> {
        if let Some(hooked) = self.linker_files.get(&ld.file_id) {
            return Ok(if *hooked { LinkerHook::Known } else { LinkerHook::Refused });
        }
        self.linker_files.insert(ld.file_id, false);
        self.attach_linker_hook(ld)?;
        self.linker_files.insert(ld.file_id, true);
        Ok(LinkerHook::Added)
    }

    fn attach_linker_hook(&mut self, ld: &Library) -> Result<(), AttachError> {
        let symbol = crate::attach::linker::HOOK_SYMBOL;
        let offset = crate::attach::linker::hook_offset(&ld.path)?
            .ok_or_else(|| AttachError::NoLinkerHook { library: ld.shown.clone() })?;
        if let Ok(multi) = &self.multi {
            if let Ok(link) =
                uprobe_multi::attach(multi.linker.as_fd(), &ld.path, &[offset], &[0], None, false, self.scope_pid)
            {
                self.multi_links.push(link);
                return Ok(());
            }
        }
        let prog: &mut UProbe = self
            .ebpf
            .program_mut("objects_changed")
            .expect("loaded in Tracer::load")
            .try_into()
            .expect("a uprobe program");
        let point = UProbeAttachPoint { location: UProbeAttachLocation::AbsoluteOffset(offset), cookie: None };
        prog.attach(point, &ld.path, self.scope).map_err(|source| AttachError::Probe {
            kind: "linker probe",
            symbol: symbol.to_owned(),
            library: ld.shown.clone(),
            source: Box::new(source),
        })?;
        Ok(())
    }

    /// How many dynamic linker files are hooked.
    pub fn linkers_hooked(&self) -> usize {
        self.linker_files.values().filter(|h| **h).count()
    }
}
