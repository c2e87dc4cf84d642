//! The traced APIs: for each one, the symbol names to attach, the capture rules handed to the BPF
//! probes ([`ProbeSpec`]) and how a captured call decodes into a model [`Op`].
//!
//! This table is the only place that knows API semantics. The BPF side is generic, and the model
//! works on [`Op`]s, so adding an API is a row here plus a stand-in function and a ledger test.
//! One file per family: [`acl`] (runtime), [`hal`] (driver).

mod acl;
pub mod hal;

use memscope_common::spec::{FieldRead, ProbeSpec, MAX_FIELDS};

use crate::model::Op;
use crate::record::RawCall;

/// A traced API. The discriminant is the spec index in the BPF `SPECS` map (and part of the
/// attach cookie), so it must stay below `MAX_SPECS` and never be renumbered within one build.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum Api {
    AclrtSetDevice = 1,
    AclrtGetDevice = 2,
    AclrtMalloc = 3,
    AclrtMallocAlign32 = 4,
    AclrtMallocCached = 5,
    AclrtMallocWithCfg = 6,
    AclrtFree = 7,
    AclrtMallocHost = 8,
    AclrtFreeHost = 9,
    AclrtReserveMemAddress = 10,
    AclrtReleaseMemAddress = 11,
    AclrtMallocPhysical = 12,
    AclrtFreePhysical = 13,
    AclrtMapMem = 14,
    AclrtUnmapMem = 15,
    HalMemAlloc = 16,
    HalMemFree = 17,
    HalMemCreate = 18,
    HalMemRelease = 19,
}

/// Which group of libraries an API lives in; decides where symbols are looked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// The ACL runtime: `libascendcl.so`, or `libacl_rt.so` + `libacl_rt_impl.so` in newer CANN.
    AclRuntime,
    /// The driver: `libascend_hal.so`.
    Hal,
}

impl Family {
    pub const ALL: [Family; 2] = [Family::AclRuntime, Family::Hal];

    /// Library file names (without version suffixes) that carry this family's symbols.
    pub fn library_names(self) -> &'static [&'static str] {
        match self {
            Self::AclRuntime => &["libascendcl.so", "libacl_rt.so", "libacl_rt_impl.so"],
            Self::Hal => &["libascend_hal.so"],
        }
    }

    /// The suffix of the implementation symbol a public function forwards to (`aclrtMallocImpl`,
    /// `halMemAllocInner`).
    pub fn impl_suffix(self) -> &'static str {
        match self {
            Self::AclRuntime => "Impl",
            Self::Hal => "Inner",
        }
    }

    /// What a user calls this layer.
    pub fn describe(self) -> &'static str {
        match self {
            Self::AclRuntime => "ACL runtime",
            Self::Hal => "driver (HAL)",
        }
    }
}

/// One row of the table.
pub struct ApiDef {
    pub api: Api,
    /// The public symbol.
    pub symbol: &'static str,
    pub family: Family,
    pub spec: ProbeSpec,
    pub decode: fn(&RawCall) -> Op,
    /// Whether a failure status means "out of memory" (msMemScope's OOM trigger).
    pub out_of_memory: fn(i32) -> bool,
}

/// Builds a spec: layer, outer layer and field reads; everything else as in [`ProbeSpec::EMPTY`].
pub const fn spec(layer: u32, outer_layer: u32, fields: &[FieldRead]) -> ProbeSpec {
    let mut s = ProbeSpec::EMPTY;
    s.layer = layer;
    s.outer_layer = outer_layer;
    let mut i = 0;
    while i < fields.len() && i < MAX_FIELDS {
        s.fields[i] = fields[i];
        i += 1;
    }
    s
}

impl Api {
    /// Every API, in spec-id order.
    pub fn all() -> impl Iterator<Item = &'static ApiDef> {
        acl::TABLE.iter().chain(hal::TABLE.iter())
    }

    pub fn def(self) -> &'static ApiDef {
        Self::all().find(|def| def.api == self).expect("every Api variant has a table row (checked by a unit test)")
    }

    pub fn from_spec_id(id: u32) -> Option<Self> {
        Self::all().find(|def| def.api as u32 == id).map(|def| def.api)
    }

    pub fn spec_id(self) -> u32 {
        self as u32
    }

    /// The public name, used in the DB whichever symbol (public or implementation) was hit.
    pub fn name(self) -> &'static str {
        self.def().symbol
    }

    pub fn family(self) -> Family {
        self.def().family
    }

    pub fn impl_symbol(self) -> String {
        format!("{}{}", self.def().symbol, self.family().impl_suffix())
    }
}

#[cfg(test)]
mod tests {
    use memscope_common::spec::MAX_SPECS;

    use super::*;

    #[test]
    fn every_api_has_one_row_and_a_valid_cookie() {
        let ids: Vec<u32> = Api::all().map(|d| d.api as u32).collect();
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(ids.len(), sorted.len(), "duplicate table rows");
        for def in Api::all() {
            assert!(def.api.spec_id() > 0 && def.api.spec_id() < MAX_SPECS);
            assert_ne!(def.spec.layer, 0, "{} has no layer: its probes would do nothing", def.symbol);
            assert_eq!(Api::from_spec_id(def.api.spec_id()), Some(def.api));
        }
        for id in 1..=Api::HalMemRelease as u32 {
            assert!(Api::from_spec_id(id).is_some(), "spec id {id} has no row");
        }
    }
}
