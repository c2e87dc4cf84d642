//! The DB vocabulary: the `Event` and `Event Type` values and the `Attr` keys of `memscope_dump`
//! rows, defined once for the writer (`store::insight`) and the readers (`analysis`), so a name
//! cannot drift between the two (docs/db-schema.md, "Event vocabulary and Attr keys", is the
//! table of what each means; a test keeps it and this file in step).
//!
//! msMemScope's names are kept as it spells them (`Range_start`, `HOST_PINNED`), because Insight
//! matches them byte for byte. `API_ERROR` and `VMM` (and their types) are ours.

/// Declares a vocabulary enum: its variants and their exact spellings, with `as_str`, `parse`
/// and `ALL` (the order is the declaration's).
macro_rules! vocabulary {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal,)* }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $($(#[$vmeta])* $variant,)*
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [Self] = &[$(Self::$variant,)*];

            /// The value as the DB spells it.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $text,)*
                }
            }

            /// The value a DB cell spells, if it is one of ours or msMemScope's.
            pub fn parse(text: &str) -> Option<Self> {
                match text {
                    $($text => Some(Self::$variant),)*
                    _ => None,
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

vocabulary! {
    /// The `Event` column.
    Event {
        /// A block was allocated (device, pinned host, CPU or pool block).
        Malloc = "MALLOC",
        /// A block was freed (or a shadow free written at the stop).
        Free = "FREE",
        /// An allocation failed for lack of memory, and the blocks live at that instant.
        OomDetail = "OOM_DETAIL",
        /// Any other traced call failed (ours).
        ApiError = "API_ERROR",
        /// Address reservations and physical memory (ours).
        Vmm = "VMM",
        /// Trace start and stop, step boundaries.
        System = "SYSTEM",
        /// Marks and ranges (mstx or the markers).
        Mstx = "MSTX",
        /// Operators and ATB operations.
        OpLaunch = "OP_LAUNCH",
        /// A kernel launch.
        KernelLaunch = "KERNEL_LAUNCH",
        /// A use of a live block.
        Access = "ACCESS",
    }
}

vocabulary! {
    /// The `Event Type` column: for memory events, who allocated (the layer or pool); for the
    /// others, what happened.
    EventType {
        /// The runtime or the driver (device memory).
        Hal = "HAL",
        /// Pinned host memory (`aclrtMallocHost`).
        HostPinned = "HOST_PINNED",
        /// PyTorch's CPU allocator (CPU tensor storage); also the type of failed host calls.
        Host = "HOST",
        /// torch_npu's caching or workspace allocator.
        Pta = "PTA",
        /// The workspace pool's blocks, as the `type` of an access and in msMemScope's DBs.
        PtaWorkspace = "PTA_WORKSPACE",
        /// MindSpore's allocator (read in msMemScope's DBs; never written by us).
        Mindspore = "MINDSPORE",
        /// The failed allocation itself.
        OomTrigger = "OOM_TRIGGER",
        /// One of the most recent blocks live at an OOM.
        OomRecentAlloc = "OOM_RECENT_ALLOC",
        /// One of the largest blocks live at an OOM.
        OomTopAlloc = "OOM_TOP_ALLOC",
        /// Address space reserved.
        Reserve = "RESERVE",
        /// Address space released.
        Release = "RELEASE",
        /// Physical memory created.
        PhysicalMalloc = "PHYSICAL_MALLOC",
        /// Physical memory released.
        PhysicalFree = "PHYSICAL_FREE",
        /// The first row of a file.
        StartTrace = "START_TRACE",
        /// The last row of a file.
        StopTrace = "STOP_TRACE",
        /// A step boundary.
        Step = "STEP",
        /// An mstx mark.
        Mark = "Mark",
        /// An mstx range opened.
        RangeStart = "Range_start",
        /// An mstx range closed.
        RangeEnd = "Range_end",
        /// An operator began (`trace_ops()`).
        AtenStart = "ATEN_START",
        /// An operator ended.
        AtenEnd = "ATEN_END",
        /// An ATB operation began.
        AtbStart = "ATB_START",
        /// An ATB operation ended.
        AtbEnd = "ATB_END",
        /// A kernel launch (Event and Event Type are the same).
        KernelLaunch = "KERNEL_LAUNCH",
        /// A block read.
        Read = "READ",
        /// A block written.
        Write = "WRITE",
        /// A block used in an unknown direction (a kernel's argument).
        Unknown = "UNKNOWN",
    }
}

/// The `Attr` keys, named as they are spelt so that `attr_fields!` structs in the analyses can
/// name each field's key: a reader of a key no writer knows does not compile.
#[expect(non_upper_case_globals, reason = "each constant is named exactly as the key it spells")]
pub mod attr {
    /// Declares each key as a constant spelling its own name, and `ALL` of them.
    macro_rules! keys {
        ($($(#[$meta:meta])* $key:ident $(= $text:literal)?,)*) => {
            $($(#[$meta])* pub const $key: &str = keys!(@text $key $($text)?);)*
            /// Every key, in declaration order.
            pub const ALL: &[&str] = &[$($key,)*];
        };
        (@text $key:ident) => { stringify!($key) };
        // A key that is a Rust keyword is a raw identifier, whose `stringify!` keeps the `r#`.
        (@text $key:ident $text:literal) => { $text };
    }

    keys! {
        /// The block's (or access's) address.
        addr,
        /// Bytes: a block's size, the bytes a call copied, a segment's size.
        size,
        /// Bytes a caller requested (before rounding or the driver's granularity).
        req_size,
        /// Under sampling (`daemon --sample-bytes`), the bytes a recorded block stands for:
        /// totals of sampled rows sum it in place of `size`. Absent: the row is exact.
        weight,
        /// The block's id, unique in its file (Insight pairs a block's rows by it).
        allocation_id,
        /// The traced API behind the row.
        api,
        /// The driver API merged into a runtime call's row.
        hal_api,
        /// Bytes live after the event (on the device, or in the pool).
        used,
        /// A pool's reserved bytes; on `START_TRACE`, the device's memory (the driver's figure).
        total,
        /// On `START_TRACE`: the device's free memory then, as the driver reported it.
        free,
        /// The driver's figure for the process's device memory (what npu-smi or nvidia-smi shows
        /// for it), at its latest reading before the row.
        process_used,
        /// The driver's figure for the whole device's used memory, at the same reading.
        device_used,
        /// The pool of a block (`caching`, `workspace`), or of an OOM block (`PTA`, `HAL`, ...).
        pool,
        /// The owner path (`PTA@vllm@kv_cache`).
        owner,
        /// Where the owner path came from: `marker` (spans or address tags) or `inferred` (the
        /// rules, from the allocation's Python stack); absent: the allocator's label alone.
        owner_source,
        /// The innermost frame of the job's own code at the allocation (`file:line function`).
        site,
        /// `main_thread`: the allocating thread ran no Python, so the Python stack behind the
        /// row's owner and site is the main thread's at that instant.
        py_stack_of,
        /// The allocation's Python stack: its `id` in `ms_py_stacks` (the report's flame view).
        py_stack,
        /// A synthetic free written at the stop for a block still live.
        shadow,
        /// A FREE of a block the trace never saw allocated.
        unmatched,
        /// A workspace FREE inferred from the next use.
        implied,
        /// What freed the block (`gc`: Python's collector).
        freed_by,
        /// Other streams still marking a freed pool block.
        stream_uses,
        /// The stream a pool block was requested on (hex: a stream handle or id), which the
        /// caching allocator keeps its free blocks apart by.
        stream,
        /// A device block taken by torch_npu's allocator for its own pool (`caching`, `workspace`).
        segment,
        /// Pinned host memory.
        pinned,
        /// The driver flag (hex).
        flag,
        /// The driver's page class.
        page_type,
        /// How the driver took the memory (`alloc`, `create`).
        alloc_type,
        /// The module id from the driver flag.
        module_id,
        /// The runtime's allocation policy.
        policy,
        /// A mapping of physical memory (`aclrtMapMem`).
        vmm,
        /// A physical memory handle.
        handle,
        /// A mapping's offset into its physical memory.
        offset,
        /// The call's return status.
        status,
        /// The failing function of an OOM.
        func,
        /// An OOM block's address.
        ptr,
        /// An OOM block's MALLOC time.
        timestamp,
        /// An OOM block's rank (1 = most recent / largest).
        rank,
        /// An access's block pool.
        r#type = "type",
        /// An access's block start.
        block,
        /// A tensor's element type.
        dtype,
        /// A tensor's shape.
        shape,
        /// A tensor's description the markers gave in another form than `dtype[shape]`.
        tensor,
        /// A kernel launch's stream.
        streamId,
        /// A kernel launch's function handle.
        function,
        /// The bytes appended to a kernel's argument handle.
        args_size,
        /// An ATB operation's workspace buffer.
        workspace_ptr,
        /// An ATB operation's kernel scratch bytes.
        workspace_size,
        /// An ATB graph's intermediate tensor bytes.
        intermediate_size,
        /// An ATB Runner object's address.
        runner,
        /// A range's id.
        id,
        /// Where a mark came from (the mstx function, or `memscope`).
        source,
        /// The tool that wrote the file.
        tool,
        /// The tool's version.
        version,
        /// The trace's mode.
        mode,
        /// Why the trace stopped.
        stop_reason,
        /// The inefficient-memory flags the analysis wrote back onto a MALLOC.
        inefficient_type,
        /// The operation path msMemScope's DBs give an ATB workspace block.
        path,
    }
}

/// `Attr.freed_by` of a FREE made inside a pass of Python's garbage collector (not msMemScope's:
/// it cannot see the collector). `analysis::gc_held` reads it.
pub const GC: &str = "gc";
/// `Attr` key of a FREE of a block the trace never saw allocated.
pub const UNMATCHED: &str = attr::unmatched;
/// `Attr` key of a PTA FREE whose block was still marked on other streams (`recordStream`), so
/// the allocator kept it until their work completed (not msMemScope's). `analysis::stream_reuse`
/// reads it.
pub const STREAM_USES: &str = attr::stream_uses;

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// The vocabulary section of docs/db-schema.md: every name the DB may hold is documented.
    fn schema_doc() -> String {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/db-schema.md");
        std::fs::read_to_string(path).expect("docs/db-schema.md")
    }

    #[test]
    fn every_value_parses_back_and_is_spelt_once() {
        for e in Event::ALL {
            assert_eq!(Event::parse(e.as_str()), Some(*e));
        }
        for t in EventType::ALL {
            assert_eq!(EventType::parse(t.as_str()), Some(*t));
        }
        assert_eq!(Event::parse("malloc"), None, "spellings are exact, as Insight matches them");
        let keys: HashSet<_> = attr::ALL.iter().collect();
        assert_eq!(keys.len(), attr::ALL.len());
        assert_eq!(attr::r#type, "type", "a raw identifier spells the bare key");
    }

    #[test]
    fn every_name_is_in_the_schema_document() {
        let doc = schema_doc();
        let documented = |name: &str| doc.contains(&format!("`{name}`")) || doc.contains(&format!("`{name}=`"));
        let names = Event::ALL.iter().map(|e| e.as_str()).chain(EventType::ALL.iter().map(|t| t.as_str()));
        let missing: Vec<&str> = names.chain(attr::ALL.iter().copied()).filter(|n| !documented(n)).collect();
        assert!(missing.is_empty(), "not in docs/db-schema.md: {missing:?}");
    }
}
