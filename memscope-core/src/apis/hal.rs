//! The driver's memory API (`ascend_hal.h`, libascend_hal.so), the layer every device allocation
//! ends in.
//!
//! `halMemAlloc(void **pp, unsigned long long size, unsigned long long flag)`: the flag encodes the
//! device (bits 0-9), the memory type (bits 10-13: svm, dev, host, dvpp), huge pages (bit 17),
//! giant pages (bit 31) and the module that asked (bits 56-63), as msMemScope decodes it.
//! `halMemCreate(drv_mem_handle_t **handle, size_t size, const struct drv_mem_prop *prop,
//! uint64_t flag)`: `drv_mem_prop { u32 side; u32 devid; u32 module_id; u32 pg_type; u32 mem_type;
//! u64 reserve; }`.

use memscope_common::spec::{layer, FieldRead};

use super::op::{DriverInfo, Op, PageType, Space};
use super::{named, spec, with_caller, Api, ApiDef, Family, Tracking, RESULT};
use crate::raw::RawCall;

/// `DRV_ERROR_OUT_OF_MEMORY`.
pub const DRV_ERROR_OUT_OF_MEMORY: i32 = 6;

/// The module ids of CANN's log/ownership enum (`ascend_hal_define.h` / slog), by id. Owners of
/// driver memory are written `CANN@<name>` as msMemScope does.
pub const MODULES: [&str; 75] = [
    "SLOG",
    "IDEDD",
    "IDEDH",
    "HCCL",
    "FMK",
    "HIAIENGINE",
    "DVPP",
    "RUNTIME",
    "CCE",
    "HDC",
    "DRV",
    "MDCFUSION",
    "MDCLOCATION",
    "MDCPERCEPTION",
    "MDCFSM",
    "MDCCOMMON",
    "MDCMONITOR",
    "MDCBSWP",
    "MDCDEFAULT",
    "MDCSC",
    "MDCPNC",
    "MLL",
    "DEVMM",
    "KERNEL",
    "LIBMEDIA",
    "CCECPU",
    "ASCENDDK",
    "ROS",
    "HCCP",
    "ROCE",
    "TEFUSION",
    "PROFILING",
    "DP",
    "APP",
    "TS",
    "TSDUMP",
    "AICPU",
    "LP",
    "TDT",
    "FE",
    "MD",
    "MB",
    "ME",
    "IMU",
    "IMP",
    "GE",
    "MDCFUSA",
    "CAMERA",
    "ASCENDCL",
    "TEEOS",
    "ISP",
    "SIS",
    "HSM",
    "DSS",
    "PROCMGR",
    "BBOX",
    "AIVECTOR",
    "TBE",
    "FV",
    "MDCMAP",
    "TUNE",
    "HSS",
    "FFTS",
    "OP",
    "UDF",
    "HICAID",
    "TSYNC",
    "AUDIO",
    "TPRT",
    "ASCENDCKERNEL",
    "ASYS",
    "ATRACE",
    "RTC",
    "SYSMONITOR",
    "AML",
];

/// `CANN@<module>`, or `CANN@UNKNOWN` for ids outside the table.
pub fn owner(module: u16) -> String {
    format!("CANN@{}", MODULES.get(usize::from(module)).copied().unwrap_or("UNKNOWN"))
}

/// The parts of a `halMemAlloc` flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flag {
    pub device: u32,
    /// 0 svm, 1 device, 2 host, 3 dvpp.
    pub mem_type: u32,
    pub page: PageType,
    pub module: u16,
}

pub const MEM_TYPE_HOST: u32 = 2;

pub fn decode_flag(flag: u64) -> Flag {
    let page = if flag & (1 << 31) != 0 {
        PageType::Giant
    } else if flag & (1 << 17) != 0 {
        PageType::Huge
    } else {
        PageType::Normal
    };
    Flag { device: (flag & 0x3ff) as u32, mem_type: ((flag >> 10) & 0xf) as u32, page, module: (flag >> 56) as u16 }
}

fn oom(status: i32) -> bool {
    status == DRV_ERROR_OUT_OF_MEMORY
}

const fn row(
    api: Api,
    symbol: &'static str,
    spec: memscope_common::spec::ProbeSpec,
    decode: fn(&RawCall) -> Op,
) -> ApiDef {
    // A driver call inside a runtime call is the runtime call's fact (the driver's device,
    // flag, module and size are the truth); on its own it is a fact of its own.
    let tracking = Tracking { folds_into_outer: true, ..Tracking::NONE };
    ApiDef { tracking, out_of_memory: oom, ..ApiDef::plain(api, symbol, Family::Hal, spec, decode) }
}

