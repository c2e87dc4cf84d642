//! NVML, NVIDIA's management library (what nvidia-smi uses), bound by hand for the five calls
//! needed (the `nvml-wrapper` crate links its own loader and brings much more). Layouts follow
//! `nvml.h`: every figure is in bytes. The NVML index is taken for the job's CUDA ordinal; the
//! tracer maps `CUDA_VISIBLE_DEVICES` onto it (see the tracer's `driver` module).

use std::ffi::{c_uint, c_ulonglong, c_void};

use crate::{DeviceReading, LoadError, ProcessUse, Source};

const SUCCESS: c_uint = 0;
const INSUFFICIENT_SIZE: c_uint = 7;
/// `NVML_VALUE_NOT_AVAILABLE` in a process's `usedGpuMemory` (no figure under some drivers and
/// in MIG mode).
const NOT_AVAILABLE: c_ulonglong = c_ulonglong::MAX;
/// Processes asked for at first; a longer list is asked again at its length.
const FIRST_ASK: usize = 64;

#[repr(C)]
#[derive(Default)]
struct MemoryV1 {
    total: c_ulonglong,
    free: c_ulonglong,
    used: c_ulonglong,
}

#[repr(C)]
#[derive(Default)]
struct MemoryV2 {
    version: c_uint,
    total: c_ulonglong,
    reserved: c_ulonglong,
    free: c_ulonglong,
    used: c_ulonglong,
}

/// `nvmlMemory_v2`: the struct's size and version 2 in the top byte.
const MEMORY_V2: c_uint = std::mem::size_of::<MemoryV2>() as c_uint | 2 << 24;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ProcessInfo {
    pid: c_uint,
    used_gpu_memory: c_ulonglong,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

type Device = *mut c_void;
type InitFn = unsafe extern "C" fn() -> c_uint;
type CountFn = unsafe extern "C" fn(*mut c_uint) -> c_uint;
type HandleFn = unsafe extern "C" fn(c_uint, *mut Device) -> c_uint;
type MemV1Fn = unsafe extern "C" fn(Device, *mut MemoryV1) -> c_uint;
type MemV2Fn = unsafe extern "C" fn(Device, *mut MemoryV2) -> c_uint;
type ProcsFn = unsafe extern "C" fn(Device, *mut c_uint, *mut ProcessInfo) -> c_uint;

pub struct Nvml {
    mem_v1: MemV1Fn,
    mem_v2: Option<MemV2Fn>,
    procs: ProcsFn,
    shutdown: Option<InitFn>,
    handles: Vec<(u32, usize)>,
    _library: libloading::Library,
}

fn symbol<T: Copy>(lib: &libloading::Library, name: &'static str) -> Option<T> {
    // SAFETY: the type is the one nvml.h declares for this name.
    unsafe { lib.get::<T>(name.as_bytes()) }.ok().map(|f| *f)
}

fn required<T: Copy>(lib: &libloading::Library, path: &str, name: &'static str) -> Result<T, LoadError> {
    symbol(lib, name).ok_or(LoadError::Symbol { path: path.to_owned(), symbol: name, what: "NVML" })
}

impl Nvml {
    pub fn load(path: &str) -> Result<Self, LoadError> {
        let lib = crate::open(path)?;
        let init: InitFn = required(&lib, path, "nvmlInit_v2")?;
        let count: CountFn = required(&lib, path, "nvmlDeviceGetCount_v2")?;
        let handle: HandleFn = required(&lib, path, "nvmlDeviceGetHandleByIndex_v2")?;
        let mem_v1: MemV1Fn = required(&lib, path, "nvmlDeviceGetMemoryInfo")?;
        let procs: ProcsFn = required(&lib, path, "nvmlDeviceGetComputeRunningProcesses_v3")?;
        let mut handles = Vec::new();
        // SAFETY: calls with nvml.h's signatures on valid out-pointers.
        unsafe {
            let code = init();
            if code != SUCCESS {
                return Err(LoadError::Init { call: "nvmlInit_v2", code: code.into() });
            }
            let mut n: c_uint = 0;
            let code = count(&mut n);
            if code != SUCCESS {
                return Err(LoadError::Init { call: "nvmlDeviceGetCount_v2", code: code.into() });
            }
            for index in 0..n {
                let mut device: Device = std::ptr::null_mut();
                if handle(index, &mut device) == SUCCESS {
                    handles.push((index, device as usize));
                }
            }
        }
        let mem_v2 = symbol(&lib, "nvmlDeviceGetMemoryInfo_v2");
        let shutdown = symbol(&lib, "nvmlShutdown");
        Ok(Self { mem_v1, mem_v2, procs, shutdown, handles, _library: lib })
    }

    /// (total, used): v2's `used` leaves out what the driver reserves for itself, v1's counts it.
    fn memory(&self, device: Device) -> Result<(u64, u64), String> {
        if let Some(v2) = self.mem_v2 {
            let mut m = MemoryV2 { version: MEMORY_V2, ..Default::default() };
            // SAFETY: the struct has nvml.h's layout and version.
            if unsafe { v2(device, &mut m) } == SUCCESS {
                return Ok((m.total, m.used + m.reserved));
            }
        }
        let mut m = MemoryV1::default();
        // SAFETY: as above.
        match unsafe { (self.mem_v1)(device, &mut m) } {
            SUCCESS => Ok((m.total, m.used)),
            code => Err(format!("memory info: {code}")),
        }
    }

    fn processes(&self, device: Device) -> Result<Vec<ProcessUse>, String> {
        let mut list = vec![ProcessInfo::default(); FIRST_ASK];
        for _ in 0..3 {
            let mut n = list.len() as c_uint;
            // SAFETY: `n` is the buffer's length.
            match unsafe { (self.procs)(device, &mut n, list.as_mut_ptr()) } {
                SUCCESS => {
                    list.truncate(n as usize);
                    return Ok(list
                        .iter()
                        .filter(|p| p.used_gpu_memory != NOT_AVAILABLE)
                        .map(|p| ProcessUse { pid: p.pid, bytes: p.used_gpu_memory })
                        .collect());
                }
                // Processes started since the count: ask again with room for a few more.
                INSUFFICIENT_SIZE => list.resize(n as usize + 8, ProcessInfo::default()),
                code => return Err(format!("running processes: {code}")),
            }
        }
        Err("running processes: the list kept growing".into())
    }
}

impl Source for Nvml {
    fn devices(&self) -> Vec<u32> {
        self.handles.iter().map(|(i, _)| *i).collect()
    }

    fn read(&self, index: u32) -> DeviceReading {
        let mut reading = DeviceReading { device: index, ..Default::default() };
        let Some(&(_, handle)) = self.handles.iter().find(|(i, _)| *i == index) else {
            reading.error = Some("no such device".into());
            return reading;
        };
        let device = handle as Device;
        let mut errors = Vec::new();
        match self.memory(device) {
            Ok((total, used)) => (reading.total, reading.used) = (Some(total), Some(used)),
            Err(e) => errors.push(e),
        }
        match self.processes(device) {
            Ok(list) => reading.processes = list,
            Err(e) => errors.push(e),
        }
        reading.error = (!errors.is_empty()).then(|| errors.join("; "));
        reading
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown {
            // SAFETY: paired with the successful nvmlInit_v2 of `load`.
            unsafe { shutdown() };
        }
    }
}
