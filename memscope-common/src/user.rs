//! Userspace-only trait impls, so aya can copy these types in and out of maps.

use crate::{record::CallRecord, spec::ProbeSpec, usdt::UsdtSpec};

// SAFETY: both are `#[repr(C)]`, contain only integers and have no padding (sizes asserted).
unsafe impl aya::Pod for ProbeSpec {}
// SAFETY: as above.
unsafe impl aya::Pod for CallRecord {}
// SAFETY: as above.
unsafe impl aya::Pod for UsdtSpec {}
// SAFETY: as above.
unsafe impl aya::Pod for crate::python::PyProcess {}
// SAFETY: as above (`_pad` makes the padding explicit).
unsafe impl aya::Pod for crate::filter::CgroupRule {}
// SAFETY: plain `repr(C)` integers, no padding the kernel would not also write.
unsafe impl aya::Pod for crate::sampling::BlockKey {}
// SAFETY: as above.
unsafe impl aya::Pod for crate::sampling::CountedBlock {}
// SAFETY: as above.
unsafe impl aya::Pod for crate::sampling::CounterKey {}
// SAFETY: as above.
unsafe impl aya::Pod for crate::sampling::Counters {}
