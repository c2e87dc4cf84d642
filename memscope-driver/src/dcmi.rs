//! DCMI, the Ascend driver's management library (what npu-smi uses), bound by hand: its header
//! is not published as a crate and only six calls are needed. Signatures and layouts follow the
//! driver's `dcmi_interface_api.h`: device memory comes back in MB, a process's usage in bytes.
//!
//! A job's allocations name the logical device id; DCMI asks by card and chip, so the map
//! between the two is built once, at load, from the card list (as msMemScope does).

use std::ffi::c_int;

use crate::{DeviceReading, LoadError, ProcessUse, Source, MIB};

/// Processes DCMI reports per device at most (`MAX_PROC_NUM_IN_DEVICE`).
const MAX_PROCS: usize = 64;
const MAX_CARDS: usize = 64;

#[repr(C)]
#[derive(Default)]
struct HbmInfo {
    memory_size: u64,
    freq: u32,
    memory_usage: u64,
    temp: c_int,
    bandwith_util_rate: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ProcMemInfo {
    proc_id: c_int,
    /// `unsigned long`: 64 bits on the LP64 targets (x86-64, arm64) this is built for.
    proc_mem_usage: u64,
}

type InitFn = unsafe extern "C" fn() -> c_int;
type CardListFn = unsafe extern "C" fn(*mut c_int, *mut c_int, c_int) -> c_int;
type DeviceNumFn = unsafe extern "C" fn(c_int, *mut c_int) -> c_int;
type LogicIdFn = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
type HbmFn = unsafe extern "C" fn(c_int, c_int, *mut HbmInfo) -> c_int;
type ProcFn = unsafe extern "C" fn(c_int, c_int, *mut ProcMemInfo, *mut c_int) -> c_int;

pub struct Dcmi {
    hbm: HbmFn,
    procs: ProcFn,
    /// logical id -> (card, chip), in logical id order.
    map: Vec<(u32, (c_int, c_int))>,
    _library: libloading::Library,
}

fn symbol<T: Copy>(lib: &libloading::Library, path: &str, names: &[&'static str]) -> Result<T, LoadError> {
    for name in names {
        // SAFETY: the type is the one the DCMI header declares for this name.
        if let Ok(f) = unsafe { lib.get::<T>(name.as_bytes()) } {
            return Ok(*f);
        }
    }
    Err(LoadError::Symbol { path: path.to_owned(), symbol: names[0], what: "DCMI" })
}

fn check(call: &'static str, code: c_int) -> Result<(), LoadError> {
    if code == 0 {
        Ok(())
    } else {
        Err(LoadError::Init { call, code: code.into() })
    }
}

impl Dcmi {
    pub fn load(path: &str) -> Result<Self, LoadError> {
        let lib = crate::open(path)?;
        let init: InitFn = symbol(&lib, path, &["dcmi_init"])?;
        let cards: CardListFn = symbol(&lib, path, &["dcmi_get_card_list", "dcmi_get_card_num_list"])?;
        let chips: DeviceNumFn = symbol(&lib, path, &["dcmi_get_device_num_in_card"])?;
        let logic: LogicIdFn = symbol(&lib, path, &["dcmi_get_device_logic_id"])?;
        let hbm: HbmFn = symbol(&lib, path, &["dcmi_get_device_hbm_info"])?;
        // The public call npu-smi makes, else the inner one it forwards to (msMemScope's).
        let procs: ProcFn = symbol(&lib, path, &["dcmi_get_device_resource_info", "dcmi_get_npu_proc_mem_info"])?;
        // SAFETY: calls with the header's signatures, on buffers of the lengths passed.
        let map = unsafe {
            check("dcmi_init", init())?;
            let (mut n, mut list) = (0, [0 as c_int; MAX_CARDS]);
            check("dcmi_get_card_list", cards(&mut n, list.as_mut_ptr(), MAX_CARDS as c_int))?;
            let mut map = Vec::new();
            for &card in list.iter().take((n.max(0) as usize).min(MAX_CARDS)) {
                let mut count = 0;
                check("dcmi_get_device_num_in_card", chips(card, &mut count))?;
                for chip in 0..count {
                    let mut id = 0;
                    check("dcmi_get_device_logic_id", logic(&mut id, card, chip))?;
                    map.push((id as u32, (card, chip)));
                }
            }
            map
        };
        let mut map = map;
        map.sort_unstable();
        Ok(Self { hbm, procs, map, _library: lib })
    }

    fn processes(&self, card: c_int, chip: c_int) -> Result<Vec<ProcessUse>, String> {
        let mut list = [ProcMemInfo::default(); MAX_PROCS];
        let mut n: c_int = 0;
        // SAFETY: the buffer holds the most entries the library writes.
        let code = unsafe { (self.procs)(card, chip, list.as_mut_ptr(), &mut n) };
        if code != 0 {
            return Err(format!("process memory: {code}"));
        }
        Ok(list
            .iter()
            .take((n.max(0) as usize).min(MAX_PROCS))
            .map(|p| ProcessUse { pid: p.proc_id as u32, bytes: p.proc_mem_usage })
            .collect())
    }
}

impl Source for Dcmi {
    fn devices(&self) -> Vec<u32> {
        self.map.iter().map(|(id, _)| *id).collect()
    }

    fn read(&self, device: u32) -> DeviceReading {
        let mut reading = DeviceReading { device, ..Default::default() };
        let Some(&(_, (card, chip))) = self.map.iter().find(|(id, _)| *id == device) else {
            reading.error = Some("no such logical device".into());
            return reading;
        };
        let mut hbm = HbmInfo::default();
        // SAFETY: the struct has the header's layout.
        let code = unsafe { (self.hbm)(card, chip, &mut hbm) };
        let mut errors = Vec::new();
        if code == 0 {
            reading.total = Some(hbm.memory_size * MIB);
            reading.used = Some(hbm.memory_usage * MIB);
        } else {
            errors.push(format!("hbm: {code}"));
        }
        match self.processes(card, chip) {
            Ok(list) => reading.processes = list,
            Err(e) => errors.push(e),
        }
        reading.error = (!errors.is_empty()).then(|| errors.join("; "));
        reading
    }
}
