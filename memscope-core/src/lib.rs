//! memscope-bpf's core, everything that needs neither aya nor the eBPF toolchain: what each traced
//! API means, the events and the tracker that turns them into live blocks per device, the DB
//! vocabulary and the store that writes msMemScope's layout, and the offline analyses that read it
//! back. `memscope-user` (the `memscope-bpf` binary) adds attaching, mapping the ring buffer, the
//! trace session, the daemon and the CLI on top; each ring sample's bytes enter here once
//! ([`ingest`]) and flow down.
//!
//! Module map (arrows point down only):
//! ```text
//! ingest    ring bytes to events (decoder, thread stacks, clock), events to rows (recorder),
//!           and the online view fed the same facts (live)
//! report    a trace (or two) as the self-contained HTML page `report` writes
//! export    written DBs in other tools' formats (PyTorch's memory_viz snapshot, Perfetto)
//!    └─ analysis  (their DB reader, the decomposition, steps and instants)
//! analysis  offline analyses of written DBs
//! import    msMemScope's captures by content; its dump CSV into a DB (below analysis, above store)
//!    └─ store    per-device SQLite/CSV in msMemScope's layout
//!         └─ model    events, live blocks per device (no I/O)
//!              └─ apis     what each traced API means (the catalogue) and what a call did (`Op`)
//!                   └─ raw      ring-buffer bytes to checked, typed records
//! infer     what an unmodified job's Python frames say: owners, phases, sites (below model,
//!           beside stacks)
//! vocab     the DB's Event, Event Type and Attr names (below store and analysis, beside all)
//! sampling  the daemon's gap table and the error of sampled totals (beside all)
//! cluster   a traced process's rank and job, from its launcher's variables (beside all)
//! files     opening what the user names as input: regular files only, never blocking (beside all)
//! printable text the traced process controls, escaped for terminals and logs (beside all)
//! ```

pub mod analysis;
pub mod apis;
pub mod cluster;
pub mod export;
pub mod files;
pub mod import;
pub mod infer;
pub mod ingest;
pub mod model;
pub mod printable;
pub mod raw;
pub mod report;
pub mod sampling;
pub mod stacks;
pub mod store;
pub mod units;
pub mod vocab;