/// `halMemCreate(*handle, size, prop, flag)`'s reads: `*handle` at return, then `prop`'s
/// `{side, devid}` and `{module_id, pg_type}` as two u64 reads at entry.
#[derive(Clone, Copy)]
enum Create {
    Handle,
    SideDevice,
    ModulePage,
}

const _: () = assert!(Create::Handle as usize == RESULT, "RawCall::result reads the handle");

pub(super) static TABLE: [ApiDef; 4] = [
    row(
        Api::HalMemAlloc,
        "halMemAlloc",
        with_caller(spec(layer::HAL, layer::RUNTIME, &[FieldRead::arg_at_exit(0, 0, 8)])),
        |c| {
            let flag = decode_flag(c.args[2]);
            Op::Malloc {
                space: if flag.mem_type == MEM_TYPE_HOST { Space::Host } else { Space::Device },
                size: c.args[1],
                ptr: c.result(),
                policy: None,
                device: Some(flag.device),
                module: Some(flag.module),
                driver: Some(DriverInfo {
                    api: Api::HalMemAlloc,
                    flag: Some(c.args[2]),
                    size: c.args[1],
                    module: Some(flag.module),
                    page: Some(flag.page),
                }),
            }
        },
    ),
    row(Api::HalMemFree, "halMemFree", spec(layer::HAL, layer::RUNTIME, &[]), |c| Op::Free {
        space: Space::Device,
        ptr: c.args[0],
        driver: Some(DriverInfo { api: Api::HalMemFree, flag: None, size: 0, module: None, page: None }),
    }),
    row(
        Api::HalMemCreate,
        "halMemCreate",
        with_caller(spec(
            layer::HAL,
            layer::RUNTIME,
            &named(&[
                (Create::Handle as usize, FieldRead::arg_at_exit(0, 0, 8)),
                (Create::SideDevice as usize, FieldRead::arg_at_entry(2, 0, 8)),
                (Create::ModulePage as usize, FieldRead::arg_at_entry(2, 8, 8)),
            ]),
        )),
        |c| {
            let side_dev = c.field(Create::SideDevice as usize);
            let module_page = c.field(Create::ModulePage as usize);
            let module = module_page.map(|v| (v & 0xffff_ffff) as u16);
            let page = module_page.map(|v| match v >> 32 {
                1 => PageType::Huge,
                2 => PageType::Giant,
                _ => PageType::Normal,
            });
            Op::MallocPhysical {
                size: c.args[1],
                handle: c.result(),
                device: side_dev.map(|v| (v >> 32) as u32),
                flags: c.args[3],
                driver: Some(DriverInfo {
                    api: Api::HalMemCreate,
                    flag: Some(c.args[3]),
                    size: c.args[1],
                    module,
                    page,
                }),
            }
        },
    ),
    row(Api::HalMemRelease, "halMemRelease", spec(layer::HAL, layer::RUNTIME, &[]), |c| Op::FreePhysical {
        handle: c.args[0],
        driver: Some(DriverInfo { api: Api::HalMemRelease, flag: None, size: 0, module: None, page: None }),
    }),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_bits() {
        // device 5, dev memory (1 << 10), huge page, module HCCL (3).
        let f = decode_flag(5 | (1 << 10) | (1 << 17) | (3 << 56));
        assert_eq!(f, Flag { device: 5, mem_type: 1, page: PageType::Huge, module: 3 });
        assert_eq!(decode_flag(1 << 31).page, PageType::Giant);
        assert_eq!(decode_flag((2 << 10) | 1023).mem_type, MEM_TYPE_HOST);
        assert_eq!(decode_flag(1023).device, 1023);
    }

    #[test]
    fn owners_use_cann_module_names() {
        assert_eq!(owner(3), "CANN@HCCL");
        assert_eq!(owner(7), "CANN@RUNTIME");
        assert_eq!(owner(33), "CANN@APP");
        assert_eq!(owner(45), "CANN@GE");
        assert_eq!(owner(74), "CANN@AML");
        assert_eq!(owner(200), "CANN@UNKNOWN");
    }

    #[test]
    fn mem_create_decodes_each_value_from_its_own_read() {
        let call = crate::apis::call_reading(
            Api::HalMemCreate,
            &[
                (FieldRead::arg_at_exit(0, 0, 8), 0x77),
                // prop->{side, devid}: the device in the high half.
                (FieldRead::arg_at_entry(2, 0, 8), 5 << 32),
                // prop->{module_id, pg_type}: huge pages, module 33.
                (FieldRead::arg_at_entry(2, 8, 8), (1 << 32) | 33),
            ],
        );
        let Op::MallocPhysical { handle, device, driver: Some(d), .. } = (Api::HalMemCreate.def().decode)(&call) else {
            panic!("a physical allocation")
        };
        assert_eq!((handle, device, d.module, d.page), (Some(0x77), Some(5), Some(33), Some(PageType::Huge)));
    }
}
