//! A cluster's jobs: which rank of which launch each traced process is ([`identity`]), and which
//! Kubernetes pod and container it runs in ([`pod`]).

pub mod identity;
pub mod pod;
