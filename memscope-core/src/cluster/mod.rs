//! A cluster's jobs: which rank of which launch each traced process is ([`identity`]).

pub mod identity;
