//! Empty on purpose: the programs are in the `memscope` binary target (src/main.rs). The library
//! target exists so that `memscope-user` can name this crate as a build dependency, which makes
//! cargo rebuild the user binary when the eBPF sources change.
#![no_std]
