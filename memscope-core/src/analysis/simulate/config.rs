//! A simulation's allocator settings: the allocator-configuration string as PyTorch and
//! torch_npu parse it (`PYTORCH_CUDA_ALLOC_CONF` / `PYTORCH_NPU_ALLOC_CONF`), the per-process
//! memory fraction (an API call the trace does not see, so given here, as the item
//! `per_process_memory_fraction:F` of a setting or `--fraction`), and the device's capacity.
//! Values the allocators refuse are refused here with their words.

use super::allocator::{LARGE_BUFFER, MIN_BLOCK};
use crate::analysis::advise::AllocConf;

/// The setting key that changes the per-process fraction in one simulation.
pub const FRACTION_KEY: &str = "per_process_memory_fraction";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SettingError {
    #[error("setting {setting:?}: {why}")]
    Invalid { setting: String, why: String },
    #[error("setting {setting:?}: `{key}` is not modelled by the simulator (it models expandable_segments, max_split_size_mb, garbage_collection_threshold, roundup_power2_divisions with one value, and {FRACTION_KEY}); leave it out")]
    Unmodelled { setting: String, key: String },
    #[error("setting {setting:?}: a per-process memory fraction needs the device's capacity, which the trace does not record; pass --capacity (e.g. --capacity 64GiB)")]
    NoCapacity { setting: String },
}

/// Whose allocator: torch_npu pads every request by 32 bytes before rounding it
/// (`AddPadSize()`, NPUCachingAllocator.cpp:2132, 189-204; 0 only on Ascend950 with CANN 9.1 or
/// later), so a 1 MiB request is a large-pool one on Ascend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Flavour {
    #[default]
    Cuda,
    Npu,
}

impl Flavour {
    pub fn of(backend: crate::apis::Backend) -> Self {
        match backend {
            crate::apis::Backend::Cuda => Self::Cuda,
            _ => Self::Npu,
        }
    }

    fn pad(self) -> u64 {
        match self {
            Self::Cuda => 0,
            Self::Npu => 32,
        }
    }
}

/// What the model reads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Config {
    pub expandable: bool,
    /// `max_split_size_mb` in bytes; `u64::MAX` when unset.
    pub max_split: u64,
    /// 0 when unset.
    pub gc_threshold: f64,
    pub fraction: Option<f64>,
    pub capacity: Option<u64>,
    /// `roundup_power2_divisions`; 0 when unset.
    pub divisions: u64,
    pub flavour: Flavour,
}

impl Config {
    /// The settings of `text` over `base` (the run's own configuration), with the fraction and
    /// capacity given beside them.
    pub(crate) fn parse(
        text: &str,
        base: &AllocConf,
        fraction: Option<f64>,
        capacity: Option<u64>,
        flavour: Flavour,
    ) -> Result<Self, SettingError> {
        let invalid = |why: String| SettingError::Invalid { setting: text.to_owned(), why };
        let mut cfg = Config {
            expandable: false,
            max_split: u64::MAX,
            gc_threshold: 0.0,
            fraction,
            capacity,
            divisions: 0,
            flavour,
        };
        let asked = AllocConf::parse(text);
        for (key, value) in base.items().chain(asked.items()) {
            match key {
                "expandable_segments" => cfg.expandable = parse_bool(value).map_err(invalid)?,
                "max_split_size_mb" => {
                    let mib: u64 = value
                        .parse()
                        .map_err(|_| invalid(format!("max_split_size_mb:{value} is not a whole number of MiB")))?;
                    let floor = LARGE_BUFFER >> 20;
                    if mib <= floor {
                        return Err(invalid(format!(
                            "max_split_size_mb must be > {floor} (the allocators refuse {mib})"
                        )));
                    }
                    cfg.max_split = mib.saturating_mul(1 << 20);
                }
                "garbage_collection_threshold" => {
                    let t: f64 = value
                        .parse()
                        .map_err(|_| invalid(format!("garbage_collection_threshold:{value} is not a number")))?;
                    if !(t > 0.0 && t < 1.0) {
                        return Err(invalid(
                            "garbage_collection_threshold must be between 0.0 and 1.0, exclusive".into(),
                        ));
                    }
                    cfg.gc_threshold = t;
                }
                "roundup_power2_divisions" => {
                    let d: u64 = value.parse().map_err(|_| SettingError::Unmodelled {
                        setting: text.to_owned(),
                        key: format!("{key}:{value}"),
                    })?;
                    if !d.is_power_of_two() {
                        return Err(invalid(format!("roundup_power2_divisions:{d} must be a power of 2")));
                    }
                    cfg.divisions = d;
                }
                FRACTION_KEY => {
                    let f: f64 =
                        value.parse().map_err(|_| invalid(format!("{FRACTION_KEY}:{value} is not a number")))?;
                    if !(f > 0.0 && f <= 1.0) {
                        return Err(invalid(format!("{FRACTION_KEY} must be in (0, 1], not {f}")));
                    }
                    cfg.fraction = Some(f);
                }
                _ => return Err(SettingError::Unmodelled { setting: text.to_owned(), key: key.to_owned() }),
            }
        }
        if cfg.expandable && (cfg.max_split != u64::MAX || cfg.gc_threshold > 0.0) {
            // torch_npu's NPUAllocatorConfig refuses the combination (docs/simulate.md).
            return Err(invalid("torch_npu refuses expandable_segments:True together with max_split_size_mb or garbage_collection_threshold".into()));
        }
        if cfg.fraction.is_some() && cfg.capacity.is_none() {
            return Err(SettingError::NoCapacity { setting: text.to_owned() });
        }
        Ok(cfg)
    }

    /// The request rounded as the allocator rounds it.
    pub(crate) fn round_size(&self, req: u64) -> u64 {
        let size = req + self.flavour.pad();
        if size < MIN_BLOCK {
            return MIN_BLOCK;
        }
        if self.divisions > 1 && size > MIN_BLOCK * self.divisions {
            return next_division(size, self.divisions);
        }
        size.next_multiple_of(MIN_BLOCK)
    }

    /// The request to replay: a block size the allocator already padded and rounded gives back
    /// its padding, so that it rounds to itself again.
    pub(crate) fn request(&self, size: u64, rounded: bool) -> u64 {
        if rounded {
            size.saturating_sub(self.flavour.pad())
        } else {
            size
        }
    }

    /// The garbage collector runs only with both a fraction and a threshold.
    pub(crate) fn gc_enabled(&self) -> bool {
        self.fraction.is_some() && self.gc_threshold > 0.0
    }

    /// The bytes the fraction allows.
    pub(crate) fn allowed(&self) -> Option<u64> {
        Some((self.fraction? * self.capacity? as f64) as u64)
    }
}

fn parse_bool(value: &str) -> Result<bool, String> {
    match value {
        "True" | "true" => Ok(true),
        "False" | "false" => Ok(false),
        _ => Err(format!("expected True or False, not {value:?}")),
    }
}

/// The next of `divisions` equal steps between the powers of two around `size`.
fn next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = floor >> divisions.trailing_zeros();
    if step == 0 {
        return floor << 1;
    }
    let down = size & !(step - 1);
    if down == size {
        size
    } else {
        down + step
    }
}
