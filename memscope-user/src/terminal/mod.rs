//! What the person watching reads while a verb runs: lines on stderr that never end a trace
//! ([`say`]), the live status of `trace` and `daemon` ([`status`]), and the progress of long
//! offline work ([`progress`]).

pub mod progress;
pub mod say;
pub mod status;
